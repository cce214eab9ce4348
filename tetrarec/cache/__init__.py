"""Mixed-precision embedding caches and memory tiers (see ``docs/design/cache.md``).

Hot rows are cached and trained in FP32 in front of backing stores in FP16, BF16, INT8
or INT4, held in process memory or in memory-mapped files (``Placement.SSD``).
"""

from tetrarec.cache.collection import CachedEmbeddingBagCollection
from tetrarec.cache.config import CacheSpec, slot_bytes
from tetrarec.cache.policy import Admission, CachePolicy, count_ids, hot_rows, plan_admission
from tetrarec.cache.route import CacheRoute
from tetrarec.cache.stats import CacheMemory, CacheStats

__all__ = [
    "Admission",
    "CacheMemory",
    "CachePolicy",
    "CacheRoute",
    "CacheSpec",
    "CacheStats",
    "CachedEmbeddingBagCollection",
    "count_ids",
    "hot_rows",
    "plan_admission",
    "slot_bytes",
]
