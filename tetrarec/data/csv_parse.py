"""How pyarrow reads whole lines of a delimited text file (``csv_source``).

``_FilePlan`` holds one file's column names and pyarrow's options; a quote left open at
the end of a line is closed there (``_close_open_quotes``) so that each line is one
row; ``_header`` reads the header line and ``_parse_block`` a run of lines into
``MultiHotColumns``, raising ``_BlockInvalidError`` when any of its lines is bad (the
bad ones are then found by ``csv_bad_lines``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from tetrarec.data.config import CsvConfig
from tetrarec.data.errors import DataError
from tetrarec.data.multi_hot import ColumnMapping, MultiHotColumns, offsets_from_lengths
from tetrarec.data.transforms import hash_strings

__all__: list[str] = []

_BOM = b"\xef\xbb\xbf"
_LONG_LINE_BYTES = 1 << 20  # pyarrow's default block size: a longer line needs a larger one


class _BlockInvalidError(Exception):
    """Some line of a run is bad; the run is split and re-read."""


class _FilePlan:
    """How one file's lines are read: its column names and pyarrow's options.

    Without ``require_labels``, a file without the label column is read unlabeled
    (``has_labels`` false: its rows' labels are NaN).
    """

    def __init__(
        self,
        path: Path,
        names: Sequence[str],
        mapping: ColumnMapping,
        csv: CsvConfig,
        *,
        require_labels: bool = True,
    ):
        self.path, self.names, self.mapping, self.csv = path, tuple(names), mapping, csv
        self.has_labels = require_labels or mapping.label_column in self.names
        columns = mapping.columns if self.has_labels else mapping.columns[1:]
        missing = [c for c in columns if c not in self.names]
        if missing:
            where = "the header line" if csv.header else "csv.column_names"
            raise DataError(
                f"columns {missing} are not in {where}; it has {list(self.names)}",
                path=path,
                line=1 if csv.header else None,
            )
        twice = sorted({c for c in columns if self.names.count(c) > 1})
        if twice:
            raise DataError(f"columns {twice} appear more than once in the header", path=path)
        self.multi_hot = frozenset(csv.multi_hot_columns)
        # The mapped columns in file order: a bad line names the first bad one.
        self.used = tuple(c for c in self.names if c in columns)
        self.parse_options = _parse_options(csv.delimiter)
        self.open_quote = _open_quote_pattern(csv.delimiter)
        types = {mapping.label_column: pa.string()} if self.has_labels else {}
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
    labels = np.full(expected_rows, np.nan, dtype=np.float32)
    if plan.has_labels:
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
        labeled=plan.has_labels,
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
