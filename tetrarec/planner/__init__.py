"""The sharding planner's inputs and search (pure functions over frozen data).

``stats``: per-feature pooling and access skew measured from a data sample
(``tetrarec stats``).
"""

from tetrarec.planner.stats import DEFAULT_MAX_ROWS, FeatureStat, FeatureStats, feature_stats

__all__ = ["DEFAULT_MAX_ROWS", "FeatureStat", "FeatureStats", "feature_stats"]
