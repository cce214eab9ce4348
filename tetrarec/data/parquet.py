"""Parquet reader with a declared column mapping.

The mapping names the dense columns (numbers, nulls -> 0, used as they are: no
transform), the sparse columns (in feature order; an integer column is one id per row,
null -> the raw value 0 as in Criteo; a list-of-integers column is a multi-hot bag,
null -> an empty bag) and the 0/1 label column. Ids are hashed into each feature's
table with ``hash_ids`` when the files are loaded. Parquet is typed, so the only bad
values are labels other than 0/1 and columns of the wrong type: both raise
``DataError`` naming the file, the row (1-based) and the column.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from tetrarec.data.datasets import check_indices, table_rows_per_feature
from tetrarec.data.errors import DataError, DataFileNotFoundError
from tetrarec.data.transforms import hash_ids
from tetrarec.embedding.config import TableConfig, feature_order
from tetrarec.sparse import Batch, SparseFeatures

__all__ = ["ParquetDataset"]


def _read_table(path: Path, columns: list[str]) -> pa.Table:
    if not path.exists():
        raise DataFileNotFoundError(path)
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"not a readable parquet file ({e})", path=path) from None
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataError(f"columns {missing} are not in the file; it has {schema.names}", path=path)
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read parquet data ({e})", path=path) from None


def _numbers(col: pa.ChunkedArray, path: Path, name: str) -> np.ndarray:
    if not (
        pa.types.is_integer(col.type)
        or pa.types.is_floating(col.type)
        or pa.types.is_boolean(col.type)
    ):
        raise DataError(f"expected a numeric column, got {col.type}", path=path, field=name)
    values: np.ndarray = (
        col.combine_chunks().fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64)
    )
    return values


def _labels(col: pa.ChunkedArray, path: Path, name: str) -> np.ndarray:
    values = _numbers(col, path, name)
    bad = np.flatnonzero((values != 0) & (values != 1) | np.asarray(col.is_null()))
    if bad.size:
        row = int(bad[0])
        raise DataError(
            f"label is not 0 or 1 (row {row + 1} holds {col[row].as_py()!r}; {bad.size} such rows)",
            path=path,
            field=name,
        )
    return values.astype(np.float32)


def _bags(col: pa.ChunkedArray, path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(raw ids (N_f,), offsets (rows+1,))`` of an integer or list-of-integer column."""
    arr = col.combine_chunks()
    if pa.types.is_integer(arr.type):
        ids = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return ids, np.arange(len(ids) + 1, dtype=np.int64)
    if (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) and pa.types.is_integer(
        arr.type.value_type
    ):
        lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
        flat = arr.flatten().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.zeros(len(arr) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return flat, offsets
    raise DataError(
        f"expected an integer or list<integer> column, got {arr.type}", path=path, field=name
    )


class ParquetDataset:
    """Rows of one or more parquet files, concatenated in order, held in memory.

    Args:
        paths: the files.
        dense_columns: dense feature columns, in order.
        sparse_columns: sparse feature columns, one per feature of ``tables`` in
            ``feature_order``.
        label_column: the 0/1 label column.
        tables: the model's tables.

    Raises:
        DataFileNotFoundError: if a file is missing.
        DataError: for an unreadable file, a missing or mistyped column, a bad label.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        dense_columns: Sequence[str],
        sparse_columns: Sequence[str],
        label_column: str,
        tables: Sequence[TableConfig],
    ) -> None:
        self.keys = feature_order(list(tables))
        rows = table_rows_per_feature(tables, len(sparse_columns))
        self.num_dense = len(dense_columns)
        self.bad_lines = None
        columns = [label_column, *dense_columns, *sparse_columns]
        labels, dense = [], []
        bags: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in sparse_columns]
        for p in map(Path, paths):
            table = _read_table(p, columns)
            labels.append(_labels(table.column(label_column), p, label_column))
            d = [_numbers(table.column(c), p, c) for c in dense_columns]
            dense.append(np.stack(d, 1) if d else np.zeros((table.num_rows, 0)))
            for f, c in enumerate(sparse_columns):
                bags[f].append(_bags(table.column(c), p, c))
        self.labels = np.concatenate(labels)
        self.dense = np.concatenate(dense).astype(np.float32)
        self.num_samples = int(self.labels.shape[0])
        if self.num_samples == 0:
            raise DataError(f"no rows in {[str(p) for p in paths]}")
        self.values: list[np.ndarray] = []  # per feature (N_f,) hashed ids
        self.offsets: list[np.ndarray] = []  # per feature (num_samples + 1,)
        for f, parts in enumerate(bags):
            self.values.append(hash_ids(np.concatenate([v for v, _ in parts]), int(rows[f])))
            lengths = np.concatenate([np.diff(o) for _, o in parts])
            offsets = np.zeros(self.num_samples + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            self.offsets.append(offsets)

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
