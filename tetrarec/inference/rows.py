"""Request rows to features: raw JSON rows into the ``Batch`` the training reader makes.

A scoring request carries raw rows, each a JSON object keyed by the names the model's
data config reads (the label column may be present; it is ignored)::

    source      dense keys                       sparse keys and values
    criteo      I1 .. I13: integer or null       C1 .. C26: 1-8 hex digits, "" or null
    binary      as criteo (a preprocessed copy of Criteo files)
    csv         data.dense_columns: number       data.sparse_columns: string ("" or null
                or null                          missing); a csv.multi_hot_columns
                                                 column: the field's text (split on the
                                                 separator) or a list of strings
    parquet     data.dense_columns: number       data.sparse_columns: integer, string,
                or null                          null, or a list of them (a bag; a
                                                 null list is sent as [])
    synthetic   dense0 ..: number                C1 ..: table row (integer) or a list

``RowReader.parse`` checks every row (one ``RowError`` naming the row and the field,
before any work) and keeps the values raw (``ParsedRows``); ``RowReader.features``
then builds the batch through the very datasets the training reader builds
(``ColumnsDataset`` for Criteo, ``MultiHotDataset`` for CSV and Parquet, ids hashed
there by ``hash_ids`` and ``hash_strings``) and the model's saved dense transform
(``TransformedDataset``). Parsed rows of several requests concatenate
(``ParsedRows.concatenate``), so a server checks each request alone and scores many
together. Legend: ``n`` rows, ``D`` dense features, ``F`` sparse features.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from tetrarec.config import RunConfig
from tetrarec.config.tables import build_tables
from tetrarec.data import (
    ColumnsDataset,
    DataConfig,
    Dataset,
    DataSource,
    DenseTransform,
    MultiHotColumns,
    MultiHotDataset,
    TransformedDataset,
    dense_spec,
    hash_strings,
)
from tetrarec.data.criteo import SPARSE_FIELDS
from tetrarec.embedding import TableConfig
from tetrarec.embedding.config import feature_order
from tetrarec.sparse import Batch, SparseFeatures

if TYPE_CHECKING:
    from tetrarec.inference.model import InferenceModel

__all__ = ["ParsedRows", "RowError", "RowReader", "TooManyRowsError", "parse_request"]

_INT64_MIN, _UINT64_END = -(2**63), 2**64
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_T = TypeVar("_T")
_SHOWN_NAMES = 12  # an unknown-feature error lists this many of the model's names


class RowError(ValueError):
    """A request's rows that the model cannot read; the message names the row and field."""


class TooManyRowsError(RowError):
    """A request with more rows than the reader accepts."""


class _FieldError(Exception):
    """A bad value; ``RowReader.parse`` adds the row and the field to the message."""


def _describe(value: object) -> str:
    """The JSON type of ``value``, for messages (``a list``, ``null``, ...)."""
    kinds: dict[type, str] = {
        dict: "an object", list: "a list", str: "a string", bool: "a boolean",
        int: "an integer", float: "a number", type(None): "null",
    }  # fmt: skip
    return kinds.get(type(value), type(value).__name__)


# -- values: one parser per kind of column, each raising _FieldError ---------------------


def _integer_dense(value: object) -> int:
    """A Criteo count: an integer (int64) or null (missing -> 0), as the TSV reader."""
    if value is None:
        return 0
    if type(value) is int and _INT64_MIN <= value < 2**63:
        return value
    raise _FieldError(f"expected an integer or null, got {_describe(value)}")


def _number_dense(value: object) -> float:
    """A dense value of a typed source: a finite number or null (missing -> 0)."""
    if value is None:
        return 0.0
    if type(value) is int or type(value) is float:
        return float(value)
    raise _FieldError(f"expected a number or null, got {_describe(value)}")


def _hex_id(value: object, multi_hot: bool) -> list[int | str]:
    """A Criteo categorical: 1-8 hex digits read as uint32; "" or null is 0."""
    if value is None or value == "":
        return [0]
    if type(value) is str and len(value) <= 8 and _HEX_DIGITS.issuperset(value):
        return [int(value, 16)]
    if type(value) is str:
        raise _FieldError(f"expected 1-8 hex digits, got {value[:30]!r}")
    raise _FieldError(f"expected a string of hex digits or null, got {_describe(value)}")


def _text_ids(separator: str) -> Callable[[object, bool], list[int | str]]:
    """CSV categoricals: text, hashed by its bytes; a multi-hot field split on ``separator``."""

    def parse(value: object, multi_hot: bool) -> list[int | str]:
        if value is None:
            return [] if multi_hot else [""]
        if type(value) is str:
            return [s for s in value.split(separator) if s] if multi_hot else [value]
        if multi_hot and type(value) is list and all(type(v) is str for v in value):
            return [s for s in value if s]
        want = "a string or a list of strings" if multi_hot else "a string or null"
        raise _FieldError(f"expected {want}, got {_describe(value)}")

    return parse


def _typed_item(value: object) -> int | str:
    """One Parquet id: an integer (its value, as uint64 bits) or a string (hashed)."""
    if value is None:
        return 0
    if type(value) is str:
        return value
    if type(value) is int and _INT64_MIN <= value < _UINT64_END:
        return value - _UINT64_END if value >= 2**63 else value
    raise _FieldError(f"expected an integer, a string or null, got {_describe(value)}")


def _typed_ids(value: object, multi_hot: bool) -> list[int | str]:
    """A Parquet categorical: one id, or a list of them (a bag; null items are 0)."""
    if type(value) is list:
        return [_typed_item(v) for v in value]
    return [_typed_item(value)]


def _row_ids(value: object, multi_hot: bool) -> list[int | str]:
    """A synthetic feature: table rows, one or a list (checked against the table later)."""
    items = value if type(value) is list else [value]
    if all(type(v) is int for v in items):
        return list(items)
    raise _FieldError(f"expected an integer table row or a list of them, got {_describe(value)}")


# -- datasets: the training reader's own, over parsed rows -------------------------------


def _columns_dataset(columns: MultiHotColumns, tables: Sequence[TableConfig]) -> Dataset:
    """The Criteo reader's dataset: one raw uint32 categorical per feature and row."""
    sparse = np.stack(columns.ids, axis=1).astype(np.uint32) if columns.ids else None
    assert sparse is not None  # a Criteo model has 26 features
    return ColumnsDataset(labels=columns.labels, dense=columns.dense, sparse=sparse, tables=tables)


def _multi_hot_dataset(columns: MultiHotColumns, tables: Sequence[TableConfig]) -> Dataset:
    """The CSV and Parquet readers' dataset: bags of raw ids, hashed into each table."""
    return MultiHotDataset(columns, tables=tables)


class _RowsDataset:
    """Synthetic rows: the ids already are table rows (no hash), as the generator's."""

    def __init__(self, columns: MultiHotColumns, tables: Sequence[TableConfig]) -> None:
        self.columns = columns
        self.keys = feature_order(list(tables))
        self.num_samples = columns.rows
        self.num_dense = int(columns.dense.shape[1])

    def read(self, indices: np.ndarray) -> Batch:
        """Every row, in order (``indices`` is always ``arange(num_samples)`` here)."""
        c = self.columns
        assert np.array_equal(indices, np.arange(self.num_samples))
        sparse = SparseFeatures(
            self.keys,
            torch.from_numpy(np.concatenate(c.ids)),
            torch.from_numpy(np.concatenate([np.diff(o) for o in c.offsets])),
            self.num_samples,
            None,
            tuple(int(ids.shape[0]) for ids in c.ids),
        )
        return Batch(torch.from_numpy(c.dense), sparse, torch.from_numpy(c.labels))


@dataclass(frozen=True, kw_only=True)
class _Source:
    """How rows of one data source read: names, value parsers, the reader's dataset.

    Args:
        sparse_names: the request keys of the sparse features, in feature order.
        dense: parses one dense value.
        dense_dtype: what the reader parses dense values as (int64 for Criteo's counts,
            so large ones round to float32 as the reader rounds them).
        sparse: parses one sparse value into the items of its bag.
        multi_hot: whether a sparse column holds bags.
        dataset: the reader's dataset over parsed rows.
        ids_are_rows: the ids are table rows, checked against each table's size.
    """

    sparse_names: Callable[[DataConfig, tuple[TableConfig, ...]], tuple[str, ...]]
    dense: Callable[[object], float]
    dense_dtype: type[np.generic]
    sparse: Callable[[DataConfig], Callable[[object, bool], list[int | str]]]
    multi_hot: Callable[[DataConfig, str], bool]
    dataset: Callable[[MultiHotColumns, Sequence[TableConfig]], Dataset]
    ids_are_rows: bool = False


_CRITEO = _Source(
    sparse_names=lambda data, tables: SPARSE_FIELDS,
    dense=_integer_dense,
    dense_dtype=np.int64,
    sparse=lambda data: _hex_id,
    multi_hot=lambda data, name: False,
    dataset=_columns_dataset,
)

_SOURCES: dict[DataSource, _Source] = {
    DataSource.CRITEO: _CRITEO,
    DataSource.BINARY: _CRITEO,
    DataSource.CSV: _Source(
        sparse_names=lambda data, tables: data.sparse_columns,
        dense=_number_dense,
        dense_dtype=np.float64,
        sparse=lambda data: _text_ids(data.csv.multi_hot_separator),
        multi_hot=lambda data, name: name in data.csv.multi_hot_columns,
        dataset=_multi_hot_dataset,
    ),
    DataSource.PARQUET: _Source(
        sparse_names=lambda data, tables: data.sparse_columns,
        dense=_number_dense,
        dense_dtype=np.float64,
        sparse=lambda data: _typed_ids,
        multi_hot=lambda data, name: True,
        dataset=_multi_hot_dataset,
    ),
    DataSource.SYNTHETIC: _Source(
        sparse_names=lambda data, tables: feature_order(list(tables)),
        dense=_number_dense,
        dense_dtype=np.float64,
        sparse=lambda data: _row_ids,
        multi_hot=lambda data, name: True,
        dataset=lambda columns, tables: _RowsDataset(columns, tables),
        ids_are_rows=True,
    ),
}


@dataclass(frozen=True, kw_only=True)
class ParsedRows:
    """Checked request rows, values still raw (``MultiHotColumns``: ids not hashed).

    Args:
        columns: the rows; ``labels`` are zeros (a request carries none).
    """

    columns: MultiHotColumns

    @property
    def rows(self) -> int:
        """``n``."""
        return self.columns.rows

    @staticmethod
    def concatenate(parts: Sequence[ParsedRows]) -> ParsedRows:
        """The rows of ``parts`` (of one reader), in order."""
        if len(parts) == 1:
            return parts[0]
        return ParsedRows(columns=MultiHotColumns.concatenate([p.columns for p in parts]))


class RowReader:
    """Reads request rows as the model's training reader reads the same raw values.

    Args:
        config: the training run's config (its data section says the source, columns
            and hashing; its model section the tables).
        dense_transform: the training rows' dense transform (``None``: the source's
            default, which must need no statistics).
        max_rows: the most rows one ``parse`` accepts (``None``: no limit).

    Raises:
        ValueError: for a data source rows cannot be read for, or a dense transform
            that needs statistics the model did not save.
    """

    def __init__(
        self,
        config: RunConfig,
        dense_transform: DenseTransform | None,
        *,
        max_rows: int | None = None,
    ) -> None:
        data = config.data
        source = DataSource(data.source)
        if source not in _SOURCES:
            raise ValueError(f"rows of data.source {data.source!r} cannot be read")
        self.source = _SOURCES[source]
        self.tables = build_tables(config.model)
        num_dense = config.model.dlrm.num_dense
        spec = dense_spec(data, num_dense)
        self.transform = dense_transform or DenseTransform.without_statistics(spec)
        self.dense_names: tuple[str, ...] = spec.columns
        self.sparse_names = tuple(self.source.sparse_names(data, self.tables))
        self.label_name = data.label_column
        self.max_rows = max_rows
        parse = self.source.sparse(data)
        self._sparse = [(n, parse, self.source.multi_hot(data, n)) for n in self.sparse_names]
        self._rows = np.array([t.num_embeddings for t in self.tables], dtype=np.int64)
        self._names = frozenset((*self.dense_names, *self.sparse_names))
        if len(self._names) != len(self.dense_names) + len(self.sparse_names):
            raise ValueError("the model's dense and sparse feature names overlap")

    @classmethod
    def for_model(cls, model: InferenceModel, *, max_rows: int | None = None) -> RowReader:
        """The reader of ``model``'s rows (its config and saved dense transform)."""
        return cls(model.config, model.dense_transform, max_rows=max_rows)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Every key a row must hold: the dense, then the sparse features."""
        return (*self.dense_names, *self.sparse_names)

    def parse(self, rows: object) -> ParsedRows:
        """Check ``rows`` (a JSON list of objects) and keep their raw values.

        Raises:
            TooManyRowsError: for more than ``max_rows`` rows.
            RowError: for rows that are not a list of objects, a missing or unknown
                feature, or a value of the wrong type (naming the row and the field).
        """
        if type(rows) is not list:
            raise RowError(f"rows must be a list of objects, got {_describe(rows)}")
        if self.max_rows is not None and len(rows) > self.max_rows:
            raise TooManyRowsError(f"the request has {len(rows)} rows; at most {self.max_rows}")
        for i, row in enumerate(rows):
            self._check_keys(i, row)
        dense = np.empty((len(rows), len(self.dense_names)), dtype=self.source.dense_dtype)
        for j, name in enumerate(self.dense_names):
            parse = self.source.dense
            for i, row in enumerate(rows):
                dense[i, j] = _field(parse, row[name], i, name)
        with np.errstate(over="ignore"):  # beyond float32 is inf, refused just below
            dense32 = dense.astype(np.float32)
        bad = np.argwhere(~np.isfinite(dense32))
        if bad.size:
            i, j = (int(v) for v in bad[0])
            value = rows[i][self.dense_names[j]]
            raise RowError(
                f"row {i}, field {self.dense_names[j]!r}: {value!r} is not a finite float32"
            )
        ids, offsets = [], []
        for f, (name, parse_ids, multi_hot) in enumerate(self._sparse):
            bags = [_field(parse_ids, row[name], i, name, multi_hot) for i, row in enumerate(rows)]
            raw, offs = _raw_ids(bags)
            if self.source.ids_are_rows:
                _check_rows(raw, offs, int(self._rows[f]), name)
            ids.append(raw)
            offsets.append(offs)
        columns = MultiHotColumns(
            labels=np.zeros(len(rows), dtype=np.float32),
            dense=dense32,
            ids=tuple(ids),
            offsets=tuple(offsets),
            multi_hot=tuple(m for _, _, m in self._sparse),
        )
        return ParsedRows(columns=columns)

    def features(self, parsed: ParsedRows) -> Batch:
        """The batch of ``parsed`` rows: ids hashed into each table, dense transformed.

        Labels are zeros. At least one row.
        """
        base = self.source.dataset(parsed.columns, self.tables)
        ds = TransformedDataset(base, self.transform, where="the request")
        return ds.read(np.arange(parsed.rows, dtype=np.int64))

    def batch(self, rows: object) -> Batch:
        """``features(parse(rows))``."""
        return self.features(self.parse(rows))

    def _check_keys(self, i: int, row: object) -> None:
        if type(row) is not dict:
            raise RowError(f"row {i}: expected an object of feature values, got {_describe(row)}")
        missing = [n for n in self.feature_names if n not in row]
        if missing:
            raise RowError(f"row {i}: missing feature {missing[0]!r} ({len(missing)} missing)")
        if len(row) > len(self._names):
            unknown = [k for k in row if k not in self._names and k != self.label_name]
            if unknown:
                names = ", ".join(self.feature_names[:_SHOWN_NAMES])
                more = len(self.feature_names) - _SHOWN_NAMES
                names += f", ... ({more} more)" if more > 0 else ""
                raise RowError(
                    f"row {i}: unknown feature {str(unknown[0])[:60]!r}; the model reads {names}"
                    f" (and ignores {self.label_name!r})"
                )


def _field(parse: Callable[..., _T], value: object, i: int, name: str, *extra: bool) -> _T:
    """``parse(value, *extra)``, its error named by row ``i`` and field ``name``."""
    try:
        return parse(value, *extra)
    except _FieldError as e:
        raise RowError(f"row {i}, field {name!r}: {e}") from None


def _raw_ids(bags: list[list[int | str]]) -> tuple[np.ndarray, np.ndarray]:
    """``(raw ids (N_f,) int64, offsets (n+1,))`` of one feature's bags; strings hashed."""
    lengths = np.fromiter((len(b) for b in bags), dtype=np.int64, count=len(bags))
    offsets = np.zeros(len(bags) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    items = [v for b in bags for v in b]
    out = np.zeros(len(items), dtype=np.int64)
    text = [k for k, v in enumerate(items) if type(v) is str]
    if text:
        out[text] = hash_strings([items[k] for k in text])
    if len(text) < len(items):
        whole = [k for k, v in enumerate(items) if type(v) is int]
        out[whole] = np.array([items[k] for k in whole], dtype=np.int64)
    return out, offsets


def _check_rows(ids: np.ndarray, offsets: np.ndarray, rows: int, name: str) -> None:
    """Raise ``RowError`` naming the first row whose id is outside ``[0, rows)``."""
    bad = np.flatnonzero((ids < 0) | (ids >= rows))
    if bad.size:
        row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
        raise RowError(
            f"row {row}, field {name!r}: id {int(ids[bad[0]])} is not a row of its table "
            f"[0, {rows})"
        )


def parse_request(body: Mapping[str, object], reader: RowReader) -> ParsedRows:
    """The rows of a request body ``{"rows": [...]}`` (other keys refused).

    Raises:
        RowError: for a body without ``rows`` or with other keys, or bad rows.
    """
    extra = sorted(k for k in body if k != "rows")
    if extra:
        raise RowError(f'unknown request field {extra[0][:60]!r}; a request is {{"rows": [...]}}')
    if "rows" not in body:
        raise RowError('the request has no "rows"; a request is {"rows": [...]}')
    return reader.parse(body["rows"])
