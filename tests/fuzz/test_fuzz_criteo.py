"""Generated Criteo TSV files: exact rows, or the first bad line named, block by block.

tests/unit/data/test_data_criteo_fuzz.py breaks one chosen field at a time; here
Hypothesis damages whole lines at random (bytes inserted, replaced, cut; quotes, NUL,
carriage returns, tabs, invalid UTF-8) and the oracle is each line read alone: the whole
file, read in one block or in blocks of a few lines, plain or gzip, gives exactly the
rows of the lines that read alone, skips (and counts) the others, and with
``on_bad_line="error"`` names the first of them. Good lines, written from chosen values,
read back as those values. Nothing but ``DataError`` escapes, on any bytes.
"""

from __future__ import annotations

import gzip

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tetrarec.data import DataError, read_criteo
from tetrarec.data import criteo as criteo_mod

FUZZ = settings.get_profile("tetrarec-fuzz")


@st.composite
def good_row(draw: st.DrawFn) -> tuple[list[bytes], tuple[int, list[int], list[int]]]:
    """``(fields, (label, dense, sparse))``: 40 fields and the values they must read as."""
    label = draw(st.sampled_from([0, 1]))
    dense = draw(st.lists(st.none() | st.integers(-(2**63), 2**63 - 1), min_size=13, max_size=13))
    cats = draw(st.lists(st.none() | st.integers(0, 2**32 - 1), min_size=26, max_size=26))
    case = draw(st.sampled_from(["{:08x}", "{:08X}", "{:x}"]))
    fields = [str(label).encode()]
    fields += [b"" if v is None else str(v).encode() for v in dense]
    fields += [b"" if v is None else case.format(v).encode() for v in cats]
    return fields, (label, [v or 0 for v in dense], [v or 0 for v in cats])


NASTY = [b'"', b"\r", b"\x00", b"\t", b"\xff", b"0x1f", b" ", b"-", b"123456789", b"\xef\xbb\xbf"]


@st.composite
def damaged_line(draw: st.DrawFn) -> bytes:
    fields, _ = draw(good_row())
    good = b"\t".join(fields)
    kind = draw(st.sampled_from(["good", "insert", "replace", "cut", "bytes"]))
    if kind == "good":
        return good
    if kind == "bytes":
        return draw(st.binary(max_size=60)).replace(b"\n", b"")
    at = draw(st.integers(0, len(good)))
    if kind == "cut":
        return good[:at]
    bad = draw(st.sampled_from(NASTY))
    return good[:at] + bad + (good[at + 1 :] if kind == "replace" else good[at:])


def read_or_error(path, **kw):
    try:
        return read_criteo([path], **kw)
    except DataError as e:
        error = e
    assert "\n" not in str(error)
    assert str(error).startswith(str(path))
    return error


@FUZZ
@given(rows=st.lists(good_row(), min_size=1, max_size=20), crlf=st.booleans(), gz=st.booleans())
def test_written_rows_read_back_exactly(tmp_path, monkeypatch, rows, crlf, gz) -> None:
    """Values at the edges of int64 and uint32, upper- and lower-case hex, empty fields:
    each line reads as the values it was written from, in blocks of a few lines too (a
    dense value through float64 instead of int64, a short hex value misaligned, a CRLF
    kept in C26 fails here)."""
    monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", 512)
    end = b"\r\n" if crlf else b"\n"
    raw = b"".join(b"\t".join(f) + end for f, _ in rows)
    p = tmp_path / ("f.tsv.gz" if gz else "f.tsv")
    p.write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    block, summary = read_criteo([p])
    assert summary.skipped == 0
    np.testing.assert_array_equal(block.labels, [v[0] for _, v in rows])
    dense = np.array([v[1] for _, v in rows], np.int64).astype(np.float32)
    np.testing.assert_array_equal(block.dense, dense)
    np.testing.assert_array_equal(block.sparse, np.array([v[2] for _, v in rows], np.uint32))


@FUZZ
@given(lines=st.lists(damaged_line(), min_size=1, max_size=8), block=st.sampled_from([64, 700]))
def test_damaged_lines_are_skipped_or_named_as_when_read_alone(
    tmp_path, monkeypatch, lines, block
) -> None:
    """A line's fate (a row, or a bad line) never depends on its neighbours or on where a
    block ends: the whole file skips exactly the lines that fail alone and keeps the
    others' rows in order; ``"error"`` names the first of them by its line number."""
    # A file is gzip when it starts with gzip's magic bytes (documented): such a first
    # line makes the whole file damaged gzip, which the last test covers.
    assume(not lines[0].startswith(b"\x1f\x8b"))
    alone = []
    for i, text in enumerate(lines):
        p = tmp_path / f"line{i}.tsv"
        p.write_bytes(text + b"\n")
        alone.append(read_or_error(p))
    monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", block)
    p = tmp_path / "all.tsv"
    p.write_bytes(b"\n".join(lines) + b"\n")
    bad_at = [i + 1 for i, a in enumerate(alone) if isinstance(a, DataError)]
    first = read_or_error(p)
    if bad_at:
        assert isinstance(first, DataError)
        assert first.line == bad_at[0]
        assert first.reason == alone[bad_at[0] - 1].reason
    else:
        assert not isinstance(first, DataError)
    got, summary = read_or_error(p, on_bad_line="skip")
    good = [a[0] for a in alone if not isinstance(a, DataError)]
    assert summary.skipped == len(bad_at)
    assert got.rows == len(good)
    if good:
        np.testing.assert_array_equal(got.labels, np.concatenate([g.labels for g in good]))
        np.testing.assert_array_equal(got.dense, np.concatenate([g.dense for g in good]))
        np.testing.assert_array_equal(got.sparse, np.concatenate([g.sparse for g in good]))


@FUZZ
@given(raw=st.binary(max_size=300), gz=st.booleans(), labels=st.booleans())
def test_arbitrary_bytes_read_or_fail_with_a_data_error(tmp_path, raw, gz, labels) -> None:
    """Any bytes, plain or gzip, labeled or scoring layout: rows (never more than the
    file's lines, labels 0/1) or a one-line ``DataError``; no pyarrow, zlib or numpy
    traceback."""
    p = tmp_path / ("f.tsv.gz" if gz else "f.tsv")
    p.write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    for policy in ("error", "skip"):
        got = read_or_error(p, on_bad_line=policy, require_labels=labels)
        if isinstance(got, DataError):
            continue
        block, summary = got
        lines = raw.count(b"\n") + (not raw.endswith(b"\n"))
        assert block.rows + summary.skipped <= lines
        if block.labeled:
            assert set(block.labels.tolist()) <= {0.0, 1.0}
