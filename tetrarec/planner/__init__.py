"""The sharding planner: a sharding type, ranks, tier and precision per table, and why.

``stats``: per-feature pooling and access skew measured from a data sample
(``tetrarec stats``), the planner's statistics input.

Pure functions over frozen data choose, for every table, a sharding type, the ranks, a
memory tier and a row precision, and say why.

``plan(inputs)`` returns a ``ShardingPlan`` (validated against the tables) and a
``PlanReport``; ``inputs_from_config`` builds the inputs from a run config, a
``Topology`` and optional ``tetrarec stats`` statistics. It never runs kernels or
collectives. Formulas: ``cost.py``; search: ``search.py`` (candidates:
``candidates.py``; greedy placement: ``partition.py``; local improvement: ``refine.py``);
``docs/design/planner.md``. The planner names no sharding type: it reads each type's cost
terms and candidate shard counts from the strategy registry
(``tetrarec.sharding.strategy``).
"""

from __future__ import annotations

import time

from tetrarec.planner.candidates import candidates
from tetrarec.planner.cost import Option
from tetrarec.planner.inputs import (
    AccessStats,
    PlannerInputs,
    TableSpec,
    dense_cost,
    inputs_from_config,
    load_stats,
    state_bytes_per_row,
)
from tetrarec.planner.report import PlanReport, RankReport, TableReport, evaluate, predict
from tetrarec.planner.search import (
    PlannerError,
    Shortfall,
    TableChoice,
    fit_precisions,
    search,
)
from tetrarec.planner.stats import DEFAULT_MAX_ROWS, FeatureStat, FeatureStats, feature_stats
from tetrarec.planner.topology import RankResources, Tier, Topology, preset_names
from tetrarec.sharding.plan import ShardingPlan

__all__ = [
    "DEFAULT_MAX_ROWS",
    "AccessStats",
    "FeatureStat",
    "FeatureStats",
    "Option",
    "PlanReport",
    "PlannerError",
    "PlannerInputs",
    "RankReport",
    "RankResources",
    "Shortfall",
    "TableChoice",
    "TableReport",
    "TableSpec",
    "Tier",
    "Topology",
    "candidates",
    "dense_cost",
    "evaluate",
    "feature_stats",
    "fit_precisions",
    "inputs_from_config",
    "load_stats",
    "plan",
    "predict",
    "preset_names",
    "search",
    "state_bytes_per_row",
]


def plan(inputs: PlannerInputs) -> tuple[ShardingPlan, PlanReport]:
    """Plan ``inputs``: the ``ShardingPlan`` and its ``PlanReport``.

    Raises:
        PlannerError: when some tables fit nowhere (naming them, the tier and the
            shortfall in bytes, and what would make them fit).
    """
    start = time.perf_counter()
    sharding_plan, choices = search(inputs)
    seconds = time.perf_counter() - start
    return sharding_plan, evaluate(inputs, sharding_plan, choices, plan_seconds=seconds)
