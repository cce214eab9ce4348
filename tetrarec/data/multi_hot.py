"""In-memory multi-hot rows shared by the parquet and csv sources.

A reader turns its file's columns into ``MultiHotColumns`` (raw 64-bit ids, not yet
hashed into tables); ``MultiHotDataset`` hashes them into each feature's table once
and serves ``read(indices)``. ``ColumnMapping`` names the file columns that hold the
label, the dense features and the sparse features.

Legend: ``N`` rows, ``D`` dense features, ``F`` sparse features, ``N_f`` ids of
feature ``f`` over all rows, ``B`` rows read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tetrarec.data.datasets import check_indices, table_rows_per_feature
from tetrarec.data.errors import BadLineSummary, DataError
from tetrarec.data.transforms import hash_ids
from tetrarec.embedding.config import TableConfig, feature_order
from tetrarec.sparse import Batch, SparseFeatures

__all__ = ["ColumnMapping", "MultiHotColumns", "MultiHotDataset"]


@dataclass(frozen=True, kw_only=True)
class ColumnMapping:
    """Which file columns hold the label, the dense and the sparse features.

    Args:
        label_column: the 0/1 label.
        dense_columns: dense features, in order.
        sparse_columns: sparse features, in feature order (one per table feature).

    Raises:
        ValueError: if there is no sparse column, or a column is used twice.
    """

    label_column: str
    dense_columns: tuple[str, ...] = ()
    sparse_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Validate the mapping (``ValueError`` names the field)."""
        object.__setattr__(self, "dense_columns", tuple(self.dense_columns))
        object.__setattr__(self, "sparse_columns", tuple(self.sparse_columns))
        if not self.sparse_columns:
            raise ValueError("ColumnMapping.sparse_columns must name at least one column")
        used = self.columns
        twice = sorted({c for c in used if used.count(c) > 1})
        if twice:
            raise ValueError(f"ColumnMapping uses columns {twice} more than once: {used}")

    @property
    def columns(self) -> tuple[str, ...]:
        """Every mapped column: the label, then the dense, then the sparse ones."""
        return (self.label_column, *self.dense_columns, *self.sparse_columns)


@dataclass(frozen=True, kw_only=True)
class MultiHotColumns:
    """Rows with raw (unhashed) ids, feature by feature.

    Feature ``f``'s bags are ``ids[f][offsets[f][i]:offsets[f][i+1]]`` for row ``i``::

        row           0          1        2
        ids[f]     [ a  b ]   [ ]      [ c ]        (N_f,) int64 raw ids
        offsets[f] 0        2      2         3      (N+1,) int64

    A one-hot feature has one id per row (``offsets[f] == arange(N+1)``).

    Args:
        labels: ``(N,)`` float32 in {0, 1}; NaN when not ``labeled``.
        dense: ``(N, D)`` float32, raw values (missing -> 0).
        ids: per feature, ``(N_f,)`` int64 raw ids (integer values, or
            ``hash_strings`` of string values).
        offsets: per feature, ``(N+1,)`` int64 bag boundaries.
        multi_hot: per feature, whether the source column holds lists (a
            preprocessed copy keeps list columns as lists).
        labeled: whether the file had the label column.
    """

    labels: np.ndarray
    dense: np.ndarray
    ids: tuple[np.ndarray, ...]
    offsets: tuple[np.ndarray, ...]
    multi_hot: tuple[bool, ...]
    labeled: bool = True

    @property
    def rows(self) -> int:
        """``N``."""
        return int(self.labels.shape[0])

    @staticmethod
    def concatenate(parts: Sequence[MultiHotColumns]) -> MultiHotColumns:
        """The rows of ``parts``, in order (at least one part, all with the same features).

        The rows are ``labeled`` only if every part is (else every label is NaN).

        Raises:
            ValueError: if ``parts`` is empty or the parts have different features.
        """
        if not parts:
            raise ValueError("MultiHotColumns.concatenate needs at least one part")
        num_features = len(parts[0].ids)
        if any(len(p.ids) != num_features for p in parts):
            raise ValueError("MultiHotColumns parts have different numbers of features")
        ids, offsets = [], []
        for f in range(num_features):
            ids.append(np.concatenate([p.ids[f] for p in parts]))
            lengths = np.concatenate([np.diff(p.offsets[f]) for p in parts])
            offsets.append(offsets_from_lengths(lengths))
        multi_hot = tuple(any(p.multi_hot[f] for p in parts) for f in range(num_features))
        labeled = all(p.labeled for p in parts)
        labels = np.concatenate([p.labels for p in parts])
        return MultiHotColumns(
            labels=labels if labeled else np.full_like(labels, np.nan),
            dense=np.concatenate([p.dense for p in parts]),
            ids=tuple(ids),
            offsets=tuple(offsets),
            multi_hot=multi_hot,
            labeled=labeled,
        )


def offsets_from_lengths(lengths: np.ndarray) -> np.ndarray:
    """``(N+1,)`` int64 offsets ``[0, l0, l0+l1, ...]`` of ``(N,)`` bag lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


class MultiHotDataset:
    """Multi-hot rows held in memory, ids hashed into each feature's table once.

    Args:
        columns: the rows (raw ids).
        tables: the model's tables; feature ``i`` is ``feature_order(tables)[i]``.
        bad_lines: the summary of lines skipped while reading, if any.

    Raises:
        DataError: if there are no rows.
        ValueError: if the tables have a different number of features than the data.
    """

    def __init__(
        self,
        columns: MultiHotColumns,
        *,
        tables: Sequence[TableConfig],
        bad_lines: BadLineSummary | None = None,
    ) -> None:
        self.keys = feature_order(list(tables))
        rows = table_rows_per_feature(tables, len(columns.ids))
        self.num_samples = columns.rows
        if self.num_samples == 0:
            raise DataError("the dataset has no rows")
        self.num_dense = int(columns.dense.shape[1])
        self.labels = columns.labels
        self.has_labels = columns.labeled
        self.dense = columns.dense
        self.bad_lines = bad_lines
        # Per feature: (N_f,) table rows and (N+1,) offsets.
        self.values = [hash_ids(v, int(rows[f])) for f, v in enumerate(columns.ids)]
        self.offsets = list(columns.offsets)

    def read(self, indices: np.ndarray) -> Batch:
        """The batch of rows ``indices``, in that order.

        Raises:
            ValueError: if an index is out of range.
        """
        idx = check_indices(indices, self.num_samples)
        values, lengths, counts = [], [], []
        for vals, offs in zip(self.values, self.offsets):
            starts = offs[idx]
            lens = offs[idx + 1] - starts  # (B,)
            total = int(lens.sum())
            # Gather each bag's ids: position j of the output reads starts[bag] + (j - bag start).
            gather = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(total)
            values.append(vals[gather])
            lengths.append(lens)
            counts.append(total)
        sparse = SparseFeatures(
            self.keys,
            torch.from_numpy(np.concatenate(values)),
            torch.from_numpy(np.concatenate(lengths)),
            int(idx.shape[0]),
            None,
            tuple(counts),
        )
        return Batch(torch.from_numpy(self.dense[idx]), sparse, torch.from_numpy(self.labels[idx]))
