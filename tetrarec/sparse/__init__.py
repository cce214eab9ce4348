"""Sparse data types: ``SparseFeatures``, ``PooledEmbeddings``, ``Batch`` and pure ops."""

from tetrarec.sparse.batch import Batch
from tetrarec.sparse.features import SparseFeatures
from tetrarec.sparse.ops import (
    offsets_from_lengths,
    permute_keys,
    select_keys,
    slice_batch,
    split_batch,
)
from tetrarec.sparse.pooled import PooledEmbeddings
from tetrarec.sparse.validate import validate_features

__all__ = [
    "Batch",
    "PooledEmbeddings",
    "SparseFeatures",
    "offsets_from_lengths",
    "permute_keys",
    "select_keys",
    "slice_batch",
    "split_batch",
    "validate_features",
]
