import gzip
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tetrarec.data import (
    BadLineReason,
    DataError,
    DataFileNotFoundError,
    dense_transform,
    hash_ids,
    iter_criteo_blocks,
    read_criteo,
)
from tetrarec.data import criteo as criteo_mod

REPO = Path(__file__).resolve().parents[3]
KAGGLE = REPO.parent / "shared/data/criteo-kaggle-dac-sample/criteo_kaggle_dac_sample.tsv.gz"
TB = REPO.parent / "shared/data/criteo-1tb-sample/criteo_1tb_sample_1000.tsv.gz"


def line(label="0", dense=None, cats=None) -> str:
    dense = [str(i) for i in range(13)] if dense is None else dense
    cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
    return "\t".join([label, *dense, *cats])


def write(path: Path, lines: list[str], *, gz: bool = False, end: str = "\n") -> Path:
    data = (end.join(lines) + end).encode()
    if gz:
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def fmix64(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & m
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & m
    return x ^ (x >> 33)


def test_hash_ids_is_fmix64_mod_rows():
    raw = np.array([0, 1, 2, 0x68FD1E64, 0xFFFFFFFF, 123456789], dtype=np.uint32)
    for rows in (1, 7, 1000, 2**31 - 1):
        expected = [fmix64(int(x)) % rows for x in raw]
        assert hash_ids(raw, rows).tolist() == expected
    # Fixed forever: changing the hash would remap every trained row.
    assert hash_ids(np.array([0, 1, 0x68FD1E64]), 1000).tolist() == [0, 604, 12]


def test_hash_ids_broadcasts_row_counts_and_handles_negatives():
    raw = np.array([[5, 5], [-1, 3]])
    out = hash_ids(raw, np.array([10, 1000]))
    assert out.tolist() == [
        [fmix64(5) % 10, fmix64(5) % 1000],
        [fmix64(2**64 - 1) % 10, fmix64(3) % 1000],
    ]
    with pytest.raises(ValueError, match="num_rows"):
        hash_ids(raw, 0)


def test_dense_transform():
    out = dense_transform(np.array([-5, -1, 0, 1, 2, 10**12]))
    expected = [0, 0, 0, math.log(2), math.log(3), math.log1p(10**12)]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out.dtype == np.float32


def test_parse_exact_values_and_missing(tmp_path):
    dense = ["", "-3", "0", "7", "", "", "", "", "", "", "", "", "99"]
    cats = ["68fd1e64", "", "FFFFFFFF", "0000000a"] + [""] * 22
    p = write(tmp_path / "a.tsv", [line("1", dense, cats), line("0")])
    block, summary = read_criteo([p])
    assert block.rows == 2
    assert block.labels.tolist() == [1.0, 0.0]
    # raw values (missing -> 0); the log1p transform is applied at read time
    assert block.dense.dtype == np.float32
    assert block.dense[0].tolist() == [0, -3, 0, 7] + [0] * 8 + [99]
    assert block.dense[1].tolist() == list(range(13))
    assert block.sparse[0, :4].tolist() == [0x68FD1E64, 0, 0xFFFFFFFF, 10]
    assert block.sparse[0, 4:].tolist() == [0] * 22
    assert block.sparse[1].tolist() == list(range(26))
    assert block.sparse.dtype == np.uint32
    assert summary.skipped == 0


def test_gzip_equals_plain_and_crlf_and_no_final_newline(tmp_path):
    lines = [line(str(i % 2), cats=[f"{i * 7919 + j:08x}" for j in range(26)]) for i in range(50)]
    plain, _ = read_criteo([write(tmp_path / "a.tsv", lines)])
    gz, _ = read_criteo([write(tmp_path / "a.tsv.gz", lines, gz=True)])
    crlf, _ = read_criteo([write(tmp_path / "b.tsv", lines, end="\r\n")])
    (tmp_path / "c.tsv").write_bytes("\n".join(lines).encode())  # no final newline
    nofinal, _ = read_criteo([tmp_path / "c.tsv"])
    for other in (gz, crlf, nofinal):
        assert np.array_equal(other.sparse, plain.sparse)
        assert np.array_equal(other.dense, plain.dense)
        assert np.array_equal(other.labels, plain.labels)


@pytest.mark.parametrize(
    ("bad", "field", "reason"),
    [
        ("\t".join(line().split("\t")[:39]), "fields", BadLineReason.FIELD_COUNT),
        (line() + "\textra", "fields", BadLineReason.FIELD_COUNT),
        ("", "fields", BadLineReason.FIELD_COUNT),
        (line(dense=["1"] * 5 + ["1.5"] + ["1"] * 7), "I6", BadLineReason.DENSE_NOT_INTEGER),
        (line(dense=["x"] + ["1"] * 12), "I1", BadLineReason.DENSE_NOT_INTEGER),
        (line(dense=["1"] * 12 + ["99999999999999999999"]), "I13", BadLineReason.DENSE_NOT_INTEGER),
        (line(cats=["0"] * 25 + ["zz"]), "C26", BadLineReason.CATEGORICAL_NOT_HEX),
        (line(cats=["123456789"] + ["0"] * 25), "C1", BadLineReason.CATEGORICAL_NOT_HEX),
        (line(label="2"), "label", BadLineReason.LABEL_NOT_BINARY),
        (line(label=""), "label", BadLineReason.LABEL_NOT_BINARY),
    ],
)
def test_bad_line_names_file_line_field_or_is_counted(tmp_path, bad, field, reason):
    p = write(tmp_path / "bad.tsv", [line(), line(), bad, line()])
    with pytest.raises(DataError) as info:
        read_criteo([p])
    err = info.value
    assert (err.path, err.line, err.field, err.reason) == (str(p), 3, field, reason)
    assert f"{p}, line 3, field {field}" in str(err)
    block, summary = read_criteo([p], on_bad_line="skip")
    assert block.rows == 3
    assert dict(summary.counts) == {reason.value: 1}
    assert summary.skipped == 1
    assert "skipped 1 bad lines" in summary.summary()
    assert "line 3" in summary.examples[0]


def test_a_hex_id_over_8_digits_is_named_as_such(tmp_path):
    """A 9-digit id is hex, just too long for Criteo's 32-bit ids: the message says so
    (it read "not hex (got b'123456789')"), and "zz" keeps the plain message."""
    p = write(tmp_path / "bad.tsv", [line(cats=["123456789"] + ["0"] * 25)])
    with pytest.raises(DataError, match=r"\(got b'123456789': hex, but over 8 digits"):
        read_criteo([p])
    p = write(tmp_path / "zz.tsv", [line(cats=["zz"] + ["0"] * 25)])
    with pytest.raises(DataError, match=r"categorical value is not hex \(got b'zz'\)$"):
        read_criteo([p])


def test_line_numbers_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", 1000)  # about 4 lines per block
    lines = [line() for _ in range(40)]
    lines[36] = line(label="7")
    lines[21] = line(cats=["g"] * 26)
    p = write(tmp_path / "many.tsv.gz", lines, gz=True)
    with pytest.raises(DataError, match=r"line 22, field C1"):
        read_criteo([p])
    blocks = list(iter_criteo_blocks(p, on_bad_line="skip"))
    assert len(blocks) > 5
    assert sum(b.rows for b in blocks) == 38


def test_missing_empty_truncated_and_directory(tmp_path):
    with pytest.raises(DataFileNotFoundError, match=r"nope\.tsv"):
        read_criteo([tmp_path / "nope.tsv"])
    (tmp_path / "empty.tsv").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.tsv: the file is empty"):
        read_criteo([tmp_path / "empty.tsv"])
    (tmp_path / "empty.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(DataError, match="empty"):
        read_criteo([tmp_path / "empty.gz"])
    full = gzip.compress(("\n".join(line() for _ in range(2000)) + "\n").encode())
    (tmp_path / "cut.gz").write_bytes(full[: len(full) // 2])
    with pytest.raises(DataError, match=r"cut\.gz: corrupt or truncated gzip"):
        read_criteo([tmp_path / "cut.gz"])
    with pytest.raises(DataError, match="directory"):
        read_criteo([tmp_path])


# Fuzzed input (quotes, NUL bytes, invalid UTF-8, stray carriage returns, damaged gzip)
# is in test_data_criteo_fuzz.py, with an oracle that builds each line instead of
# parsing it.


# -- the real samples --------------------------------------------------------------------


@pytest.mark.skipif(not KAGGLE.exists(), reason="shared Criteo sample not present")
def test_real_kaggle_sample():
    block, summary = read_criteo([KAGGLE])
    assert block.rows == 12868
    assert int(block.labels.sum()) == 3032  # PROVENANCE.md
    assert summary.skipped == 0
    with gzip.open(KAGGLE, "rt") as f:
        first = f.readline().rstrip("\n").split("\t")
    assert len(first) == 40
    assert block.labels[0] == int(first[0])
    assert block.sparse[0].tolist() == [int(c, 16) if c else 0 for c in first[14:]]
    raw_dense = np.array([int(d) if d else 0 for d in first[1:14]])
    np.testing.assert_array_equal(block.dense[0], raw_dense.astype(np.float32))


@pytest.mark.skipif(not TB.exists(), reason="shared Criteo 1TB sample not present")
def test_real_1tb_sample():
    block, _ = read_criteo([TB])
    assert block.rows == 1000
    assert int(block.labels.sum()) == 21


# -- found by mutation testing (mutation/README.md, the Criteo slice) ---------------------


def _good_block(cats_per_line: list[list[str]]) -> tuple[bytes, list[list[int]]]:
    """Lines with labels 1, 0, 1, ..., dense ``-i .. 12 - i`` and the given categoricals."""
    lines = []
    for i, cats in enumerate(cats_per_line):
        dense = [str(j - i) if (i + j) % 5 else "" for j in range(13)]
        lines.append(line(str((i + 1) % 2), dense, cats))
    expected = [[int(c, 16) if c else 0 for c in cats] for cats in cats_per_line]
    return ("\n".join(lines) + "\n").encode(), expected


@pytest.mark.parametrize(
    "cats_per_line",
    [
        # 8 digits or empty (the (m, 8) view), upper and lower case
        [
            [f"{i * 2654435761 + j:08x}"[-8:] if (i + j) % 3 else "" for j in range(26)]
            for i in range(6)
        ]
        + [["ABCDEF01"] * 26],
        # 1-8 digits (the ragged gather), with 8-digit values among them
        [
            [f"{(i + 1) * (j + 1) * 2654435761 % 2**32:08x}"[(i + j) % 8 :] for j in range(26)]
            for i in range(6)
        ],
        # a single line: a one-byte label column
        [["a"] + ["00000001"] * 25],
    ],
)
def test_fast_path_accepts_good_lines_and_decodes_them_exactly(cats_per_line):
    # The vectorized parser must take every good block itself: a spurious rejection gives
    # the same rows through the line-by-line parser, only many times slower.
    block, expected = _good_block(cats_per_line)
    out = criteo_mod._parse_fast(block)
    n = len(cats_per_line)
    assert out.labels.dtype == np.float32  # documented: (n,) float32
    assert out.labels.tolist() == [float((i + 1) % 2) for i in range(n)]
    assert out.sparse.tolist() == expected
    dense = [[j - i if (i + j) % 5 else 0 for j in range(13)] for i in range(n)]
    assert out.dense.tolist() == dense


def test_line_by_line_path_gives_the_documented_types_and_shapes(tmp_path):
    p = write(tmp_path / "a.tsv", [line("1"), line("x"), line("0")])
    block, summary = read_criteo([p], on_bad_line="skip")
    # the documented CriteoBlock types and shapes, whichever parser made the block
    assert (block.labels.dtype, block.dense.dtype, block.sparse.dtype) == (
        np.float32,
        np.float32,
        np.uint32,
    )
    assert (block.labels.shape, block.dense.shape, block.sparse.shape) == ((2,), (2, 13), (2, 26))
    assert block.labels.tolist() == [1.0, 0.0]
    assert summary.rows_read == 2


def test_binary_parts_of_a_sliced_array_start_at_its_offset():
    arr = pa.array([b"ab", b"cde", b"", b"f", b"ghij"], pa.binary()).slice(1, 3)
    offsets, data = criteo_mod._binary_parts(arr)
    assert offsets.tolist() == [2, 5, 5, 6]
    assert bytes(data[offsets[0] : offsets[-1]]) == b"cdef"


def test_lines_longer_than_a_read_are_whole_and_never_empty_blocks(tmp_path, monkeypatch):
    # Each line (~300 bytes) spans several 64-byte reads: a read with no newline must be
    # carried into the next, never yielded as an empty block nor taken as the end.
    monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", 64)
    lines = [line(str(i % 2)) for i in range(5)]
    p = write(tmp_path / "long.tsv", lines)
    blocks = list(iter_criteo_blocks(p))
    assert [b.rows for b in blocks] == [1] * 5
    assert [b.labels[0] for b in blocks] == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("gz", [False, True])
def test_on_bytes_reports_every_byte_on_disk_once(tmp_path, monkeypatch, gz):
    monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", 500)
    p = write(tmp_path / ("a.tsv.gz" if gz else "a.tsv"), [line() for _ in range(30)], gz=gz)
    seen: list[int] = []
    rows = sum(b.rows for b in iter_criteo_blocks(p, on_bytes=seen.append))
    assert rows == 30
    assert len(seen) > 1
    assert all(n >= 0 for n in seen)
    assert sum(seen) == p.stat().st_size


def test_error_messages_name_the_path_and_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"^read_criteo needs at least one file$"):
        read_criteo([])
    with pytest.raises(DataError) as info:
        read_criteo([tmp_path])
    assert info.value.path == str(tmp_path)
    assert str(info.value).endswith(": expected a file, got a directory")
    (tmp_path / "meta.json").write_text("{}")  # what preprocess writes: say how to read it
    with pytest.raises(
        DataError,
        match=r"got a directory \(a `tetrarec preprocess criteo` "
        r'output: read it with data.source = "binary"\)',
    ):
        read_criteo([tmp_path])
    (tmp_path / "meta.json").unlink()
    (tmp_path / "a.gz").write_bytes(b"0\t1\n")
    with pytest.raises(DataError) as info:
        read_criteo([tmp_path / "a.gz"])
    assert str(info.value).endswith(
        "named .gz but not gzip data: it starts with b'0\\t', not the gzip magic "
        "bytes b'\\x1f\\x8b' (a damaged file, or plain text to be renamed)"
    )


@pytest.mark.parametrize(
    ("bad", "detail"),
    [
        ("\t".join(line().split("\t")[:39]), "(expected 40 tab-separated fields, got 39)"),
        (line(label="2" * 25), "(got b'" + "2" * 20 + "')"),
        (
            line(dense=["1"] * 12 + ["5" * 20 + "." + "5" * 19]),
            "(got b'" + "5" * 20 + ".555555555')",
        ),
        (line(cats=["0"] * 25 + ["g" * 40]), "(got b'" + "g" * 30 + "')"),
    ],
)
def test_bad_line_message_gives_the_detail(tmp_path, bad, detail):
    p = write(tmp_path / "bad.tsv", [line(), bad])
    with pytest.raises(DataError) as info:
        read_criteo([p])
    assert str(info.value).endswith(detail)


def test_int64_extremes_are_kept_by_the_line_by_line_path_as_by_the_fast_path(tmp_path):
    # pyarrow reads -2**63 and 2**63-1 as int64; the strict parser (run for a block with a
    # bad line) must keep them too, or a row depends on which other lines share its block.
    extremes = ["-9223372036854775808", "9223372036854775807"] + ["0"] * 11
    good = write(tmp_path / "good.tsv", [line(dense=extremes)])
    mixed = write(tmp_path / "mixed.tsv", [line(dense=extremes), line(label="2")])
    fast, _ = read_criteo([good])
    slow, summary = read_criteo([mixed], on_bad_line="skip")
    assert summary.skipped == 1
    assert slow.dense.tolist() == fast.dense.tolist() == [[-(2.0**63), 2.0**63] + [0.0] * 11]
