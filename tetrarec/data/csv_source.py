"""Reader of delimited text files (CSV, TSV, ...) with a declared column mapping.

A file is plain text or gzip (told by its magic bytes), UTF-8, one row per line::

    click,hour,site_id,device_ip,C14      <- header line (or csv.column_names)
    0,14102100,1fbe01fe,ddd2926e,15706    <- line 2: the first row
    1,14102100,1fbe01fe,,15704            <- an empty field is a missing value

The mapping (``DataConfig.dense_columns``, ``sparse_columns``, ``label_column``)
picks columns by name; other columns are not converted. Values are read as follows:

- **label**: the text ``0`` or ``1``; anything else is a bad line.
- **dense**: a decimal number as pyarrow reads a float64 (``1``, ``-2.5``, ``1e3``);
  empty -> 0; anything else, ``nan`` and ``inf`` included, is a bad line. Kept as
  float32, untransformed.
- **sparse**: always text, hashed by its UTF-8 bytes with ``hash_strings`` (FNV-1a 64),
  whatever it looks like: ``123`` in a csv is the string ``"123"``, not the integer
  123 a parquet integer column would hold, and never depends on how pyarrow would
  infer the column's type. An empty field is the missing value, raw id 0 (row 0).
- **multi-hot** (``csv.multi_hot_columns``): the field is split on
  ``csv.multi_hot_separator`` and each non-empty item hashed as above; empty items are
  dropped, so an empty field is an empty bag.

Fields may be quoted with ``"`` (``"a,b"`` is the value ``a,b``; a doubled quote
inside quotes is one quote); a quote counts only at the start of a field (``ab"c`` is
the value ``ab"c``). A field never spans lines: a quote left open ends at the end of its
line (``_close_open_quotes``), so ``1,"a`` is the row ``1``, ``a`` and the next line is
a row of its own.

Parsing is block-wise (16 MiB of whole lines through pyarrow's CSV reader, label and
values checked with vectorized numpy). In a block that fails (a wrong number of
fields, a bad label, a dense value that is not a finite number, bytes that are not
UTF-8) the bad lines are found in one more vectorized pass and the other lines read
again as one block (where that pass cannot tell, the block is split into smaller runs
of lines and those re-read, down to the single lines at fault); either way the rows
read never depend on where blocks end, and skipping bad lines costs about what
reading the block twice does. A bad line raises
``DataError`` naming the file, the 1-based line number (the header is line 1) and the
column, or with ``on_bad_line="skip"`` is dropped and counted per reason.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from tetrarec.data.config import BadLinePolicy, CsvConfig
from tetrarec.data.criteo import open_input
from tetrarec.data.errors import BadLineReason, BadLineSummary, BadLineTally, DataError
from tetrarec.data.multi_hot import (
    ColumnMapping,
    MultiHotColumns,
    MultiHotDataset,
    offsets_from_lengths,
)
from tetrarec.data.transforms import hash_strings
from tetrarec.embedding.config import TableConfig

__all__ = ["CsvDataset", "iter_csv_blocks", "read_csv"]

_BLOCK_BYTES = 16 << 20
_SPLIT = 16  # a failing run of lines is re-read as this many smaller runs
_BOM = b"\xef\xbb\xbf"
_LONG_LINE_BYTES = 1 << 20  # pyarrow's default block size: a longer line needs a larger one


class _BlockInvalidError(Exception):
    """Some line of a run is bad; the run is split and re-read."""


class _FilePlan:
    """How one file's lines are read: its column names and pyarrow's options."""

    def __init__(self, path: Path, names: Sequence[str], mapping: ColumnMapping, csv: CsvConfig):
        self.path, self.names, self.mapping, self.csv = path, tuple(names), mapping, csv
        missing = [c for c in mapping.columns if c not in self.names]
        if missing:
            where = "the header line" if csv.header else "csv.column_names"
            raise DataError(
                f"columns {missing} are not in {where}; it has {list(self.names)}",
                path=path,
                line=1 if csv.header else None,
            )
        twice = sorted({c for c in mapping.columns if self.names.count(c) > 1})
        if twice:
            raise DataError(f"columns {twice} appear more than once in the header", path=path)
        self.multi_hot = frozenset(csv.multi_hot_columns)
        # The mapped columns in file order: a bad line names the first bad one.
        self.used = tuple(c for c in self.names if c in mapping.columns)
        self.parse_options = _parse_options(csv.delimiter)
        self.open_quote = _open_quote_pattern(csv.delimiter)
        types = {mapping.label_column: pa.string()}
        types.update(dict.fromkeys(mapping.dense_columns, pa.float64()))
        types.update(dict.fromkeys(mapping.sparse_columns, pa.string()))
        self.convert = _convert_options(types)

    def read(
        self,
        data: bytes,
        convert: pacsv.ConvertOptions | None = None,
        invalid_row: Callable[[object], str] | None = None,
    ) -> pa.Table:
        """``data`` (whole lines, the last without its newline) through pyarrow."""
        data = _close_open_quotes(data, self.open_quote)
        skip = 0
        if data.startswith(_BOM):  # pyarrow drops a BOM at the start of its input
            data, skip = b"\n" + data, 1
        parse = self.parse_options
        if invalid_row is not None:
            parse = _parse_options(self.csv.delimiter, invalid_row)

        def read(block_size: int | None) -> pa.Table:
            options = pacsv.ReadOptions(
                column_names=list(self.names), skip_rows=skip, use_threads=invalid_row is None
            )
            if block_size is not None:
                options.block_size = block_size
            return pacsv.read_csv(
                pa.py_buffer(data),
                read_options=options,
                parse_options=parse,
                convert_options=convert or self.convert,
            )

        try:
            return read(None)
        except pa.ArrowInvalid as e:
            # pyarrow parses in blocks (1 MiB by default) and refuses a line longer
            # than one: read the data as a single block instead (no threads, but valid).
            if "straddl" not in str(e) or len(data) < _LONG_LINE_BYTES:
                raise
            return read(len(data) + 1)


def _open_quote_pattern(delimiter: str) -> re.Pattern[bytes]:
    """A pattern matching a line (no newline) whose last field leaves a quote open.

    As pyarrow's parser reads fields: a field is quoted when it starts with ``"``;
    inside, ``""`` is a quote and a lone ``"`` closes it, after which the rest of the
    field up to the delimiter is literal text (quotes too); a field not starting with
    ``"`` is literal text. The groups are atomic and the repeats possessive, so each
    line is matched in one pass.
    """
    d = re.escape(delimiter.encode())
    quoted = rb'"(?:[^"\n]|"")*+"[^' + d + rb"\n]*+"
    literal = rb'[^"' + d + rb"\n][^" + d + rb"\n]*+"
    return re.compile(rb"(?:(?>" + quoted + b"|" + literal + rb"|)" + d + rb')*+"(?:[^"\n]|"")*+')


def _close_open_quotes(data: bytes, open_quote: re.Pattern[bytes]) -> bytes:
    r"""``data`` (lines) with a ``"`` added at the end of each line that leaves one open.

    pyarrow's parser carries an open quote over the newline into the next line (even
    with ``newlines_in_values=False``): the rows are then not the lines, and together
    with a lone ``"\r"`` (which ends a row in pyarrow) elsewhere in a block, the count
    of rows can still match the count of lines. Closed here, a line's row is what
    pyarrow reads from that line alone, wherever blocks end.

    Vectorized: only lines with an odd number of quotes can leave one open, unless a
    field holds a literal quote (``ab"c``); those are matched with ``open_quote``
    one by one. A line with an even number is matched too when ``data`` has a lone
    ``"\r"``; otherwise one left open makes fewer rows than lines, which the callers'
    count of rows finds.
    """
    if b'"' not in data:
        return data
    buf = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(buf == ord("\n"))
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [len(data)]))
    if starts[-1] == len(data):  # an empty last line: no quote in it
        starts, ends = starts[:-1], ends[:-1]
    is_quote = (buf == ord('"')).view(np.uint8)
    lone_cr = False
    if b"\r" in data:
        cr = np.flatnonzero(buf[:-1] == ord("\r"))
        lone_cr = bool((buf[cr + 1] != ord("\n")).any())
    # per line: any quote (with a lone "\r"), else an odd number of them
    reduce = np.bitwise_or if lone_cr else np.bitwise_xor
    candidates = np.flatnonzero(reduce.reduceat(is_quote, starts))
    parts, done = [], 0
    for i in candidates.tolist():
        start, end = int(starts[i]), int(ends[i])
        if open_quote.fullmatch(data, start, end) is not None:
            parts += [data[done:end], b'"']
            done = end
    if not parts:
        return data
    parts.append(data[done:])
    return b"".join(parts)


def _parse_options(
    delimiter: str, invalid_row: Callable[[object], str] | None = None
) -> pacsv.ParseOptions:
    return pacsv.ParseOptions(
        delimiter=delimiter,
        quote_char='"',
        double_quote=True,
        escape_char=False,
        newlines_in_values=False,
        ignore_empty_lines=False,  # an empty line is a bad line, counted like any other
        invalid_row_handler=invalid_row,
    )


def _convert_options(types: dict[str, pa.DataType]) -> pacsv.ConvertOptions:
    return pacsv.ConvertOptions(
        column_types=types,
        include_columns=list(types),
        null_values=[""],
        strings_can_be_null=False,
        quoted_strings_can_be_null=True,
    )


def _line_blocks(path: Path, on_bytes: Callable[[int], None] | None) -> Iterator[tuple[bytes, int]]:
    """Yield ``(block of whole lines, number of its first line)``; blocks end in a newline.

    A UTF-8 byte-order mark at the start of the file is dropped.
    """
    stream, raw = open_input(path)
    with raw, stream:
        carry, first_line, seen_any, done = b"", 1, False, raw.tell()
        while data := _read_some(stream, path):
            if not seen_any and data.startswith(_BOM):
                data = data[len(_BOM) :]
            seen_any = True
            if on_bytes is not None:
                on_bytes(raw.tell() - done)
                done = raw.tell()
            buf = carry + data
            cut = buf.rfind(b"\n") + 1
            block, carry = buf[:cut], buf[cut:]
            if block:
                yield block, first_line
                first_line += block.count(b"\n")
        if carry:
            yield carry + b"\n", first_line
    if not seen_any:
        raise DataError("the file is empty", path=path)


def _read_some(stream: io.BufferedIOBase, path: Path) -> bytes:
    try:
        return stream.read(_BLOCK_BYTES)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"corrupt or truncated gzip data ({e})", path=path) from None


def _header(line: bytes, path: Path, csv: CsvConfig) -> list[str]:
    r"""The column names of a header line (without its ``"\n"``).

    A lone ``"\r"`` inside the line makes it bad, as it does a data line: pyarrow
    ends a row there, so the names would be those of the part before it and the rest
    (every line of a file with classic-Mac ``"\r"`` line ends) would be read as rows.
    """
    try:  # pyarrow would fail decoding the names (or a row for invalid_row) later
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"cannot read the header line (byte {e.start + 1} is not UTF-8 text:"
            f" {line[max(e.start - 10, 0) : e.start + 10]!r})",
            path=path,
            line=1,
        ) from None
    extra_rows = 0  # rows after the first, which pyarrow ends at a lone "\r"

    def invalid_row(row: object) -> str:
        nonlocal extra_rows
        extra_rows += 1
        return "skip"

    try:
        table = pacsv.read_csv(
            pa.py_buffer(line + b"\n"),
            read_options=pacsv.ReadOptions(use_threads=False),
            parse_options=_parse_options(csv.delimiter, invalid_row),
        )
    except pa.ArrowInvalid as e:
        raise DataError(f"cannot read the header line ({e})", path=path, line=1) from None
    if table.num_rows + extra_rows:
        raise DataError(
            "cannot read the header line (got a carriage return inside the line, which"
            " splits it; lines must end in \\n or \\r\\n)",
            path=path,
            line=1,
        )
    names: list[str] = table.column_names
    return names


def _parse_block(data: bytes, expected_rows: int, plan: _FilePlan) -> MultiHotColumns:
    """Read lines with pyarrow; raises ``_BlockInvalidError`` if any of them is bad."""
    try:
        table = plan.read(data)
    except pa.ArrowInvalid:
        raise _BlockInvalidError from None
    if table.num_rows != expected_rows:  # an open quote or a lone "\r" moved a line end
        raise _BlockInvalidError
    m = plan.mapping
    label = table.column(m.label_column).combine_chunks()
    if not pc.all(pc.is_in(label, value_set=pa.array(["0", "1"]))).as_py():
        raise _BlockInvalidError
    labels = pc.equal(label, "1").to_numpy(zero_copy_only=False).astype(np.float32)
    dense = np.zeros((expected_rows, len(m.dense_columns)), dtype=np.float32)
    with np.errstate(over="ignore"):  # beyond float32's range is inf, refused just below
        for i, name in enumerate(m.dense_columns):
            dense[:, i] = table.column(name).combine_chunks().fill_null(0).to_numpy()
    if not np.isfinite(dense).all():
        raise _BlockInvalidError
    bags = [_bags(table.column(c).combine_chunks(), c, plan) for c in m.sparse_columns]
    return MultiHotColumns(
        labels=labels,
        dense=dense,
        ids=tuple(b[0] for b in bags),
        offsets=tuple(b[1] for b in bags),
        multi_hot=tuple(c in plan.multi_hot for c in m.sparse_columns),
    )


def _bags(arr: pa.Array, name: str, plan: _FilePlan) -> tuple[np.ndarray, np.ndarray]:
    """``(raw ids (N_f,), offsets (n+1,))`` of a sparse text column."""
    if name not in plan.multi_hot:
        return hash_strings(arr), np.arange(len(arr) + 1, dtype=np.int64)
    lists = pc.split_pattern(arr, pattern=plan.csv.multi_hot_separator)
    items = pc.list_flatten(lists)
    parents = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)
    keep = pc.greater(pc.binary_length(items), 0).to_numpy(zero_copy_only=False)
    lengths = np.bincount(parents[keep], minlength=len(arr))
    return hash_strings(items.filter(pa.array(keep))), offsets_from_lengths(lengths)


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


def _parse_lines(
    block: bytes, first_line: int, plan: _FilePlan, policy: BadLinePolicy, tally: BadLineTally
) -> list[MultiHotColumns]:
    """The good rows of ``block`` (whole lines, each ending in a newline).

    The block is read whole. If that fails, ``_find_bad_lines`` names the bad lines in
    one vectorized pass and the other lines are read again together, as one block;
    where that pass cannot tell (a quoted carriage return, a value it cannot read), the
    block is split and re-read instead (``_split_lines``). Either way every row is read
    by pyarrow exactly as it would be in a clean block, and each bad line is raised or
    counted per ``policy`` with the error ``_diagnose`` gives it.
    """
    n = block.count(b"\n")
    try:
        return [_parse_block(block[:-1], n, plan)]  # the last line's newline ends the input
    except _BlockInvalidError:
        pass
    found = _find_bad_lines(block, first_line, plan)
    if found is None:
        return _split_lines(block, first_line, plan, policy, tally, read_first=False)
    keep, errors = found
    good: list[MultiHotColumns] = []
    if keep.any():
        try:  # nothing the pass missed: the other lines read clean, else split
            good = [_parse_block(_select_lines(block, keep)[:-1], int(keep.sum()), plan)]
        except _BlockInvalidError:
            return _split_lines(block, first_line, plan, policy, tally, read_first=False)
    if policy == BadLinePolicy.ERROR:
        raise errors[0]
    for error in errors:
        tally.add(error)
    return good


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


def _split_lines(
    block: bytes,
    first_line: int,
    plan: _FilePlan,
    policy: BadLinePolicy,
    tally: BadLineTally,
    *,
    read_first: bool = True,
) -> list[MultiHotColumns]:
    """The good rows of ``block``, found by splitting it.

    The block is read whole (unless ``read_first`` is false: the caller's read of it
    failed already), else as ``_SPLIT`` runs of lines, each read the same way, down to
    single lines, which are diagnosed and raised or counted per ``policy``. Slow with
    many bad lines (each costs about ``_SPLIT * log(lines)`` reads): ``_parse_lines``
    uses it only where ``_find_bad_lines`` cannot tell.
    """
    n = block.count(b"\n")
    if read_first:
        try:
            return [_parse_block(block[:-1], n, plan)]
        except _BlockInvalidError:
            pass
    if n == 1:
        error = _diagnose(block[:-1], first_line, plan)
        if policy == BadLinePolicy.ERROR:
            raise error
        tally.add(error)
        return []
    ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == ord("\n")) + 1  # (n,)
    step = -(-n // _SPLIT)
    parts: list[MultiHotColumns] = []
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        start = 0 if lo == 0 else int(ends[lo - 1])
        parts += _split_lines(
            block[start : int(ends[hi - 1])], first_line + lo, plan, policy, tally
        )
    return parts


def iter_csv_blocks(
    path: str | Path,
    mapping: ColumnMapping,
    *,
    csv: CsvConfig | None = None,
    on_bad_line: str | BadLinePolicy = BadLinePolicy.ERROR,
    tally: BadLineTally | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[MultiHotColumns]:
    """Parse one delimited text file (plain or gzip), block by block, in file order.

    Args:
        path: the file.
        mapping: the label, dense and sparse columns to read.
        csv: the delimiter, header or column names, multi-hot columns (default: a
            comma-separated file with a header line).
        on_bad_line: ``"error"`` raises on the first bad line; ``"skip"`` drops it and
            counts it in ``tally``.
        tally: where skipped lines are counted (a fresh one when None).
        on_bytes: called with the number of bytes read from disk since the last call.

    Yields:
        ``MultiHotColumns`` of each block's good rows (raw ids, not yet hashed into
        tables).

    Raises:
        ValueError: if a multi-hot column is not a sparse column.
        DataFileNotFoundError: if the file does not exist.
        DataError: for an empty file, corrupt gzip data, a header without the mapped
            columns, or (by default) a bad line, naming the file, line and column.
    """
    path = Path(path)
    csv = CsvConfig() if csv is None else csv
    policy = BadLinePolicy.parse(on_bad_line)
    tally = BadLineTally() if tally is None else tally
    extra = sorted(set(csv.multi_hot_columns) - set(mapping.sparse_columns))
    if extra:
        raise ValueError(f"csv.multi_hot_columns {extra} are not sparse columns of the mapping")
    plan = None if csv.header else _FilePlan(path, csv.column_names, mapping, csv)
    for block, first_line in _line_blocks(path, on_bytes):
        if plan is None:
            head, _, block = block.partition(b"\n")
            plan = _FilePlan(path, _header(head, path, csv), mapping, csv)
            first_line += 1
            if not block:
                continue
        parts = _parse_lines(block, first_line, plan, policy, tally)
        if parts:
            yield parts[0] if len(parts) == 1 else MultiHotColumns.concatenate(parts)


def read_csv(
    paths: Sequence[str | Path],
    mapping: ColumnMapping,
    *,
    csv: CsvConfig | None = None,
    on_bad_line: str | BadLinePolicy = BadLinePolicy.ERROR,
) -> tuple[MultiHotColumns, BadLineSummary]:
    """Read whole delimited text files into memory, concatenated in the order given.

    Args:
        paths: the files (plain or gzip).
        mapping: the label, dense and sparse columns to read.
        csv: how the files are read (see ``CsvConfig``).
        on_bad_line: ``"error"`` or ``"skip"``.

    Returns:
        ``(all rows, summary of skipped lines)``.

    Raises:
        ValueError: if ``paths`` is empty.
        DataFileNotFoundError: if a file does not exist.
        DataError: see ``iter_csv_blocks``; also when no row is left at all.
    """
    if not paths:
        raise ValueError("read_csv needs at least one file")
    tally = BadLineTally()
    parts = [
        b
        for p in paths
        for b in iter_csv_blocks(p, mapping, csv=csv, on_bad_line=on_bad_line, tally=tally)
    ]
    if not parts:
        raise tally.no_rows_error(str([str(p) for p in paths]))
    columns = MultiHotColumns.concatenate(parts)
    return columns, tally.freeze(columns.rows)


class CsvDataset(MultiHotDataset):
    """Rows of one or more delimited text files, concatenated in order, held in memory.

    Args:
        paths: the files (plain or gzip).
        mapping: the label, dense and sparse columns (sparse in ``feature_order``).
        tables: the model's tables.
        csv: how the files are read (see ``CsvConfig``).
        on_bad_line: ``"error"`` or ``"skip"``; skipped lines are summarized in
            ``bad_lines``.

    Raises:
        DataFileNotFoundError: if a file is missing.
        DataError: see ``read_csv``.
        ValueError: if the tables do not match the sparse columns.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        mapping: ColumnMapping,
        tables: Sequence[TableConfig],
        csv: CsvConfig | None = None,
        on_bad_line: str | BadLinePolicy = BadLinePolicy.ERROR,
    ) -> None:
        columns, bad = read_csv(paths, mapping, csv=csv, on_bad_line=on_bad_line)
        super().__init__(columns, tables=tables, bad_lines=bad)
