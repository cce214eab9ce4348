"""Table configuration, the unsharded reference ``EmbeddingBagCollection``, and reports.

``HeldTables`` is what every embedding collection reports to the trainer.
"""

from tetrarec.embedding.collection import EmbeddingBagCollection, check_ids
from tetrarec.embedding.config import SparseOptimizerSpec, TableConfig, TableSlice, feature_order
from tetrarec.embedding.init import draw_seed, init_rows
from tetrarec.embedding.report import CacheCounters, HeldTables

__all__ = [
    "CacheCounters",
    "EmbeddingBagCollection",
    "HeldTables",
    "SparseOptimizerSpec",
    "TableConfig",
    "TableSlice",
    "check_ids",
    "draw_seed",
    "feature_order",
    "init_rows",
]
