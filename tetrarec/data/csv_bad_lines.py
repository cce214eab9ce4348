"""The bad lines of a block of a delimited text file that failed to read whole.

``_find_bad_lines`` names them in one vectorized pass (field counts from pyarrow's
invalid-row handler, then per-column checks of UTF-8, label and dense values); the
error of each names the file, line, column and reason (``_diagnose``, ``_value_error``).
``csv_source`` decides what happens to them (``on_bad_line``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from tetrarec.data.csv_parse import (
    _BOM,
    _BlockInvalidError,
    _convert_options,
    _FilePlan,
    _parse_block,
)
from tetrarec.data.errors import BadLineReason, DataError

__all__: list[str] = []


def _bad_line(
    plan: _FilePlan, lineno: int, reason: BadLineReason, column: str, detail: str
) -> DataError:
    """The ``DataError`` of a bad line: file, line, field, reason and what was found."""
    return DataError(
        f"{reason.value} ({detail})", path=plan.path, line=lineno, field=column, reason=reason
    )


def _expected_fields(plan: _FilePlan) -> str:
    return f"expected {len(plan.names)} fields separated by {plan.csv.delimiter!r}"


def _count_error(plan: _FilePlan, lineno: int, got: str) -> DataError:
    """The error of a line with a wrong number of fields; ``got`` says what it has."""
    return _bad_line(
        plan, lineno, BadLineReason.FIELD_COUNT, "fields", f"{_expected_fields(plan)}, {got}"
    )


def _read_counting(
    data: bytes, plan: _FilePlan, convert: pacsv.ConvertOptions
) -> tuple[pa.Table, dict[int, int]]:
    """``data`` through pyarrow, skipping the rows with a wrong number of fields.

    Returns ``(table of the other rows, {row index in data: fields found})``; a row
    pyarrow gives no number gets a negative index.

    ``data`` must be UTF-8: pyarrow decodes a row to text before it calls the
    invalid-row handler, and on bytes that are not UTF-8 it prints a traceback and
    fails the read instead (see ``_as_utf8``).

    Raises:
        pa.ArrowInvalid: if pyarrow cannot read ``data`` otherwise.
    """
    wrong_count: dict[int, int] = {}

    def invalid_row(row: object) -> str:
        number = getattr(row, "number", None)
        key = -1 - len(wrong_count) if number is None else int(number) - 1
        wrong_count[key] = int(getattr(row, "actual_columns", -1))
        return "skip"

    return plan.read(data, convert, invalid_row), wrong_count


def _as_utf8(data: bytes) -> bytes:
    """``data`` with each invalid UTF-8 byte sequence replaced by U+FFFD.

    The fields are unchanged: the replaced bytes are never ASCII (so never a delimiter,
    quote or line end), and the ASCII bytes around them are kept.
    """
    return data.decode("utf-8", "replace").encode("utf-8")


def _not_utf8_lines(block: bytes) -> np.ndarray:
    """``(n,) bool``: the lines of ``block`` (each ending in a newline) not UTF-8 text.

    Vectorized: decoded with ``surrogateescape``, each byte that is not UTF-8 is one
    code point U+DC80..U+DCFF (which UTF-8 text never decodes to) and each newline
    U+000A, so a line's index is the number of newlines before its bad code points.
    """
    try:
        block.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        return np.zeros(block.count(b"\n"), dtype=bool)
    text = block.decode("utf-8", "surrogateescape")
    code = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    newlines = np.flatnonzero(code == ord("\n"))
    bad = np.zeros(len(newlines), dtype=bool)
    bad[np.searchsorted(newlines, np.flatnonzero((code >= 0xDC80) & (code <= 0xDCFF)))] = True
    return bad


def _diagnose(line: bytes, lineno: int, plan: _FilePlan) -> DataError:
    """The ``DataError`` naming what is wrong with one line that failed to parse."""

    def bad(reason: BadLineReason, column: str, detail: str) -> DataError:
        return _bad_line(plan, lineno, reason, column, detail)

    as_bytes = _convert_options(dict.fromkeys(plan.used, pa.binary()))
    text = _as_utf8(line)  # the same fields, for pyarrow's invalid-row handler
    try:
        table, wrong_count = _read_counting(text, plan, as_bytes)
    except pa.ArrowInvalid:
        table, wrong_count = None, {}
    counts = list(wrong_count.values())  # the field counts of the rows pyarrow could not take
    expected = _expected_fields(plan)
    if line in (b"", b"\r"):  # "\r" is the end of an empty line of a CRLF file
        return bad(BadLineReason.FIELD_COUNT, "fields", f"{expected}, got an empty line")
    if table is not None and table.num_rows + len(counts) > 1:
        # pyarrow ends a row at a lone "\r" too: the line read as several rows
        return bad(
            BadLineReason.FIELD_COUNT,
            "fields",
            f"{expected}, got a carriage return inside the line, which splits it",
        )
    if table is None or table.num_rows != 1:
        got = f"got {counts[0]}" if counts else "got an empty line"
        return bad(BadLineReason.FIELD_COUNT, "fields", f"{expected}, {got}")
    if text != line:  # the values as they are (the fields are those just read)
        table = plan.read(line, as_bytes)
    for name in plan.used:
        error = _value_error(table.column(name)[0].as_py(), name, line, lineno, plan)
        if error is not None:
            return error
    return bad(BadLineReason.FIELD_COUNT, "fields", f"pyarrow cannot read the line {line[:60]!r}")


def _value_error(
    value: bytes, name: str, line: bytes, lineno: int, plan: _FilePlan
) -> DataError | None:
    """What is wrong with the field ``name`` of a line pyarrow could split, or ``None``.

    ``value`` is the field's raw bytes; the checks, in order: UTF-8 text, a label
    ``0``/``1``, a dense value that is a finite float32.
    """
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return _bad_line(plan, lineno, BadLineReason.NOT_UTF8, name, f"got {value[:30]!r}")
    if name == plan.mapping.label_column and text not in ("0", "1"):
        return _bad_line(plan, lineno, BadLineReason.LABEL_NOT_BINARY, name, f"got {text[:20]!r}")
    if name in plan.mapping.dense_columns:
        problem = _dense_problem(line, name, plan)
        if problem is not None:
            detail = f"got {text[:30]!r}" + (f", {problem}" if "range" in problem else "")
            return _bad_line(plan, lineno, BadLineReason.DENSE_NOT_NUMBER, name, detail)
    return None


def _dense_problem(line: bytes, name: str, plan: _FilePlan) -> str | None:
    """What keeps column ``name`` of ``line`` from being a dense value, or ``None``.

    A dense value is a float64 as pyarrow reads it (or empty), finite once stored as
    float32.
    """
    try:
        table = plan.read(line, _convert_options({name: pa.float64()}))
    except pa.ArrowInvalid:
        return "not a number"
    value = table.column(name)[0].as_py()
    if value is None:
        return None
    if not np.isfinite(value):
        return "not finite"
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(value)):
            return "beyond float32's range, +-3.4e38"
    return None


# A dense value pyarrow surely reads as a float64: anything else is checked line by line.
_NUMBER = r"^[ \t]*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t]*$"


def _find_bad_lines(
    block: bytes, first_line: int, plan: _FilePlan
) -> tuple[np.ndarray, list[DataError]] | None:
    r"""``(keep (n,) bool, errors of the bad lines in line order)`` of a failing block.

    One pyarrow read of the mapped columns as bytes, wrong field counts reported by
    its invalid-row handler, then vectorized checks per column in file order (UTF-8,
    label, dense); only values those checks flag are looked at one by one, with the
    checks ``_diagnose`` makes, so the errors are the ones it gives. A line with a lone
    ``"\r"`` (which ends a row in pyarrow) is diagnosed alone and left out of the
    pass, and so is a line that is not UTF-8 with a wrong number of fields (counted
    first, on a UTF-8 copy of such lines: pyarrow's handler cannot take its bytes).
    ``None`` when pyarrow's rows are still not the lines (a byte-order mark, an
    empty last line) or a value defeats the vectorized checks: the caller then splits
    the block.
    """
    buf = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(buf == ord("\n")) + 1  # (n,) end of each line, past its newline
    starts = np.concatenate(([0], ends[:-1]))
    n = len(ends)
    if block.startswith(_BOM):
        return None
    errors: dict[int, DataError] = {}  # line index -> its error
    # A lone "\r" ends a row in pyarrow (unless quoted): such a line is read alone, and
    # the pass reads the other lines, whose rows are then the lines.
    cr = np.flatnonzero(buf == ord("\r"))
    lone_cr = np.zeros(n, dtype=bool)
    lone_cr[np.searchsorted(ends, cr[buf[cr + 1] != ord("\n")], side="right")] = True
    for i in np.flatnonzero(lone_cr).tolist():
        line = block[starts[i] : ends[i] - 1]
        try:
            _parse_block(line, 1, plan)
        except _BlockInvalidError:
            errors[i] = _diagnose(line, first_line + i, plan)
        else:
            return None  # a good line ("\r" quoted): the split keeps it in its place
    # pyarrow cannot hand a line that is not UTF-8 to its invalid-row handler (it fails
    # decoding it): such lines' fields are counted first, on a UTF-8 copy, and those
    # with a wrong count are left out of the pass; the others are read in the pass.
    out = lone_cr.copy()  # (n,) lines left out of the pass
    not_utf8 = np.flatnonzero(_not_utf8_lines(block) & ~lone_cr)
    if len(not_utf8):
        counted = _read_lines(block, not_utf8, plan, utf8=True)
        if counted is None:
            return None
        for i, count in counted[1].items():
            errors[i], out[i] = _count_error(plan, first_line + i, f"got {count}"), True
    lines = np.flatnonzero(~out)  # (m,) the lines of the pass
    if not len(lines):
        return np.zeros(n, dtype=bool), [errors[i] for i in sorted(errors)]
    widths = ends - starts - 1  # without the newline
    # An empty line ("\r" alone in a CRLF file too): pyarrow reads it as a row of empty
    # fields; for _diagnose it is a line without fields.
    empty = (widths == 0) | ((widths == 1) & (buf[starts] == ord("\r")))
    read = _read_lines(block, lines, plan)
    if read is None:
        return None
    table, wrong_count = read
    for i, count in wrong_count.items():
        errors[i] = _count_error(plan, first_line + i, f"got {count}")
    rows = np.setdiff1d(lines, np.fromiter(wrong_count, dtype=np.int64))  # table row -> line
    for i in rows[empty[rows]].tolist():
        errors[i] = _count_error(plan, first_line + i, "got an empty line")
    pending = ~empty[rows]  # table rows with no error yet
    for name in plan.used:
        column = table.column(name).combine_chunks()
        flagged = _flag_values(column, name, plan)
        if flagged is None:
            return None
        values = column.to_pylist() if (flagged & pending).any() else []
        for j in np.flatnonzero(flagged & pending):
            i = int(rows[j])
            line = block[starts[i] : ends[i] - 1]
            error = _value_error(values[j], name, line, first_line + i, plan)
            if error is not None:
                errors[i], pending[j] = error, False
    keep = np.ones(n, dtype=bool)
    keep[list(errors)] = False
    return keep, [errors[i] for i in sorted(errors)]


def _read_lines(
    block: bytes, lines: np.ndarray, plan: _FilePlan, *, utf8: bool = False
) -> tuple[pa.Table, dict[int, int]] | None:
    """The lines ``lines`` (ascending indices) of ``block``, mapped columns as bytes.

    Returns ``(table of the lines with the right number of fields, {line index: fields
    found} of the others)``; ``None`` when pyarrow cannot read the lines or its rows are
    not the lines. ``utf8`` reads a UTF-8 copy (``_as_utf8``): for lines that are not
    UTF-8, whose fields it counts right but whose values it changes.
    """
    keep = np.zeros(block.count(b"\n"), dtype=bool)
    keep[lines] = True
    data = _select_lines(block, keep)[:-1]
    as_bytes = _convert_options(dict.fromkeys(plan.used, pa.binary()))
    try:
        table, wrong_count = _read_counting(_as_utf8(data) if utf8 else data, plan, as_bytes)
    except pa.ArrowInvalid:
        return None
    m = len(lines)
    if table.num_rows + len(wrong_count) != m or any(not 0 <= k < m for k in wrong_count):
        return None
    return table, {int(lines[k]): count for k, count in wrong_count.items()}


def _flag_values(column: pa.Array, name: str, plan: _FilePlan) -> np.ndarray | None:
    """``(rows,) bool``: the values of one column (raw bytes) that may be bad.

    Vectorized and never missing a bad value the reader would refuse; a flagged value
    may be good (``_value_error`` decides). ``None`` if a dense value matching
    ``_NUMBER`` is refused by pyarrow's cast (the caller falls back to splitting).
    """
    try:
        text = column.cast(pa.string())
    except pa.ArrowInvalid:  # not UTF-8 somewhere: look at each value
        return np.ones(len(column), dtype=bool)
    if name == plan.mapping.label_column:
        ok = pc.is_in(text, value_set=pa.array(["0", "1"]))
        return np.asarray(~ok.to_numpy(zero_copy_only=False), dtype=bool)
    if name not in plan.mapping.dense_columns:
        return np.zeros(len(column), dtype=bool)
    number = pc.match_substring_regex(text, _NUMBER).to_numpy(zero_copy_only=False)
    empty = pc.equal(pc.utf8_length(text), 0).to_numpy(zero_copy_only=False)
    try:
        values = pc.cast(
            pc.if_else(pa.array(number), pc.utf8_trim(text, " \t"), "0"), pa.float64()
        ).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        return None
    with np.errstate(over="ignore"):
        finite = np.isfinite(values.astype(np.float32))
    return np.asarray(~((number & finite) | empty), dtype=bool)


def _select_lines(block: bytes, keep: np.ndarray) -> bytes:
    """The lines of ``block`` (each ending in a newline) where ``keep``, in order."""
    buf = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(buf == ord("\n")) + 1
    line_of_byte = np.repeat(np.arange(len(ends)), np.diff(ends, prepend=0))
    return bytes(buf[keep[line_of_byte]].tobytes())
