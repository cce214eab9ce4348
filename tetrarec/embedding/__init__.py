"""Table configuration and the unsharded reference ``EmbeddingBagCollection``."""

from tetrarec.embedding.collection import EmbeddingBagCollection, check_ids
from tetrarec.embedding.config import SparseOptimizerSpec, TableConfig, TableSlice, feature_order
from tetrarec.embedding.init import draw_seed, init_rows

__all__ = [
    "EmbeddingBagCollection",
    "SparseOptimizerSpec",
    "TableConfig",
    "TableSlice",
    "check_ids",
    "draw_seed",
    "feature_order",
    "init_rows",
]
