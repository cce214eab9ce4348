"""Parquet reader with a declared column mapping.

The mapping (``ColumnMapping``) names the dense columns (numbers, nulls -> 0, used as
they are: no transform; NaN, inf and values beyond float32's range are refused, naming
the row), the sparse columns (in feature order) and the 0/1 label
column (integers, floats, booleans or the strings ``"0"``/``"1"``; label and dense
columns may be dictionary-encoded, as a pandas categorical is). A sparse column may
hold:

- integers: one id per row, the value itself; null -> the raw value 0 as in Criteo;
- strings (string, large_string, string_view, binary or dictionary<string>): one id per row,
  ``hash_strings`` of the value's bytes; null and ``""`` -> the raw value 0;
- lists of either (list or large_list): a multi-hot bag per row; a null list is an
  empty bag, a null item is the raw value 0.

Ids are hashed into each feature's table with ``hash_ids`` when the files are loaded,
so an integer column holding ``hash_strings`` ids (as ``tetrarec preprocess csv``
writes) gives the same rows as the strings. Parquet is typed, so the only bad values
are labels other than 0/1 and columns of the wrong type: both raise ``DataError``
naming the file, the row (1-based) and the column. A file without the label column is
read (its labels NaN, ``labeled=False``) only when the caller does not require labels
(scoring); training refuses it, naming the column and the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tetrarec.data.errors import DataError, DataFileNotFoundError
from tetrarec.data.multi_hot import (
    ColumnMapping,
    MultiHotColumns,
    MultiHotDataset,
    offsets_from_lengths,
)
from tetrarec.data.transforms import combine_chunks, hash_strings
from tetrarec.embedding.config import TableConfig

__all__ = ["ParquetDataset", "iter_parquet_blocks", "read_parquet"]

_BATCH_ROWS = 1 << 20  # rows per block when streaming a file (preprocess)


def _open(
    path: Path, mapping: ColumnMapping, *, require_labels: bool = True
) -> tuple[pq.ParquetFile, tuple[str, ...]]:
    """The file and the mapped columns to read from it (the label only when it has one).

    Raises:
        DataFileNotFoundError: if the file does not exist.
        DataError: if it is not parquet, or lacks a mapped column (the label column
            too, when ``require_labels``).
    """
    if not path.exists():
        raise DataFileNotFoundError(path)
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # names of bad UTF-8
        raise DataError(f"not a readable parquet file ({_one_line(e)})", path=path) from None
    names = file.schema_arrow.names
    columns = mapping.columns
    if not require_labels and mapping.label_column not in names:
        columns = columns[1:]  # (label, *dense, *sparse): scoring input without labels
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(f"columns {missing} are not in the file; it has {names}", path=path)
    return file, columns


def _one_line(error: Exception) -> str:
    """``error``'s message on one line (pyarrow's thrift errors span several)."""
    return " ".join(str(error).split())


def _decoded(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """``col`` as one array; a dictionary-encoded column decoded to its value type.

    A label or dense column stored as a dictionary (a pandas categorical) is then
    checked and read by the values it holds, as a plain column of that type is.
    """
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _numbers(col: pa.ChunkedArray | pa.Array, path: Path, name: str) -> np.ndarray:
    arr = _decoded(col)
    if not (
        pa.types.is_integer(arr.type)
        or pa.types.is_floating(arr.type)
        or pa.types.is_boolean(arr.type)
    ):
        raise DataError(f"expected a numeric column, got {arr.type}", path=path, field=name)
    if pa.types.is_boolean(arr.type):
        arr = arr.cast(pa.int8())  # fill_null(0) cannot fill a boolean array
    values: np.ndarray = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64)
    return values


def _dense(col: pa.ChunkedArray, path: Path, name: str, first_row: int) -> np.ndarray:
    """``(n,)`` float32 values of a dense column (null -> 0).

    Raises:
        DataError: for NaN, inf or a value beyond float32's range, naming the first
            such row.
    """
    with np.errstate(over="ignore"):  # beyond float32's range is inf, refused below
        values = _numbers(col, path, name).astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise _bad_rows("dense value is not a finite float32", col, bad, first_row, path, name)
    return values


def _bad_rows(
    what: str,
    col: pa.ChunkedArray | pa.Array,
    bad: np.ndarray,
    first_row: int,
    path: Path,
    name: str,
) -> DataError:
    """The error for rows ``bad`` of a column, naming the first (1-based in the file)."""
    row = int(bad[0])
    return DataError(
        f"{what} (row {first_row + row + 1} holds {col[row].as_py()!r}; {bad.size} such rows)",
        path=path,
        field=name,
    )


def _labels(col: pa.ChunkedArray, path: Path, name: str, first_row: int) -> np.ndarray:
    arr = _decoded(col)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        ok = pc.is_in(arr, value_set=pa.array(["0", "1"], arr.type)).fill_null(False)
        values = np.where(pc.equal(arr, "1").fill_null(False).to_numpy(zero_copy_only=False), 1, 0)
        bad = np.flatnonzero(~ok.to_numpy(zero_copy_only=False))
    else:
        values = _numbers(arr, path, name)
        bad = np.flatnonzero((values != 0) & (values != 1) | np.asarray(arr.is_null()))
    if bad.size:
        raise _bad_rows("label is not 0 or 1", arr, bad, first_row, path, name)
    return np.asarray(values, dtype=np.float32)


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def _scalar_ids(arr: pa.Array) -> np.ndarray | None:
    """``(n,)`` int64 raw ids of an integer or string array; None for another type."""
    if pa.types.is_integer(arr.type):
        ids: np.ndarray = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return ids
    if _is_text(arr.type):
        return hash_strings(arr)
    return None


def _bags(col: pa.ChunkedArray, path: Path, name: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(raw ids (N_f,), offsets (rows+1,), is a list column)`` of a sparse column."""
    arr = combine_chunks(col)  # row groups' dictionaries may not fit one int8 index
    ids = _scalar_ids(arr)
    if ids is not None:
        return ids, np.arange(len(ids) + 1, dtype=np.int64), False
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        flat = _scalar_ids(arr.flatten())
        if flat is not None:
            lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
            return flat, offsets_from_lengths(lengths), True
    raise DataError(
        f"expected an integer, string or list<integer or string> column, got {arr.type}",
        path=path,
        field=name,
    )


def _without_views(t: pa.DataType) -> pa.DataType:
    """``t`` with its string and binary views made large strings and binaries.

    Arrow's view layouts (``string_view``, what Polars writes) hold the same values; not
    every pyarrow kernel takes them (``is_in``, for one), so columns are read as the
    classic layouts. pyarrow before 16 has no views.
    """
    if getattr(pa.types, "is_string_view", lambda _: False)(t):
        return pa.large_string()
    if getattr(pa.types, "is_binary_view", lambda _: False)(t):
        return pa.large_binary()
    if pa.types.is_dictionary(t):
        return pa.dictionary(t.index_type, _without_views(t.value_type))
    if pa.types.is_list(t):
        return pa.list_(_without_views(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_without_views(t.value_type))
    return t


def _column(table: pa.Table, name: str) -> pa.ChunkedArray:
    """Column ``name`` of ``table``, views cast to the classic layouts."""
    col = table.column(name)
    plain = _without_views(col.type)
    return col if plain == col.type else col.cast(plain)


def _columns_of_table(
    table: pa.Table, mapping: ColumnMapping, path: Path, first_row: int = 0
) -> MultiHotColumns:
    """The mapped columns of ``table`` (rows ``first_row + 1 ..`` of ``path``).

    Without the label column in ``table`` the rows are unlabeled (NaN).

    Raises:
        DataError: for a mistyped column or a bad label, naming the file, row and column.
    """
    labeled = mapping.label_column in table.column_names
    columns = mapping.columns if labeled else mapping.columns[1:]
    table = pa.table({name: _column(table, name) for name in columns})
    labels = np.full(table.num_rows, np.nan, dtype=np.float32)
    if labeled:
        labels = _labels(table.column(mapping.label_column), path, mapping.label_column, first_row)
    dense = np.zeros((table.num_rows, len(mapping.dense_columns)), dtype=np.float32)
    for i, name in enumerate(mapping.dense_columns):
        dense[:, i] = _dense(table.column(name), path, name, first_row)
    bags = [_bags(table.column(c), path, c) for c in mapping.sparse_columns]
    return MultiHotColumns(
        labels=labels,
        dense=dense,
        ids=tuple(b[0] for b in bags),
        offsets=tuple(b[1] for b in bags),
        multi_hot=tuple(b[2] for b in bags),
        labeled=labeled,
    )


def iter_parquet_blocks(
    path: str | Path,
    mapping: ColumnMapping,
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[MultiHotColumns]:
    """Read one parquet file block by block (about a million rows each), in order.

    Args:
        path: the file.
        mapping: the columns to read.
        on_bytes: called with the file's size once it is read (for progress bars).

    Yields:
        ``MultiHotColumns`` of each block.

    Raises:
        DataFileNotFoundError: if the file does not exist.
        DataError: for an unreadable file, a missing or mistyped column, a bad label.
    """
    path = Path(path)
    file, _ = _open(path, mapping)
    first_row = 0
    try:
        for batch in file.iter_batches(batch_size=_BATCH_ROWS, columns=list(mapping.columns)):
            yield _columns_of_table(pa.Table.from_batches([batch]), mapping, path, first_row)
            first_row += batch.num_rows
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # names of bad UTF-8
        raise DataError(f"cannot read parquet data ({_one_line(e)})", path=path) from None
    if on_bytes is not None:
        on_bytes(path.stat().st_size)


def read_parquet(
    paths: Sequence[str | Path], mapping: ColumnMapping, *, require_labels: bool = True
) -> MultiHotColumns:
    """Read whole parquet files into memory, concatenated in the order given.

    Args:
        paths: the files.
        mapping: the columns to read.
        require_labels: every file must have the label column (training); when false,
            a file without it is read unlabeled, and the rows are ``labeled`` only if
            every file has it (scoring).

    Raises:
        ValueError: if ``paths`` is empty.
        DataFileNotFoundError: if a file is missing.
        DataError: for an unreadable file, a missing or mistyped column, a bad label.
    """
    if not paths:
        raise ValueError("read_parquet needs at least one file")
    parts = []
    for p in map(Path, paths):
        file, columns = _open(p, mapping, require_labels=require_labels)
        try:
            table = file.read(columns=list(columns))
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # names of bad UTF-8
            raise DataError(f"cannot read parquet data ({_one_line(e)})", path=p) from None
        parts.append(_columns_of_table(table, mapping, p))
    return MultiHotColumns.concatenate(parts)


class ParquetDataset(MultiHotDataset):
    """Rows of one or more parquet files, concatenated in order, held in memory.

    Args:
        paths: the files.
        dense_columns: dense feature columns, in order.
        sparse_columns: sparse feature columns, one per feature of ``tables`` in
            ``feature_order``.
        label_column: the 0/1 label column.
        tables: the model's tables.
        require_labels: see ``read_parquet``; ``has_labels`` says whether the rows
            have them.

    Raises:
        DataFileNotFoundError: if a file is missing.
        DataError: for an unreadable file, a missing or mistyped column, a bad label,
            no rows at all.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        dense_columns: Sequence[str],
        sparse_columns: Sequence[str],
        label_column: str,
        tables: Sequence[TableConfig],
        require_labels: bool = True,
    ) -> None:
        mapping = ColumnMapping(
            label_column=label_column,
            dense_columns=tuple(dense_columns),
            sparse_columns=tuple(sparse_columns),
        )
        columns = read_parquet(paths, mapping, require_labels=require_labels)
        if columns.rows == 0:
            raise DataError(f"no rows in {[str(p) for p in paths]}")
        super().__init__(columns, tables=tables)
