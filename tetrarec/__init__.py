"""tetrarec: train and serve DLRMs whose embedding tables outgrow one device.

Importing tetrarec never initializes CUDA.
"""

from tetrarec.embedding import EmbeddingBagCollection, TableConfig
from tetrarec.sparse import Batch, PooledEmbeddings, SparseFeatures
from tetrarec.types import OptimizerKind, Placement, PoolingMode, Precision, ShardingType

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "EmbeddingBagCollection",
    "OptimizerKind",
    "Placement",
    "PooledEmbeddings",
    "PoolingMode",
    "Precision",
    "ShardingType",
    "SparseFeatures",
    "TableConfig",
    "__version__",
]
