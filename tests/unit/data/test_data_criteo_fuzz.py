"""Fuzzed Criteo input: quotes, NUL bytes, invalid UTF-8, stray carriage returns, bad gzip.

The oracle never parses text. Every good line is written from values chosen here (they
are the expected row), and every bad line has exactly one field (or the line's tab
structure) broken on purpose, so the expected line number, field name and skip reason
are known by construction. None of the parser's patterns or tables is reused.

Bugs these tests catch (each was tried, see the notes at each test):
- the fast pyarrow path accepting a value the line-by-line path rejects (``0x1f`` as a
  dense value: pyarrow reads it as 31), so a file passes or fails depending on which
  other lines share its 16 MiB block;
- a line counted by pyarrow's line breaks (a lone ``\\r`` ends a line there) instead of
  by ``\\n``, which shifts every later line number;
- gzip corruption surfacing as a traceback from ``gzip``/``zlib`` instead of a
  ``DataError`` naming the file.
"""

from __future__ import annotations

import gzip
import random
from dataclasses import dataclass

import numpy as np
import pytest

from tetrarec.data import BadLineReason, DataError, read_criteo
from tetrarec.data import criteo as criteo_mod

# Written out, not imported: the names a user reads in the error message.
LABEL = "label"
DENSE = [f"I{i}" for i in range(1, 14)]
CATS = [f"C{i}" for i in range(1, 27)]
NAMES = [LABEL, *DENSE, *CATS]
FIELDS = "fields"  # the name given to a line whose tab structure is wrong

REASON = {
    LABEL: BadLineReason.LABEL_NOT_BINARY,
    **dict.fromkeys(DENSE, BadLineReason.DENSE_NOT_INTEGER),
    **dict.fromkeys(CATS, BadLineReason.CATEGORICAL_NOT_HEX),
    FIELDS: BadLineReason.FIELD_COUNT,
}

# Values that are not a label (the label is exactly "0" or "1").
BAD_LABELS = [
    b'"1"',  # quoted
    b"1\x00",  # NUL byte
    b"\x00",
    b"\xff",  # invalid UTF-8
    b"\xef\xbb\xbf0",  # a UTF-8 byte-order mark before the label
    b"2",
    b" 1",
    b"1.0",
    b"\r1",  # stray carriage return
    b"0\r0",
]
# Values that are not an optionally negative decimal integer in int64.
BAD_DENSE = [
    b'"5"',
    b"5\x00",
    b"\x00",
    b"\xff\xfe",
    b"\xc3",  # a truncated two-byte UTF-8 sequence
    b"0x1f",  # hex is not decimal (pyarrow's int64 reader takes it)
    b"0X1F",
    b"1e3",
    b"5.0",
    b"--1",
    b"1-",
    b"9223372036854775808",  # 2**63: out of int64
    b"\r5",
    b"5\r",
    b"1\r2",
]
# Values that are not 1-8 hex digits.
BAD_CATS = [
    b'"68fd1e64"',
    b"68fd1e6\x00",
    b"\x00",
    b"\xff",
    b"\xe9",  # Latin-1 e-acute, invalid UTF-8
    b"g",
    b"0x1f",
    b"123456789",  # 9 digits
    b" 1f",
    b"-1",
    b"\r1f",
    b"1f\r",  # (not in C26: a final "\r" there is a CRLF line end)
    b"1\r2",
]


@dataclass
class Row:
    """One line's chosen values (the expectation) and its text."""

    label: int
    dense: list[int]  # raw integers, 0 where missing
    cats: list[int]  # raw 32-bit values, 0 where missing
    fields: list[bytes]


def good_row(rng: random.Random) -> Row:
    label = rng.randint(0, 1)
    fields = [str(label).encode()]
    dense = []
    for _ in DENSE:
        if rng.random() < 0.2:
            dense.append(0)
            fields.append(b"")
            continue
        x = rng.choice([rng.randint(-3, 20), rng.randint(-(2**62), 2**62), 2**63 - 1])
        dense.append(x)
        fields.append(str(x).encode())
    cats = []
    for _ in CATS:
        if rng.random() < 0.2:
            cats.append(0)
            fields.append(b"")
            continue
        x = rng.getrandbits(32) >> rng.choice([0, 0, 0, 12, 28])
        cats.append(x)
        text = rng.choice([f"{x:08x}", f"{x:08X}", f"{x:x}"])
        fields.append(text.encode())
    return Row(label, dense, cats, fields)


def break_value(rng: random.Random, row: Row, field: str, bad: bytes) -> bytes:
    """The line with ``field``'s value replaced by ``bad``."""
    fields = list(row.fields)
    fields[NAMES.index(field)] = bad
    return b"\t".join(fields)


def break_structure(rng: random.Random, row: Row, how: str) -> bytes:
    """A line whose tab structure is wrong (so the error names ``fields``)."""
    text = b"\t".join(row.fields)
    tabs = [i for i, c in enumerate(text) if c == 9]
    i = rng.choice(tabs)
    if how == "drop_tab":
        return text[:i] + text[i + 1 :]
    if how == "extra_tab":
        return text[:i] + b"\t\t" + text[i + 1 :]
    if how == "nul_for_tab":
        return text[:i] + b"\x00" + text[i + 1 :]
    if how == "cr_for_tab":
        return text[:i] + b"\r" + text[i + 1 :]
    if how == "truncated":
        return text[:i]
    if how == "empty":
        return b""
    if how == "cr_only":
        return b"\r"
    raise AssertionError(how)


STRUCTURE = ["drop_tab", "extra_tab", "nul_for_tab", "cr_for_tab", "truncated", "empty", "cr_only"]


def bad_line(rng: random.Random, kind: str, bad: bytes | str) -> tuple[bytes, str]:
    """``(line, broken field)`` for one breaker of ``kind``."""
    row = good_row(rng)
    if kind == "structure":
        assert isinstance(bad, str)
        return break_structure(rng, row, bad), FIELDS
    assert isinstance(bad, bytes)
    names = {"label": [LABEL], "dense": DENSE, "cat": CATS}[kind]
    if bad.endswith(b"\r") and not bad.endswith(b"\r\r"):
        names = [n for n in names if n != CATS[-1]]
    field = rng.choice(names)
    return break_value(rng, row, field, bad), field


CASES = (
    [("label", b) for b in BAD_LABELS]
    + [("dense", b) for b in BAD_DENSE]
    + [("cat", b) for b in BAD_CATS]
    + [("structure", s) for s in STRUCTURE]
)


def expected_arrays(rows: list[Row]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    labels = np.array([r.label for r in rows], dtype=np.float32)
    # The reader keeps dense values raw (float32); the transform comes at read time.
    dense = np.array([r.dense for r in rows], dtype=np.int64).reshape(-1, 13).astype(np.float32)
    cats = np.array([r.cats for r in rows], dtype=np.uint32).reshape(-1, 26)
    return labels, dense, cats


def assert_rows(block, rows: list[Row]) -> None:
    labels, dense, cats = expected_arrays(rows)
    np.testing.assert_array_equal(block.labels, labels)
    np.testing.assert_array_equal(block.dense, dense)
    np.testing.assert_array_equal(block.sparse, cats)


@pytest.mark.parametrize(("kind", "bad"), CASES, ids=lambda v: repr(v)[:24])
def test_one_broken_field_is_named_by_file_line_and_field(tmp_path, kind, bad) -> None:
    """One bad line among good ones, in a block of its own: the fast path must reject it
    too (it took ``0x1f`` as 31 before), and the error names line 3 and the field."""
    rng = random.Random(repr((kind, bad)))
    good = [good_row(rng) for _ in range(3)]
    text, field = bad_line(rng, kind, bad)
    lines = [b"\t".join(good[0].fields), b"\t".join(good[1].fields), text]
    lines.append(b"\t".join(good[2].fields))
    p = tmp_path / "fuzz.tsv"
    p.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as info:
        read_criteo([p])
    err = info.value
    assert (err.path, err.line, err.field, err.reason) == (str(p), 3, field, REASON[field])
    message = str(err)
    assert message.startswith(f"{p}, line 3, field {field}: ")
    assert "\n" not in message
    assert "\r" not in message  # raw bytes are shown escaped (repr), never as-is
    block, summary = read_criteo([p], on_bad_line="skip")
    assert_rows(block, good)
    assert dict(summary.counts) == {REASON[field].value: 1}


def random_file(seed: int) -> tuple[list[bytes], list[Row], list[tuple[int, str]]]:
    """Lines, the good rows in order and ``(line number, field)`` of each bad line."""
    rng = random.Random(seed)
    lines: list[bytes] = []
    good: list[Row] = []
    bad: list[tuple[int, str]] = []
    for lineno in range(1, rng.randint(1, 40) + 1):
        if rng.random() < 0.2:
            kind, breaker = rng.choice(CASES)
            text, field = bad_line(rng, kind, breaker)
            lines.append(text)
            bad.append((lineno, field))
        else:
            row = good_row(rng)
            lines.append(b"\t".join(row.fields))
            good.append(row)
    return lines, good, bad


@pytest.mark.parametrize("seed", range(24))
def test_random_files_error_on_the_first_bad_line_or_skip_and_count(
    tmp_path, monkeypatch, seed
) -> None:
    """Blocks of a few lines mix bad and good lines, plain and gzip, LF and CRLF, with or
    without a final newline: the first bad line is the error, and skipping keeps exactly
    the good rows with their values. A line number counted by pyarrow (which also ends
    lines at a lone "\\r") instead of by "\\n" fails here."""
    monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", 600)  # 2-3 lines per block
    rng = random.Random(1000 + seed)
    lines, good, bad = random_file(seed)
    end = rng.choice([b"\n", b"\r\n"])
    data = end.join(lines) + (end if rng.random() < 0.8 or not lines[-1] else b"")
    gz = rng.random() < 0.5
    p = tmp_path / ("fuzz.tsv.gz" if gz else "fuzz.tsv")
    p.write_bytes(gzip.compress(data) if gz else data)
    if bad:
        with pytest.raises(DataError) as info:
            read_criteo([p])
        assert (info.value.path, info.value.line, info.value.field) == (str(p), *bad[0])
    else:
        block, _ = read_criteo([p])
        assert_rows(block, good)
    if not good:
        return
    block, summary = read_criteo([p], on_bad_line="skip")
    assert_rows(block, good)
    counts: dict[str, int] = {}
    for _, field in bad:
        counts[REASON[field].value] = counts.get(REASON[field].value, 0) + 1
    assert dict(summary.counts) == counts
    # The kept examples name every skipped line by its own number, also after a block
    # holding a stray "\r" (a line count that split there too would drift).
    where = [f"{p}, line {n}, field {field}: " for n, field in bad[: len(summary.examples)]]
    assert [e[: len(w)] for e, w in zip(summary.examples, where, strict=True)] == where


def test_quote_spanning_a_newline_is_not_a_quoted_field(tmp_path) -> None:
    """Criteo has no quoting: a quote opened in C25 and closed on the next line leaves two
    bad lines (C25 of line 1, the label of line 2), not one merged row."""
    rng = random.Random(7)
    a, b, c = good_row(rng), good_row(rng), good_row(rng)
    a.fields[NAMES.index("C25")] = b'"' + a.fields[NAMES.index("C25")]
    b.fields[0] = b.fields[0] + b'"'
    p = tmp_path / "quoted.tsv"
    p.write_bytes(b"\n".join(b"\t".join(r.fields) for r in (a, b, c)) + b"\n")
    with pytest.raises(DataError) as info:
        read_criteo([p])
    assert (info.value.line, info.value.field) == (1, "C25")
    block, summary = read_criteo([p], on_bad_line="skip")
    assert_rows(block, [c])
    assert summary.skipped == 2


def _gzip_lines(n: int) -> tuple[bytes, list[Row]]:
    rng = random.Random(n)
    rows = [good_row(rng) for _ in range(n)]
    return gzip.compress(b"".join(b"\t".join(r.fields) + b"\n" for r in rows), mtime=0), rows


def _corrupt(gz: bytes, how: str) -> bytes:
    if how == "header_only":
        return gz[:10]
    if how == "cut_in_half":
        return gz[: len(gz) // 2]
    if how == "no_trailer":
        return gz[:-8]
    if how == "bad_crc":
        return gz[:-8] + bytes([gz[-8] ^ 0xFF]) + gz[-7:]
    if how == "bad_length":
        return gz[:-1] + bytes([gz[-1] ^ 0x01])
    if how == "garbage_body":
        mid = len(gz) // 2
        return gz[:mid] + b"\xff" * 64 + gz[mid + 64 :]
    if how == "trailing_junk":
        return gz + b"junk after the gzip member"
    if how == "bad_second_member":
        return gz + b"\x1f\x8b\x08\x00" + b"\x00" * 20
    if how == "bad_method":
        return gz[:2] + b"\x07" + gz[3:]
    if how == "bad_magic":
        return b"\x1f\x8c" + gz[2:]
    raise AssertionError(how)


GZ_CORRUPTIONS = [
    "header_only",
    "cut_in_half",
    "no_trailer",
    "bad_crc",
    "bad_length",
    "garbage_body",
    "trailing_junk",
    "bad_second_member",
    "bad_method",
    "bad_magic",
]


@pytest.mark.parametrize("how", GZ_CORRUPTIONS)
def test_corrupted_gzip_is_a_data_error_naming_the_file(tmp_path, how) -> None:
    """A damaged .gz is a one-line ``DataError`` naming the file, also under
    ``on_bad_line="skip"`` (damage is not a bad line to skip). A ``.gz`` whose magic bytes
    are damaged used to be read as plain text and reported as a line with the wrong
    number of fields."""
    gz, _ = _gzip_lines(300)
    p = tmp_path / "day_0.tsv.gz"
    p.write_bytes(_corrupt(gz, how))
    for policy in ("error", "skip"):
        with pytest.raises(DataError) as info:
            read_criteo([p], on_bad_line=policy)
        err = info.value
        assert err.path == str(p)
        assert (err.line, err.field, err.reason) == (None, None, None)
        assert str(err).startswith(f"{p}: ")
        assert "gzip" in str(err)
        assert "\n" not in str(err)


def test_gzip_damage_late_in_a_big_file_keeps_the_blocks_before_it(tmp_path, monkeypatch) -> None:
    """Blocks decoded before the damage are yielded, in order and intact; the damage
    itself is the error (never a silent end of data)."""
    monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", 4096)
    gz, rows = _gzip_lines(600)
    p = tmp_path / "late.gz"
    p.write_bytes(gz[:-8])  # the CRC and length are missing: all rows decode, then error
    seen = []
    blocks = criteo_mod.iter_criteo_blocks(p)
    with pytest.raises(DataError, match="corrupt or truncated gzip"):
        seen.extend(blocks)
    assert seen
    got = np.concatenate([b.sparse for b in seen])
    _, _, cats = expected_arrays(rows[: len(got)])
    np.testing.assert_array_equal(got, cats)


def test_plain_text_named_gz_is_still_an_error_not_a_guess(tmp_path) -> None:
    """A file named .gz that is not gzip is reported as such (the suffix and the content
    disagree), not parsed as text."""
    rng = random.Random(3)
    p = tmp_path / "plain.gz"
    p.write_bytes(b"\t".join(good_row(rng).fields) + b"\n")
    with pytest.raises(DataError, match=r"plain\.gz: .*not gzip"):
        read_criteo([p])


def test_byte_order_mark_on_line_one_is_a_bad_label_like_anywhere_else(tmp_path) -> None:
    """pyarrow drops a UTF-8 byte-order mark at the start of its input, so a BOM opening a
    block (line 1 here) was accepted while the same bytes on line 3 were an error."""
    rng = random.Random(11)
    rows = [good_row(rng) for _ in range(3)]
    p = tmp_path / "bom.tsv"
    p.write_bytes(b"\xef\xbb\xbf" + b"\n".join(b"\t".join(r.fields) for r in rows) + b"\n")
    with pytest.raises(DataError) as info:
        read_criteo([p])
    assert (info.value.line, info.value.field) == (1, "label")
    block, _ = read_criteo([p], on_bad_line="skip")
    assert_rows(block, rows[1:])
