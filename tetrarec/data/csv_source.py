"""Reader of delimited text files (CSV, TSV, ...) with a declared column mapping.

A file is plain text or gzip (told by its magic bytes), UTF-8, one row per line::

    click,hour,site_id,device_ip,C14      <- header line (or csv.column_names)
    0,14102100,1fbe01fe,ddd2926e,15706    <- line 2: the first row
    1,14102100,1fbe01fe,,15704            <- an empty field is a missing value

The mapping (``DataConfig.dense_columns``, ``sparse_columns``, ``label_column``)
picks columns by name; other columns are not converted. A file without the label
column is read (its labels NaN, ``labeled=False``) only when the caller does not
require labels (scoring); training refuses it, naming the column. Values are read as
follows:

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

This module reads a file block by block and applies the bad-line policy; how pyarrow
reads a run of lines (the file's plan, open quotes, the header) is ``csv_parse``, and
how the bad lines of a failing block are found and named is ``csv_bad_lines``.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from tetrarec.data.config import BadLinePolicy, CsvConfig
from tetrarec.data.criteo import open_input
from tetrarec.data.csv_bad_lines import _diagnose, _find_bad_lines, _select_lines
from tetrarec.data.csv_parse import _BOM, _BlockInvalidError, _FilePlan, _header, _parse_block
from tetrarec.data.errors import BadLineSummary, BadLineTally, DataError
from tetrarec.data.multi_hot import ColumnMapping, MultiHotColumns, MultiHotDataset
from tetrarec.embedding.config import TableConfig

__all__ = ["CsvDataset", "iter_csv_blocks", "read_csv"]

_BLOCK_BYTES = 16 << 20
_SPLIT = 16  # a failing run of lines is re-read as this many smaller runs


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
    require_labels: bool = True,
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
        require_labels: the label column must be in the file (training); when false, a
            file without it is read unlabeled (scoring).

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

    def make_plan(names: Sequence[str]) -> _FilePlan:
        return _FilePlan(path, names, mapping, csv, require_labels=require_labels)

    plan = None if csv.header else make_plan(csv.column_names)
    for block, first_line in _line_blocks(path, on_bytes):
        if plan is None:
            head, _, block = block.partition(b"\n")
            plan = make_plan(_header(head, path, csv))
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
    require_labels: bool = True,
) -> tuple[MultiHotColumns, BadLineSummary]:
    """Read whole delimited text files into memory, concatenated in the order given.

    Args:
        paths: the files (plain or gzip).
        mapping: the label, dense and sparse columns to read.
        csv: how the files are read (see ``CsvConfig``).
        on_bad_line: ``"error"`` or ``"skip"``.
        require_labels: see ``iter_csv_blocks``; the rows are ``labeled`` only if every
            file has the label column.

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
        for b in iter_csv_blocks(
            p, mapping, csv=csv, on_bad_line=on_bad_line, tally=tally, require_labels=require_labels
        )
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
        require_labels: see ``read_csv``; ``has_labels`` says whether the rows have them.

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
        require_labels: bool = True,
    ) -> None:
        columns, bad = read_csv(
            paths, mapping, csv=csv, on_bad_line=on_bad_line, require_labels=require_labels
        )
        super().__init__(columns, tables=tables, bad_lines=bad)
