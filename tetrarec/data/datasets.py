"""The ``Dataset`` protocol and the datasets over Criteo-shaped columns.

A dataset is random access: ``read(indices)`` returns the ``Batch`` of those rows, in
that order. Loaders choose the rows (shuffling, rank slicing); datasets only read.
Datasets return raw dense values; ``tetrarec.data.dense`` transforms them. A dataset
whose stored dense values are already transformed says so in ``dense_applied``. A
dataset read from files without labels (scoring input) says ``has_labels = False`` and
its batches' labels are NaN; ``has_labels(dataset)`` asks any dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from tetrarec.data.config import DenseKind
from tetrarec.data.errors import BadLineSummary, DataError
from tetrarec.data.transforms import hash_ids
from tetrarec.embedding.config import TableConfig, feature_order
from tetrarec.sparse import Batch, SparseFeatures

__all__ = [
    "ColumnsDataset",
    "Dataset",
    "DenseRows",
    "RowRange",
    "check_indices",
    "has_labels",
    "read_dense_rows",
    "table_rows_per_feature",
]


@runtime_checkable
class Dataset(Protocol):
    """Random-access rows of (dense, sparse, label).

    Attributes:
        num_samples: rows, numbered ``[0, num_samples)``.
        num_dense: dense features per row.
        keys: sparse feature names, in order (the tables' ``feature_order``).
    """

    num_samples: int
    num_dense: int
    keys: tuple[str, ...]

    def read(self, indices: np.ndarray) -> Batch:
        """The batch of rows ``indices`` (any order, repeats allowed), in that order."""
        ...


@runtime_checkable
class DenseRows(Protocol):
    """A dataset that reads a contiguous range of raw dense rows cheaply (no sparse part)."""

    def read_dense(self, start: int, stop: int) -> np.ndarray:
        """``(stop - start, num_dense)`` raw dense values of rows ``[start, stop)``."""
        ...


def read_dense_rows(dataset: Dataset, start: int, stop: int) -> np.ndarray:
    """Raw dense values of rows ``[start, stop)`` of ``dataset``, ``(stop - start, D)``.

    Uses ``read_dense`` when the dataset has it (a slice of memory-mapped columns),
    else ``read`` (which also builds the sparse part).
    """
    if isinstance(dataset, DenseRows):
        return dataset.read_dense(start, stop)
    return dataset.read(np.arange(start, stop, dtype=np.int64)).dense.numpy()


def has_labels(dataset: Dataset) -> bool:
    """Whether ``dataset``'s rows carry labels (false: its batches' labels are NaN).

    Datasets that always have labels (synthetic, binary) need not say so.
    """
    return bool(getattr(dataset, "has_labels", True))


def check_indices(indices: np.ndarray, num_samples: int) -> np.ndarray:
    """``indices`` as int64, checked to lie in ``[0, num_samples)``.

    Raises:
        ValueError: naming the range and the offending extremes.
    """
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= num_samples):
        raise ValueError(
            f"row indices must be in [0, {num_samples}), got [{idx.min()}, {idx.max()}]"
        )
    return idx


def table_rows_per_feature(tables: Sequence[TableConfig], num_features: int) -> np.ndarray:
    """``(F,)`` rows of the table each feature looks up, in ``feature_order``.

    Raises:
        ValueError: if the tables have a different number of features than the data.
    """
    keys = feature_order(list(tables))
    if len(keys) != num_features:
        raise ValueError(
            f"the data has {num_features} sparse features but the tables have {len(keys)}: {keys}"
        )
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    return np.array([rows[k] for k in keys], dtype=np.int64)


class ColumnsDataset:
    """One-hot rows over in-memory or memory-mapped columns (raw Criteo, binary).

    Categorical values are stored raw and hashed into each feature's table at read
    time (``hash_ids``), so the same columns serve any table sizes.

    Args:
        labels: ``(N,)`` float32 (NaN without ``has_labels``).
        dense: ``(N, D)`` float32 raw values (missing -> 0).
        sparse: ``(N, F)`` raw integer categorical values.
        tables: the model's tables; feature ``i`` is ``feature_order(tables)[i]``.
        bad_lines: the summary of lines skipped while reading, if any.
        dense_applied: the transform ``dense`` already went through (``log1p`` for a
            binary directory of format version 1), ``none`` for raw values.
        has_labels: whether ``labels`` are the rows' labels (false: files without them).
    """

    def __init__(
        self,
        *,
        labels: np.ndarray,
        dense: np.ndarray,
        sparse: np.ndarray,
        tables: Sequence[TableConfig],
        bad_lines: BadLineSummary | None = None,
        dense_applied: DenseKind = DenseKind.NONE,
        has_labels: bool = True,
    ) -> None:
        self.labels, self.dense, self.sparse = labels, dense, sparse
        self.has_labels = has_labels
        self.dense_applied = DenseKind(dense_applied)
        self.num_samples = int(labels.shape[0])
        self.num_dense = int(dense.shape[1])
        self.keys = feature_order(list(tables))
        self.table_rows = table_rows_per_feature(tables, int(sparse.shape[1]))
        self.bad_lines = bad_lines
        if self.num_samples == 0:
            raise DataError("the dataset has no rows")

    def read(self, indices: np.ndarray) -> Batch:
        """The batch of rows ``indices``; one id per feature and sample.

        Raises:
            ValueError: if an index is out of range.
        """
        idx = check_indices(indices, self.num_samples)
        b = idx.shape[0]
        ids = hash_ids(self.sparse[idx], self.table_rows)  # (B, F)
        values = np.ascontiguousarray(ids.T).reshape(-1)  # (F*B,) key-major
        sparse = SparseFeatures(
            self.keys,
            torch.from_numpy(values),
            torch.ones(values.shape[0], dtype=torch.int64),
            b,
            None,
            (b,) * len(self.keys),
        )
        dense = torch.from_numpy(np.ascontiguousarray(self.dense[idx], dtype=np.float32))
        labels = torch.from_numpy(np.ascontiguousarray(self.labels[idx], dtype=np.float32))
        return Batch(dense, sparse, labels)

    def read_dense(self, start: int, stop: int) -> np.ndarray:
        """Dense rows ``[start, stop)``: a slice of the (memory-mapped) column."""
        dense: np.ndarray = self.dense[start:stop]
        return dense


class RowRange:
    """Rows ``[start, stop)`` of another dataset, renumbered from 0.

    Args:
        base: the dataset.
        start: the first row.
        stop: one past the last row.
        what: names the range in the error (``data.eval_rows``).

    Raises:
        ValueError: if the range is empty or reaches past the dataset.
    """

    def __init__(self, base: Dataset, start: int, stop: int, what: str = "row range") -> None:
        if not 0 <= start < stop <= base.num_samples:
            raise ValueError(
                f"{what} [{start}, {stop}) is not inside the {base.num_samples} rows of the data"
            )
        self.base, self.start, self.stop = base, start, stop
        self.num_samples = stop - start
        self.num_dense = base.num_dense
        self.keys = base.keys
        self.bad_lines: BadLineSummary | None = getattr(base, "bad_lines", None)
        self.dense_applied = DenseKind(getattr(base, "dense_applied", DenseKind.NONE))
        self.has_labels = has_labels(base)

    def read(self, indices: np.ndarray) -> Batch:
        """The batch of rows ``indices`` of the range."""
        return self.base.read(check_indices(indices, self.num_samples) + self.start)

    def read_dense(self, start: int, stop: int) -> np.ndarray:
        """Dense rows ``[start, stop)`` of the range (``read_dense_rows`` of the base)."""
        if not 0 <= start <= stop <= self.num_samples:
            raise ValueError(f"rows [{start}, {stop}) are not inside [0, {self.num_samples})")
        return read_dense_rows(self.base, start + self.start, stop + self.start)
