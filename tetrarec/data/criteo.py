"""Reader of the raw Criteo click logs (Kaggle DAC and 1TB ``day_N`` layout).

Each line is 40 TAB-separated fields, no header, plain text or gzip::

    label  I1 .. I13           C1 .. C26
    0/1    integers, may be    8 hex digits (a 32-bit hash),
           negative or empty   or empty

A file without the label field (Criteo's ``test.txt``: 39 fields, ``I1 .. C26``) is
read when the caller does not require labels (scoring): each file's layout is told
from its first line, and a line of the other layout in it is a bad line
(``on_bad_line``). Its rows' labels are NaN and its blocks say ``labeled=False``.

Missing values become 0 (a missing dense value is 0 before the transform; a missing
categorical is the raw value 0). The reader keeps both raw: the dense values as float32
(exact below ``2**24``; larger counts round to float32's 24-bit precision), the
categoricals as ``uint32``. At read time ``tetrarec.data.dense`` transforms the dense
values (``log(1 + max(x, 0))`` by default) and ``tetrarec.data.transforms.hash_ids``
maps the categoricals into table rows.

Parsing is block-wise: each block of whole lines (16 MiB) goes through pyarrow's CSV
reader with the categoricals and the label as raw bytes, and the hex and label checks
are vectorized numpy. Only when a block fails (a wrong field count, a non-integer
dense value, a non-hex categorical, a label other than 0/1) is it re-parsed line by
line in Python, to name the file, the 1-based line number and the field, or - with
``on_bad_line="skip"`` - to drop and count the bad lines.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from tetrarec.data.config import BadLinePolicy
from tetrarec.data.errors import (
    BadLineReason,
    BadLineSummary,
    BadLineTally,
    DataError,
    DataFileNotFoundError,
)

__all__ = [
    "DENSE_FIELDS",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_FIELDS",
    "CriteoBlock",
    "iter_criteo_blocks",
    "open_input",
    "read_criteo",
]

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_FIELDS = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_FIELDS = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
_FIELDS = ("label", *DENSE_FIELDS, *SPARSE_FIELDS)
_BLOCK_BYTES = 16 << 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_DENSE_RE = re.compile(rb" *-?[0-9]+ *")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,8}")
_LONG_HEX_RE = re.compile(rb"[0-9a-fA-F]{9,}")

# ASCII byte -> hex nibble, 255 for a byte that is not a hex digit.
_NIBBLE = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i
# Two ASCII bytes read as a little-endian uint16 -> the byte they spell, _BAD_PAIR if
# either is not a hex digit (one lookup per two digits).
_BAD_PAIR = np.uint16(0xFFFF)
_first, _second = _NIBBLE[np.arange(65536) & 255], _NIBBLE[np.arange(65536) >> 8]
_PAIR = np.full(65536, _BAD_PAIR, dtype=np.uint16)
_ok = (_first != 255) & (_second != 255)
_PAIR[_ok] = (_first[_ok].astype(np.uint16) << 4) | _second[_ok]
_SHIFTS = (4 * np.arange(7, -1, -1)).astype(np.uint32)  # (8,) nibble j's bit position


@dataclass(frozen=True, kw_only=True)
class CriteoBlock:
    """Parsed rows of one block (``n`` rows).

    Args:
        labels: ``(n,)`` float32 in {0, 1}; NaN when not ``labeled``.
        dense: ``(n, 13)`` float32 raw integer values (0 when missing; no transform).
        sparse: ``(n, 26)`` uint32 raw categorical values (0 when missing).
        labeled: whether the rows came from lines with a label field.
    """

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    labeled: bool = True

    @property
    def rows(self) -> int:
        """``n``."""
        return int(self.labels.shape[0])


class _BlockInvalidError(Exception):
    """The fast path found a bad value; the block is re-parsed line by line."""


def open_input(path: Path) -> tuple[io.BufferedIOBase, BinaryIO]:
    """Open ``path`` for reading, gunzipping when it starts with the gzip magic bytes.

    Returns:
        ``(stream, raw)``: the (decompressed) stream to read, and the raw file whose
        ``tell()`` measures progress in bytes on disk.

    Raises:
        DataFileNotFoundError: if ``path`` does not exist.
        DataError: if ``path`` is a directory, a pipe or a device, or is named ``.gz``
            without being gzip data (a damaged header, or text under a misleading name).
    """
    if not path.exists():
        raise DataFileNotFoundError(path)
    if path.is_dir():
        hint = (
            ' (a `tetrarec preprocess criteo` output: read it with data.source = "binary")'
            if (path / "meta.json").is_file()
            else ""
        )
        raise DataError(f"expected a file, got a directory{hint}", path=path)
    if not path.is_file():
        raise DataError(
            "expected a regular file, got a pipe, socket or device (the reader seeks in "
            "its input): write the data to a file first",
            path=path,
        )
    raw = path.open("rb")
    magic = raw.read(2)
    raw.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.suffix == ".gz" and magic:
        raw.close()
        raise DataError(
            f"named .gz but not gzip data: it starts with {magic!r}, not the gzip magic "
            "bytes b'\\x1f\\x8b' (a damaged file, or plain text to be renamed)",
            path=path,
        )
    return raw, raw


def _read_some(stream: io.BufferedIOBase, path: Path) -> bytes:
    try:
        return stream.read(_BLOCK_BYTES)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"corrupt or truncated gzip data ({e})", path=path) from None


def _line_blocks(path: Path, on_bytes: Callable[[int], None] | None) -> Iterator[tuple[bytes, int]]:
    """Yield ``(block of whole lines, number of its first line)``; blocks end in a newline."""
    stream, raw = open_input(path)
    with raw, stream:
        carry = b""
        first_line = 1
        seen_any = False
        done = raw.tell()
        while data := _read_some(stream, path):
            seen_any = True
            if on_bytes is not None:
                on_bytes(raw.tell() - done)
                done = raw.tell()
            buf = carry + data
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                carry = buf
                continue
            block, carry = buf[:cut], buf[cut:]
            yield block, first_line
            first_line += block.count(b"\n")
        if carry:
            yield carry + b"\n", first_line
    if not seen_any:
        raise DataError("the file is empty", path=path)


def _binary_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets (n+1,) int64, data bytes)`` of a binary array without copying data."""
    n = len(arr)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(1, np.uint8)
    if data.size == 0:
        data = np.zeros(1, np.uint8)
    return offsets.astype(np.int64), data


def _hex_column(arr: pa.Array) -> np.ndarray:
    """``(n,)`` uint32 from 0-8 hex digits per value (empty -> 0).

    Raises:
        _BlockInvalidError: if any value is not 1-8 hex digits.
    """
    offsets, data = _binary_parts(arr)
    lens = offsets[1:] - offsets[:-1]  # (n,)
    full = lens == 8
    if not (full | (lens == 0)).all():
        return _hex_column_ragged(offsets, data, lens)
    # The common case (Criteo's fixed 8 digits or empty): the non-empty values lie back
    # to back in ``data``, so they are an (m, 8) view, no gather needed.
    m = int(full.sum())
    start = int(offsets[0])
    pairs = _PAIR[data[start : start + 8 * m].view("<u2").reshape(m, 4)]  # (m, 4) bytes
    if (pairs == _BAD_PAIR).any():
        raise _BlockInvalidError
    value = pairs[:, 0].astype(np.uint32) << 24  # most significant byte first
    value |= pairs[:, 1].astype(np.uint32) << 16
    value |= pairs[:, 2].astype(np.uint32) << 8
    value |= pairs[:, 3]
    out = np.zeros(len(lens), dtype=np.uint32)
    out[full] = value
    return out


def _hex_column_ragged(offsets: np.ndarray, data: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``_hex_column`` for values of any length (slower: an (n, 8) gather)."""
    if (lens > 8).any():
        raise _BlockInvalidError
    j = np.arange(8)
    # Right-align each value in 8 nibble slots: slot j holds byte (end - 8 + j).
    valid = j[None, :] >= (8 - lens)[:, None]  # (n, 8)
    pos = np.where(valid, offsets[1:, None] - 8 + j[None, :], 0)  # (n, 8)
    nib = np.where(valid, _NIBBLE[data[pos]], 0)  # (n, 8)
    if (nib == 255).any():
        raise _BlockInvalidError
    out: np.ndarray = (nib.astype(np.uint32) << _SHIFTS).sum(axis=1, dtype=np.uint32)
    return out


def _label_column(arr: pa.Array) -> np.ndarray:
    """``(n,)`` float32 from b"0"/b"1". Raises ``_BlockInvalidError`` on anything else."""
    offsets, data = _binary_parts(arr)
    if ((offsets[1:] - offsets[:-1]) != 1).any():
        raise _BlockInvalidError
    byte = data[offsets[:-1]]
    if ((byte != ord("0")) & (byte != ord("1"))).any():
        raise _BlockInvalidError
    labels: np.ndarray = (byte == ord("1")).astype(np.float32)
    return labels


_PARSE_OPTIONS = pacsv.ParseOptions(
    delimiter="\t",
    quote_char=False,
    double_quote=False,
    escape_char=False,
    ignore_empty_lines=False,
)


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """The fields of a line: with the label (the click logs) or without (``test.txt``)."""

    fields: tuple[str, ...]
    read_options: pacsv.ReadOptions
    convert_options: pacsv.ConvertOptions

    @classmethod
    def of(cls, fields: tuple[str, ...]) -> _Layout:
        types = {"label": pa.binary(), **dict.fromkeys(DENSE_FIELDS, pa.int64())}
        types.update(dict.fromkeys(SPARSE_FIELDS, pa.binary()))
        return cls(
            fields=fields,
            read_options=pacsv.ReadOptions(
                column_names=list(fields), block_size=_BLOCK_BYTES + 1024
            ),
            convert_options=pacsv.ConvertOptions(
                column_types={f: types[f] for f in fields},
                null_values=[""],
                strings_can_be_null=False,
            ),
        )

    @property
    def labeled(self) -> bool:
        """Whether the first field is the label."""
        return self.fields[0] == "label"


# Keyed by whether the lines carry the label field.
_LAYOUTS = {True: _Layout.of(_FIELDS), False: _Layout.of(_FIELDS[1:])}


def _layout(block: bytes, require_labels: bool) -> _Layout:
    """The layout of a file whose first block is ``block``: told from its first line.

    Only a first line of exactly 39 fields, when labels are not required, makes a file
    unlabeled; any other first line is read as the labeled layout (a bad first line is
    then refused or skipped as the labeled layout's).
    """
    first = block[: block.find(b"\n")].removesuffix(b"\r")
    unlabeled = not require_labels and first.count(b"\t") + 1 == len(_FIELDS) - 1
    return _LAYOUTS[not unlabeled]


def _parse_fast(block: bytes, layout: _Layout = _LAYOUTS[True]) -> CriteoBlock:
    """Parse a block with pyarrow. Raises ``_BlockInvalidError`` when any line is bad."""
    # Two things pyarrow accepts that are no Criteo data, sent to the strict parser: hex
    # integers ("0x1f" -> 31; "x" is valid nowhere in a line), and a UTF-8 byte-order
    # mark at the start of its input (which it drops, here the start of any block).
    if b"x" in block or b"X" in block or block.startswith(b"\xef\xbb\xbf"):
        raise _BlockInvalidError
    try:
        table = pacsv.read_csv(
            pa.py_buffer(block),
            read_options=layout.read_options,
            parse_options=_PARSE_OPTIONS,
            convert_options=layout.convert_options,
        )
    except pa.ArrowInvalid:
        raise _BlockInvalidError from None
    n = table.num_rows
    if n != block.count(b"\n"):  # pyarrow also ends lines at a lone "\r"
        raise _BlockInvalidError
    if layout.labeled:
        labels = _label_column(table.column("label").combine_chunks())
    else:
        labels = np.full(n, np.nan, dtype=np.float32)
    dense = np.empty((n, NUM_DENSE), dtype=np.float32)
    for i, name in enumerate(DENSE_FIELDS):
        dense[:, i] = table.column(name).combine_chunks().fill_null(0).to_numpy()  # int64
    sparse = np.empty((n, NUM_SPARSE), dtype=np.uint32)
    for i, name in enumerate(SPARSE_FIELDS):
        sparse[:, i] = _hex_column(table.column(name).combine_chunks())
    return CriteoBlock(labels=labels, dense=dense, sparse=sparse, labeled=layout.labeled)


def _parse_line(
    line: bytes, path: Path, lineno: int, layout: _Layout
) -> tuple[int, list[int], list[int]]:
    """Parse one line strictly (label 0 without a label field).

    Raises:
        DataError: naming the line and the field.
    """

    def bad(reason: BadLineReason, field: str, detail: str) -> DataError:
        return DataError(
            f"{reason.value} ({detail})", path=path, line=lineno, field=field, reason=reason
        )

    if line.endswith(b"\r"):
        line = line[:-1]
    fields = line.split(b"\t")
    if len(fields) != len(layout.fields):
        detail = f"expected {len(layout.fields)} tab-separated fields, got {len(fields)}"
        raise bad(BadLineReason.FIELD_COUNT, "fields", detail)
    label = b"0"
    if layout.labeled:
        label, fields = fields[0], fields[1:]
        if label not in (b"0", b"1"):
            raise bad(BadLineReason.LABEL_NOT_BINARY, "label", f"got {label[:20]!r}")
    dense = []
    for name, value in zip(DENSE_FIELDS, fields[:NUM_DENSE]):
        if not value:
            dense.append(0)
            continue
        x = int(value) if _DENSE_RE.fullmatch(value) else None
        if x is None or not _INT64_MIN <= x <= _INT64_MAX:
            raise bad(BadLineReason.DENSE_NOT_INTEGER, name, f"got {value[:30]!r}")
        dense.append(x)
    sparse = []
    for name, value in zip(SPARSE_FIELDS, fields[NUM_DENSE:]):
        if not value:
            sparse.append(0)
        elif _HEX_RE.fullmatch(value):
            sparse.append(int(value, 16))
        else:
            longer = _LONG_HEX_RE.fullmatch(value) is not None
            note = ": hex, but over 8 digits (Criteo's ids are 32 bits)" if longer else ""
            raise bad(BadLineReason.CATEGORICAL_NOT_HEX, name, f"got {value[:30]!r}{note}")
    return int(label == b"1"), dense, sparse


def _parse_slow(
    block: bytes,
    first_line: int,
    path: Path,
    layout: _Layout,
    policy: BadLinePolicy,
    tally: BadLineTally,
) -> CriteoBlock:
    """Parse a block line by line, raising or counting bad lines per ``policy``."""
    labels: list[int] = []
    dense: list[list[int]] = []
    sparse: list[list[int]] = []
    for i, line in enumerate(block.split(b"\n")[:-1]):
        try:
            label, d, s = _parse_line(line, path, first_line + i, layout)
        except DataError as e:
            if policy == BadLinePolicy.ERROR:
                raise
            tally.add(e)
            continue
        labels.append(label)
        dense.append(d)
        sparse.append(s)
    values = np.asarray(labels, dtype=np.float32)
    if not layout.labeled:
        values[:] = np.nan
    return CriteoBlock(
        labels=values,
        dense=np.asarray(dense, dtype=np.int64).reshape(-1, NUM_DENSE).astype(np.float32),
        sparse=np.asarray(sparse, dtype=np.uint32).reshape(-1, NUM_SPARSE),
        labeled=layout.labeled,
    )


def iter_criteo_blocks(
    path: str | Path,
    *,
    on_bad_line: str | BadLinePolicy = BadLinePolicy.ERROR,
    tally: BadLineTally | None = None,
    on_bytes: Callable[[int], None] | None = None,
    require_labels: bool = True,
) -> Iterator[CriteoBlock]:
    """Parse one raw Criteo file (plain or gzip), block by block, in file order.

    Args:
        path: the file.
        on_bad_line: ``"error"`` raises on the first bad line; ``"skip"`` drops it and
            counts it in ``tally``.
        tally: where skipped lines are counted (a fresh one when None).
        on_bytes: called with the number of bytes read from disk since the last call
            (for progress bars).
        require_labels: every line must have the label field (training); when false, a
            file whose first line has 39 fields is read without labels (scoring).

    Yields:
        ``CriteoBlock`` of each block's good rows (all ``labeled`` or none).

    Raises:
        DataFileNotFoundError: if the file does not exist.
        DataError: for an empty file, corrupt or truncated gzip data, or (by default) a
            bad line, naming the file, line and field.
    """
    path = Path(path)
    policy = BadLinePolicy.parse(on_bad_line)
    tally = BadLineTally() if tally is None else tally
    # Blocks are parsed on a few threads (pyarrow and numpy release the GIL) and yielded
    # in file order; a block the fast parser rejects is re-parsed line by line here, in
    # order, so errors and skip counts are exactly those of a sequential read.
    pending: deque[tuple[Future[CriteoBlock], bytes, int]] = deque()
    layout: _Layout | None = None
    with ThreadPoolExecutor(max_workers=_PARSE_THREADS) as pool:
        for block, first_line in _line_blocks(path, on_bytes):
            layout = layout or _layout(block, require_labels)
            pending.append((pool.submit(_parse_fast, block, layout), block, first_line))
            if len(pending) > _PARSE_THREADS:
                yield _finish_block(*pending.popleft(), path, layout, policy, tally)
        while pending:
            assert layout is not None  # set by the first block
            yield _finish_block(*pending.popleft(), path, layout, policy, tally)


_PARSE_THREADS = max(1, min(4, os.cpu_count() or 1))


def _finish_block(
    fast: Future[CriteoBlock],
    block: bytes,
    first_line: int,
    path: Path,
    layout: _Layout,
    policy: BadLinePolicy,
    tally: BadLineTally,
) -> CriteoBlock:
    """The fast parse of ``block``, or its careful line-by-line parse if that failed."""
    try:
        return fast.result()
    except _BlockInvalidError:
        return _parse_slow(block, first_line, path, layout, policy, tally)


def read_criteo(
    paths: Sequence[str | Path],
    *,
    on_bad_line: str | BadLinePolicy = BadLinePolicy.ERROR,
    require_labels: bool = True,
) -> tuple[CriteoBlock, BadLineSummary]:
    """Read whole raw Criteo files into memory, concatenated in the order given.

    Args:
        paths: the files (plain or gzip).
        on_bad_line: ``"error"`` or ``"skip"``.
        require_labels: see ``iter_criteo_blocks``. When false the rows are
            ``labeled`` only if every file is: one file without labels makes them all NaN.

    Returns:
        ``(all rows, summary of skipped lines)``.

    Raises:
        DataFileNotFoundError: if a file does not exist.
        DataError: see ``iter_criteo_blocks``.
    """
    if not paths:
        raise ValueError("read_criteo needs at least one file")
    tally = BadLineTally()
    blocks = [
        b
        for p in paths
        for b in iter_criteo_blocks(
            p, on_bad_line=on_bad_line, tally=tally, require_labels=require_labels
        )
    ]
    labeled = all(b.labeled for b in blocks)
    labels = np.concatenate([b.labels for b in blocks])
    out = CriteoBlock(
        labels=labels if labeled else np.full_like(labels, np.nan),
        dense=np.concatenate([b.dense for b in blocks]),
        sparse=np.concatenate([b.sparse for b in blocks]),
        labeled=labeled,
    )
    return out, tally.freeze(out.rows)
