"""Table configuration and the unsharded reference ``EmbeddingBagCollection``."""

from tetrarec.embedding.collection import EmbeddingBagCollection, check_ids
from tetrarec.embedding.config import SparseOptimizerSpec, TableConfig, feature_order

__all__ = [
    "EmbeddingBagCollection",
    "SparseOptimizerSpec",
    "TableConfig",
    "check_ids",
    "feature_order",
]
