"""Generated parquet files: read back exactly by the documented rules, or a ``DataError``.

Each column is drawn with a type (integers of any width, floats, booleans, strings,
binary, dictionary-encoded, lists, and types no reader accepts) and values (nulls,
NaN, infinities, values beyond float32, labels other than 0/1), written in row groups
of random size. The expectation follows the module docstring of
``tetrarec.data.parquet``, computed here value by value: the file reads as exactly those
rows, or it holds a value or type the rules refuse and the read is one ``DataError``
naming the column. Damaged files (truncated, bytes flipped) are a ``DataError`` naming
the file, never an ``ArrowException`` or ``OSError`` traceback.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st
from raw_ids import fnv1a64

from tetrarec.data import ColumnMapping, DataError, read_parquet

FUZZ = settings.get_profile("tetrarec-fuzz")
MAPPING = ColumnMapping(label_column="y", dense_columns=("d",), sparse_columns=("s", "m"))


def _dictionary(values: list[object], t: pa.DataType) -> pa.Array:
    return pa.array(values, t).dictionary_encode()


@st.composite
def label_column(draw: st.DrawFn, n: int) -> tuple[pa.Array, list[float] | None]:
    """``(column, expected labels or None when the rules refuse it)``."""
    kind = draw(st.sampled_from(["int8", "int64", "float64", "bool", "string", "dict", "bad"]))
    values = draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n))
    broken = draw(st.booleans())
    if kind == "bool":
        col = [bool(v) for v in values]
        if broken and n:
            col[draw(st.integers(0, n - 1))] = None
        return pa.array(col, pa.bool_()), None if None in col else [float(v) for v in values]
    if kind in ("string", "dict"):
        col = [str(v) for v in values]
        if broken and n:
            col[draw(st.integers(0, n - 1))] = draw(st.sampled_from(["2", "", " 1", "1.0", None]))
        arr = pa.array(col, pa.string())
        ok = all(c in ("0", "1") for c in col)
        return (arr.dictionary_encode() if kind == "dict" else arr), (
            [float(v) for v in values] if ok else None
        )
    if kind == "bad":
        return pa.array([{"a": v} for v in values], pa.struct([("a", pa.int64())])), None
    t = {"int8": pa.int8(), "int64": pa.int64(), "float64": pa.float64()}[kind]
    col: list[object] = list(values)
    if broken and n:
        bad = [None, 2, -1] + ([0.5, math.nan, math.inf] if kind == "float64" else [])
        col[draw(st.integers(0, n - 1))] = draw(st.sampled_from(bad))
    ok = all(c in (0, 1) and c is not None for c in col)
    return pa.array(col, t), [float(v) for v in values] if ok else None


DENSE_VALUES = st.one_of(
    st.none(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=True, allow_infinity=True),
)


@st.composite
def dense_column(draw: st.DrawFn, n: int) -> tuple[pa.Array, list[float] | None]:
    kind = draw(st.sampled_from(["float64", "float32", "int32", "bool", "dict", "string"]))
    if kind == "string":
        return pa.array(["1"] * n, pa.string()), None  # a type the rules refuse, rows or not
    if kind == "bool":
        col = draw(st.lists(st.none() | st.booleans(), min_size=n, max_size=n))
        return pa.array(col, pa.bool_()), [float(v or 0) for v in col]
    if kind == "int32":
        col = draw(st.lists(st.none() | st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
        return pa.array(col, pa.int32()), [float(np.float32(v or 0)) for v in col]
    col = draw(st.lists(DENSE_VALUES, min_size=n, max_size=n))
    col = [None if v is None else float(v) for v in col]
    with np.errstate(over="ignore"):  # beyond float32 is inf, which the rules refuse
        if kind == "float32":
            col = [None if v is None else float(np.float32(v)) for v in col]
        expected = [float(np.float32(0.0 if v is None else v)) for v in col]
    ok = all(math.isfinite(v) for v in expected)
    arr = pa.array(col, pa.float32() if kind == "float32" else pa.float64())
    if kind == "dict":
        arr = arr.dictionary_encode()
    return arr, expected if ok else None


TEXT = st.text(max_size=5)


@st.composite
def sparse_column(draw: st.DrawFn, n: int) -> tuple[pa.Array, list[list[int]] | None]:
    """``(column, expected raw ids per row (a bag), or None when refused)``."""
    kinds = "int64 uint8 string large_string binary dict list_int list_str float list_float"
    kind = draw(st.sampled_from(kinds.split()))
    if kind in ("int64", "uint8"):
        hi = 2**63 - 1 if kind == "int64" else 255
        lo = -(2**63) if kind == "int64" else 0
        col = draw(st.lists(st.none() | st.integers(lo, hi), min_size=n, max_size=n))
        t = pa.int64() if kind == "int64" else pa.uint8()
        return pa.array(col, t), [[v or 0] for v in col]
    if kind in ("string", "large_string", "dict", "binary"):
        col = draw(st.lists(st.none() | TEXT, min_size=n, max_size=n))
        t = {"binary": pa.binary(), "large_string": pa.large_string()}.get(kind, pa.string())
        values = [None if v is None else (v.encode() if kind == "binary" else v) for v in col]
        arr = pa.array(values, t)
        if kind == "dict":
            arr = arr.dictionary_encode()
        return arr, [[fnv1a64((v or "").encode())] for v in col]
    if kind == "list_int":
        col = draw(
            st.lists(
                st.none() | st.lists(st.none() | st.integers(-(2**63), 2**63 - 1), max_size=3),
                min_size=n,
                max_size=n,
            )
        )
        return pa.array(col, pa.list_(pa.int64())), [[v or 0 for v in bag or []] for bag in col]
    if kind == "list_str":
        col = draw(
            st.lists(st.none() | st.lists(st.none() | TEXT, max_size=3), min_size=n, max_size=n)
        )
        expected = [[fnv1a64((v or "").encode()) for v in bag or []] for bag in col]
        return pa.array(col, pa.large_list(pa.string())), expected
    if kind == "float":
        return pa.array([1.0] * n, pa.float64()), None
    return pa.array([[1.0]] * n, pa.list_(pa.float64())), None


@FUZZ
@given(data=st.data(), n=st.integers(0, 12), row_group=st.integers(1, 5))
def test_typed_columns_read_by_the_documented_rules(tmp_path, data, n, row_group) -> None:
    """Every column type and value the docstring lists reads as it says (nulls -> 0, text
    hashed by its bytes, a null list an empty bag), in any row-group split; a value or a
    type it refuses is one ``DataError`` naming its column (a NaN let through as a dense
    value, a null label read as 0, a list's null item dropped fails here)."""
    y, want_y = data.draw(label_column(n))
    d, want_d = data.draw(dense_column(n))
    s, want_s = data.draw(sparse_column(n))
    m, want_m = data.draw(sparse_column(n))
    p = tmp_path / "f.parquet"
    pq.write_table(pa.table({"y": y, "d": d, "s": s, "m": m}), p, row_group_size=row_group)
    wants = {"y": want_y, "d": want_d, "s": want_s, "m": want_m}
    refused = [c for c in ("y", "d", "s", "m") if wants[c] is None]
    try:
        columns = read_parquet([p], MAPPING)
    except DataError as e:
        error = e
    else:
        error = None
    if refused:
        assert error is not None, f"columns {refused} should be refused"
        assert error.path == str(p)
        assert error.field in refused, (error, refused)
        assert "\n" not in str(error)
        return
    assert error is None, error
    assert columns.rows == n
    np.testing.assert_array_equal(columns.labels, np.array(want_y, np.float32))
    np.testing.assert_array_equal(columns.dense[:, 0], np.array(want_d, np.float32))
    for f, want in enumerate((want_s, want_m)):
        flat = [i for bag in want for i in bag]  # type: ignore[union-attr]
        np.testing.assert_array_equal(columns.ids[f], np.array(flat, np.int64))
        lengths = [len(bag) for bag in want]  # type: ignore[union-attr]
        np.testing.assert_array_equal(np.diff(columns.offsets[f]), np.array(lengths, np.int64))


def _good_file(path) -> bytes:
    table = pa.table(
        {
            "y": pa.array([0, 1, 1], pa.int8()),
            "d": pa.array([0.5, None, 2.0]),
            "s": pa.array(["a", None, "c"]),
            "m": pa.array([[1, 2], None, [3]], pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, path, row_group_size=2)
    return path.read_bytes()


@FUZZ
@given(
    data=st.data(),
    how=st.sampled_from(["truncate", "flip", "splice", "random"]),
)
def test_damaged_files_are_a_data_error_naming_the_file(tmp_path, data, how) -> None:
    """Bytes cut, flipped or replaced anywhere in a good file: the read gives rows the
    rules allow, or a one-line ``DataError`` naming the file; never an ``OSError`` or
    pyarrow traceback, never more rows than the file had."""
    good = _good_file(tmp_path / "good.parquet")
    if how == "truncate":
        raw = good[: data.draw(st.integers(0, len(good) - 1))]
    elif how == "flip":
        raw = bytearray(good)
        for at in data.draw(st.lists(st.integers(0, len(good) - 1), min_size=1, max_size=4)):
            raw[at] ^= data.draw(st.integers(1, 255))
        raw = bytes(raw)
    elif how == "splice":
        at = data.draw(st.integers(0, len(good)))
        raw = good[:at] + data.draw(st.binary(max_size=16)) + good[at:]
    else:
        raw = b"PAR1" + data.draw(st.binary(max_size=64)) + b"PAR1"
    p = tmp_path / "bad.parquet"
    p.write_bytes(raw)
    try:
        columns = read_parquet([p], MAPPING)
    except DataError as e:
        error = e
    else:
        error = None
    if error is not None:
        assert error.path == str(p)
        assert "\n" not in str(error)
        return
    assert columns.rows <= 3
    assert np.isfinite(columns.dense).all()
    assert set(columns.labels.tolist()) <= {0.0, 1.0}
