"""The csv source: layouts, value rules, bad lines, and the shared Avazu sample.

Expected rows are computed here from the documented rules with a pure-Python
FNV-1a 64 and fmix64 (see test_data_string_hash.py), not with the library's hashes.
"""

import gzip
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tetrarec.data.csv_source as csv_source
from tetrarec.data import (
    BadLineReason,
    ColumnMapping,
    CsvConfig,
    CsvDataset,
    DataConfig,
    DataError,
    DataFileNotFoundError,
    build_datasets,
    read_csv,
)
from tetrarec.embedding import TableConfig

MASK = 2**64 - 1
REPO = Path(__file__).parents[3]
AVAZU = REPO.parent / "shared/data/avazu-sample/avazu_sample.csv.gz"

TABLES = [
    TableConfig(name="user", num_embeddings=100, dim=4),
    TableConfig(name="tags", num_embeddings=50, dim=4),
    TableConfig(name="codes", num_embeddings=1000, dim=4, feature_names=("city", "ids")),
]
MAPPING = ColumnMapping(
    label_column="label",
    dense_columns=("price", "qty"),
    sparse_columns=("user", "tags", "city", "ids"),
)
MULTI = CsvConfig(multi_hot_columns=("tags", "ids"))
NAMES = ("label", "price", "user", "tags", "city", "skip_me", "qty", "ids")
ROWS = [
    ["1", "2.5", "u1", "a|b", "7", "x", "3", "10|20"],
    ["0", "", "", "", "", "", "", ""],
    ["1", "-3", "u2", "b||", "07", "\u00e9", "1e2", "20"],
]


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h


def row_of(value: str, num_rows: int) -> int:
    """The documented row of a csv text value: fmix64(FNV-1a 64(bytes)) % rows; "" -> 0."""
    h = fnv1a64(value.encode()) if value else 0
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK
    return (h ^ (h >> 33)) % num_rows


def write(path: Path, rows, *, delimiter=",", header=True, gz=False, names=NAMES) -> Path:
    lines = ([delimiter.join(names)] if header else []) + [delimiter.join(r) for r in rows]
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def dataset(paths, csv=MULTI, **kw):
    return CsvDataset(paths, mapping=MAPPING, tables=TABLES, csv=csv, **kw)


def batch_tuple(ds):
    b = ds.read(np.arange(ds.num_samples))
    return b.dense, b.sparse.values, b.sparse.lengths, b.labels


def assert_same(a, b):
    for x, y in zip(batch_tuple(a), batch_tuple(b)):
        assert torch.equal(x, y)


def test_rows_match_the_documented_rules(tmp_path):
    """Catches wrong columns picked by name (an unused column sits in between), dense
    empty != 0, a text id hashed as an integer, a missing id not on row 0, empty
    multi-hot items kept, and bags misaligned with rows."""
    ds = dataset([write(tmp_path / "a.csv", ROWS)])
    assert (ds.num_samples, ds.num_dense, ds.keys) == (3, 2, ("user", "tags", "city", "ids"))
    assert ds.bad_lines.skipped == 0
    b = ds.read(np.array([2, 0, 1]))
    assert b.labels.tolist() == [1.0, 1.0, 0.0]
    assert b.dense.tolist() == [[-3.0, 100.0], [2.5, 3.0], [0.0, 0.0]]
    d = b.sparse.to_dict()
    assert d["user"][0].tolist() == [row_of("u2", 100), row_of("u1", 100), 0]
    assert d["user"][1].tolist() == [1, 1, 1]
    assert d["tags"][0].tolist() == [row_of(v, 50) for v in ("b", "a", "b")]
    assert d["tags"][1].tolist() == [1, 2, 0]  # "b||" is one item; "" is an empty bag
    assert d["city"][0].tolist() == [row_of("07", 1000), row_of("7", 1000), 0]
    assert row_of("07", 1000) != row_of("7", 1000)  # text, not the integer 7
    assert d["ids"][0].tolist() == [row_of(v, 1000) for v in ("20", "10", "20")]
    assert d["ids"][1].tolist() == [1, 2, 0]


@pytest.mark.parametrize(
    ("delimiter", "header", "gz"),
    [("\t", True, False), (";", False, False), (",", True, True), ("|", False, True)],
)
def test_layouts_read_the_same_rows(tmp_path, delimiter, header, gz):
    """Tab, semicolon, pipe; header line or declared names; plain or gzip: the same rows
    as the plain comma file (catches a delimiter or header setting ignored, gzip not
    detected by its magic bytes)."""
    rows = [[v.replace("|", "/") for v in r] for r in ROWS]  # "|" may be the delimiter
    multi = CsvConfig(multi_hot_columns=("tags", "ids"), multi_hot_separator="/")
    reference = dataset([write(tmp_path / "ref.csv", rows)], csv=multi)
    csv = CsvConfig(
        delimiter=delimiter,
        header=header,
        column_names=() if header else NAMES,
        multi_hot_columns=("tags", "ids"),
        multi_hot_separator="/",
    )
    path = write(tmp_path / "data.txt", rows, delimiter=delimiter, header=header, gz=gz)
    assert_same(dataset([path], csv=csv), reference)


def test_quoted_fields_crlf_bom_and_no_final_newline(tmp_path):
    """A quoted field holding the delimiter is one value; CRLF line ends, a UTF-8 BOM
    before the header and a missing final newline change nothing (catches a header
    named '\\ufefflabel', a "\\r" kept in the last value, a lost last row)."""
    ref_rows = [*ROWS, ["1", "1", '"p,q"', "", "", "", "", ""]]
    ref = dataset([write(tmp_path / "ref.csv", ref_rows)])
    text = "\r\n".join([",".join(NAMES), *(",".join(r) for r in ROWS), '1,1,"p,q",,,,,'])
    path = tmp_path / "q.csv"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    ds = dataset([path])
    assert_same(ds, ref)
    assert ds.read(np.array([3])).sparse.to_dict()["user"][0].tolist() == [row_of("p,q", 100)]
    headerless = tmp_path / "n.csv"  # the BOM is before the first row's label here
    headerless.write_bytes(b"\xef\xbb\xbf" + "\n".join(",".join(r) for r in ROWS).encode())
    csv = CsvConfig(header=False, column_names=NAMES, multi_hot_columns=("tags", "ids"))
    assert_same(dataset([headerless], csv=csv), dataset([write(tmp_path / "r.csv", ROWS)]))


def test_an_open_quote_ends_with_its_line(tmp_path):
    """A quote left open swallows the newline in pyarrow; the reader must still give one
    row per line, the quote closed at the line end, wherever the line sits (catches the
    next line merged into the value, or the last line of a block read differently)."""
    rows = [*ROWS, ROWS[0]]
    ref = dataset([write(tmp_path / "ref.csv", rows)])
    opened = [[*r[:-1], '"' + r[-1]] if i in (0, 3) else r for i, r in enumerate(rows)]
    assert_same(dataset([write(tmp_path / "open.csv", opened)]), ref)


def count_reads(monkeypatch) -> list[int]:
    """A list that gets one item per pyarrow read of lines (``_FilePlan.read``)."""
    reads: list[int] = []
    real_read = csv_source._FilePlan.read
    monkeypatch.setattr(
        csv_source._FilePlan,
        "read",
        lambda self, *a, **k: reads.append(1) or real_read(self, *a, **k),
    )
    return reads


SMALL = ColumnMapping(label_column="y", dense_columns=("d",), sparse_columns=("s",))
SMALL_TABLES = [TableConfig(name="s", num_embeddings=1 << 20, dim=4)]


def small(path: Path, **kw) -> CsvDataset:
    """A file of ``y,d,s`` lines: label, dense value, text id."""
    return CsvDataset([path], mapping=SMALL, tables=SMALL_TABLES, csv=CsvConfig(), **kw)


def small_rows(ds: CsvDataset) -> list[tuple[float, float, int]]:
    b = ds.read(np.arange(ds.num_samples))
    ids = b.sparse.to_dict()["s"][0].tolist()
    return list(zip(b.labels.tolist(), b.dense[:, 0].tolist(), ids))


def test_an_open_quote_and_a_lone_carriage_return_in_one_block(tmp_path):
    """The tester's file: line 2 opens a quote, line 4 holds a lone "\r". pyarrow carried
    the quote over line 3 (one row fewer) and split line 4 in two (one row more): the
    count of rows matched the count of lines, and the run read the made-up rows
    ``(1, 2, "a\n0,3,b")``, ``(1, 4, c)``, ``(0, 5, e)`` with no error and nothing
    skipped. Line 2 is its own row, line 3 too, and line 4 is a bad line."""
    path = tmp_path / "q.csv"
    path.write_bytes(b'y,d,s\n1,2,"a\n0,3,b"\n1,4,c\r0,5,e\n')
    with pytest.raises(DataError, match=r"q\.csv, line 4, field fields: .*carriage return"):
        small(path)
    ds = small(path, on_bad_line="skip")
    assert ds.bad_lines.skipped == 1
    assert small_rows(ds) == [(1.0, 2.0, row_of("a", 1 << 20)), (0.0, 3.0, row_of('b"', 1 << 20))]


def test_open_quotes_are_read_with_the_block(tmp_path, monkeypatch):
    """Bug caught: with 1% of lines like ``1,2,"a`` (valid: the quote ends with its
    line) the block's rows were not its lines, and the reader fell back to splitting
    it down to single lines: 300,000 rows took 27 s instead of 0.1 s. Now one read of
    the block, with the same rows as the quotes closed by hand."""
    lines = [f'1,{i},"v{i}' if i % 100 == 7 else f"{i % 2},{i},v{i}" for i in range(3000)]
    path = tmp_path / "open.csv"
    path.write_text("\n".join(["y,d,s", *lines]) + "\n")
    closed = tmp_path / "closed.csv"
    closed.write_text("\n".join(["y,d,s", *(x + '"' if '"' in x else x for x in lines)]))
    reads = count_reads(monkeypatch)
    ds = small(path)
    assert len(reads) == 1
    assert small_rows(ds) == small_rows(small(closed))
    assert small_rows(ds)[7] == (1.0, 7.0, row_of("v7", 1 << 20))


def test_rows_are_each_line_read_alone_whatever_the_quotes(tmp_path, capfd):
    """Differential fuzz: files of 8 lines drawn from quotes left open, literal quotes,
    doubled quotes, a lone "\r" and bytes that are not UTF-8 give exactly the rows and
    bad lines of each line read from a file of its own. Catches rows that depend on
    the lines around them: a quote carried over a newline, with a count of rows that
    matched the count of lines by chance (22 of these 200 files read wrong rows
    silently), and pyarrow's traceback on stderr for a line not UTF-8 dragged into an
    open quote."""
    tails = [b'"a', b'b"', b"c\r0,5,e", b"z", b'"a""', b"\xff", b'q,"r', b'"x"y']
    alone: dict[bytes, tuple[list, int]] = {}

    def read_alone(line: bytes) -> tuple[list, int]:
        if line not in alone:
            one = tmp_path / "one.csv"
            one.write_bytes(b"y,d,s\n" + line + b"\n")
            try:
                ds = small(one, on_bad_line="skip")
                alone[line] = small_rows(ds), ds.bad_lines.skipped
            except DataError:  # no valid rows
                alone[line] = [], 1
        return alone[line]

    rng = np.random.default_rng(0)
    for _ in range(200):
        picks = rng.integers(0, len(tails), 8).tolist()
        lines = [b"%d,%d,%s" % (i % 2, i, tails[k]) for i, k in enumerate(picks)]
        path = tmp_path / "all.csv"
        path.write_bytes(b"y,d,s\n" + b"\n".join(lines) + b"\n")
        want = [read_alone(line) for line in lines]
        ds = small(path, on_bad_line="skip")
        assert ds.bad_lines.skipped == sum(bad for _, bad in want), lines
        assert small_rows(ds) == [row for rows, _ in want for row in rows], lines
    assert "Traceback" not in capfd.readouterr().err


BAD = [
    ("1,2.5,u1,a", BadLineReason.FIELD_COUNT, "fields"),
    ("", BadLineReason.FIELD_COUNT, "fields"),
    ("2,1,u,a,7,x,1,1", BadLineReason.LABEL_NOT_BINARY, "label"),
    ("yes,1,u,a,7,x,1,1", BadLineReason.LABEL_NOT_BINARY, "label"),
    ("1,abc,u,a,7,x,1,1", BadLineReason.DENSE_NOT_NUMBER, "price"),
    ("1,1,u,a,7,x,nan,1", BadLineReason.DENSE_NOT_NUMBER, "qty"),
    ("1,3.5e38,u,a,7,x,1,1", BadLineReason.DENSE_NOT_NUMBER, "price"),  # inf as float32
    ("1,1,u,a,7,x,1,1\rz", BadLineReason.FIELD_COUNT, "fields"),  # a lone \r ends a row
    ("1,1,u\udcff,a,7,x,1,1", BadLineReason.NOT_UTF8, "user"),
]


def bad_file(path: Path, bad_line: str) -> Path:
    good = [",".join(r) for r in ROWS]
    text = "\n".join([",".join(NAMES), *good[:2], bad_line, good[2]]) + "\n"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # \udcff -> the byte 0xff
    return path


@pytest.mark.parametrize(("line", "reason", "column"), BAD)
def test_bad_line_error_names_file_line_and_column(tmp_path, line, reason, column):
    """Each kind of bad line raises naming the file, the line (the header is line 1, so
    the bad row is line 4) and the column; catches a wrong line number, column or
    reason, and a bad value read as something."""
    path = bad_file(tmp_path / "bad.csv", line)
    with pytest.raises(DataError) as err:
        dataset([path])
    assert str(err.value).startswith(f"{path}, line 4, field {column}: {reason.value}")
    assert (err.value.line, err.value.field, err.value.reason) == (4, column, reason)


@pytest.mark.parametrize(
    ("line", "detail"),
    [
        ("1,3.5e38,u,a,7,x,1,1", "(got '3.5e38', beyond float32's range, +-3.4e38)"),
        # the part before the \r is a whole row: not a dense value, the \r is at fault
        ("1,1,u,a,7,x,1,1\rz", "got a carriage return inside the line, which splits it)"),
        # no part has the fields: not a field count of one part
        ("1,1,u,a\r7,x,1,1", "got a carriage return inside the line, which splits it)"),
    ],
)
def test_bad_line_messages_say_what_is_wrong(tmp_path, line, detail):
    path = bad_file(tmp_path / "bad.csv", line)
    with pytest.raises(DataError) as err:
        dataset([path])
    assert str(err.value).endswith(detail)


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_an_empty_line_is_a_field_count_error_with_any_line_end(tmp_path, newline):
    """An empty line of a CRLF file (just "\\r") was reported as "label is not 0 or 1
    (got '')", and counted under that reason when skipped, where the same line of an
    LF file is a wrong number of fields, "got an empty line"."""
    path = tmp_path / "e.csv"
    path.write_bytes(newline.join(["label,c", "1,a", "", "0,b", ""]).encode())
    mapping = ColumnMapping(label_column="label", sparse_columns=("c",))
    with pytest.raises(DataError, match=r"line 3, field fields: .*got an empty line\)$"):
        read_csv([path], mapping)
    columns, bad = read_csv([path], mapping, on_bad_line="skip")
    assert columns.labels.tolist() == [1.0, 0.0]
    assert dict(bad.counts) == {"wrong number of fields": 1}


@pytest.mark.parametrize("one_pass", [True, False])
def test_a_line_not_utf8_with_a_wrong_number_of_fields(tmp_path, monkeypatch, one_pass):
    """Lines with bytes that are not UTF-8 and too few fields (lines 3 and 5) are wrong
    numbers of fields, with the count; one with the right count (line 4) is a value
    that is not UTF-8; nothing is printed. Both in the one-pass search and in the split
    it falls back to. Bug caught: pyarrow decodes a row to text before it calls the
    invalid-row handler, so it printed "Exception ignored in: <function
    _find_bad_lines.<locals>.invalid_row ...>" and a UnicodeDecodeError traceback, and
    the line was reported, and counted in skip mode, as "got an empty line"."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    if not one_pass:
        monkeypatch.setattr(csv_source, "_find_bad_lines", lambda *args: None)
    path = tmp_path / "bad.csv"
    path.write_bytes(b"label,c,d\n1,a,1\n1\xff,1\n0,b\xfe,2\n0,\xe2\x82\n1,c,3\n")
    mapping = ColumnMapping(label_column="label", dense_columns=("d",), sparse_columns=("c",))
    with pytest.raises(DataError) as err:
        read_csv([path], mapping)
    assert str(err.value) == (
        f"{path}, line 3, field fields: wrong number of fields "
        "(expected 3 fields separated by ',', got 2)"
    )
    columns, bad = read_csv([path], mapping, on_bad_line="skip")
    assert columns.labels.tolist() == [1.0, 1.0]
    assert dict(bad.counts) == {"wrong number of fields": 2, "value is not UTF-8 text": 1}
    where = [e.removeprefix(f"{path}, ").split(":")[0] for e in bad.examples]
    assert where == ["line 3, field fields", "line 4, field c", "line 5, field fields"]
    assert unraisable == []


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize(
    "header",
    [b"label,d,\xff\xfec", b"label,c\r1\xff"],  # the second: invalid_row gets the rest
)
def test_a_header_line_not_utf8_is_an_error_naming_file_and_line(
    tmp_path, monkeypatch, policy, header
):
    """Bug caught: the header's names were decoded after the read, so the error was
    "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte" with no
    file or line; a part after a lone "\\r" made pyarrow print a traceback from
    ``_header.<locals>.invalid_row``."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    path = tmp_path / "h.csv"
    path.write_bytes(header + b"\n1,a\n")
    mapping = ColumnMapping(label_column="label", sparse_columns=("c",))
    with pytest.raises(DataError) as err:
        read_csv([path], mapping, on_bad_line=policy)
    assert str(err.value).startswith(f"{path}, line 1: cannot read the header line (byte ")
    assert "is not UTF-8 text" in str(err.value)
    assert err.value.line == 1
    assert unraisable == []


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize(
    "data", [b"label,c\r1,a\r0,b\r", b"label,c\rjunk,more\n1,a\n", b"label,c\r1,a,x\n1,a\n"]
)
def test_a_lone_carriage_return_in_the_header_line_is_an_error(tmp_path, policy, data):
    """pyarrow ends a row at a lone "\\r": the header's names were those of the part
    before it and the rest was dropped, so a classic-Mac file (all "\\r" line ends) gave
    "no valid rows" with no line or reason, and a stray "\\r" in a header line was
    accepted silently. It names line 1 and the carriage return, even in skip mode (no
    line of a file can be read without its header); a header ending in "\\r\\n" and a
    quoted "\\r" are still read."""
    mapping = ColumnMapping(label_column="label", sparse_columns=("c",))
    path = tmp_path / "mac.csv"
    path.write_bytes(data)
    with pytest.raises(DataError) as err:
        read_csv([path], mapping, on_bad_line=policy)
    assert str(err.value).startswith(
        f"{path}, line 1: cannot read the header line (got a carriage return inside the line"
    )
    path.write_bytes(b"label,c\r\n1,a\r\n")
    assert read_csv([path], mapping, on_bad_line=policy)[0].labels.tolist() == [1.0]
    path.write_bytes(b'label,"c\rx",c\n1,a,b\n')
    assert read_csv([path], mapping, on_bad_line=policy)[0].labels.tolist() == [1.0]


def test_no_rows_left_says_why_the_lines_were_skipped(tmp_path):
    """With every line skipped the error was only "no valid rows in [...]": the
    per-reason count and the first bad line, which the skip summary gives, were lost."""
    path = tmp_path / "all.csv"
    path.write_text("label,c\nyes,a\nno,b\n")
    mapping = ColumnMapping(label_column="label", sparse_columns=("c",))
    with pytest.raises(DataError) as err:
        read_csv([path], mapping, on_bad_line="skip")
    assert str(err.value).startswith(f"no valid rows in ['{path}']: read 0 rows, skipped 2 ")
    assert "(2 label is not 0 or 1); first: " in str(err.value)
    assert str(err.value).endswith("all.csv, line 2, field label: label is not 0 or 1 (got 'yes')")


def test_a_line_longer_than_pyarrows_block_is_read(tmp_path):
    """A multi-hot field of 400,000 ids (a 3.2 MB line) is one row, not a bad line
    (pyarrow refuses a row that straddles more than two of its 1 MiB parse blocks)."""
    ids = "|".join(str(i) for i in range(1_000_000, 1_400_000))
    rows = [ROWS[0], [*ROWS[0][:-1], ids], ROWS[2]]
    ds = dataset([write(tmp_path / "long.csv", rows)])
    lengths = ds.read(np.arange(3)).sparse.lengths.view(4, 3)  # key-major: (features, batch)
    assert lengths[3].tolist() == [2, 400_000, 1]


def test_skip_counts_each_reason_and_keeps_good_rows(tmp_path):
    """Skip mode drops exactly the bad lines, counts them per reason, and the good rows
    are those of a clean file (catches a good row dropped with a bad one, or a count
    missing)."""
    paths = [bad_file(tmp_path / f"bad{i}.csv", line) for i, (line, _, _) in enumerate(BAD)]
    ds = dataset(paths, on_bad_line="skip")
    clean = dataset([write(tmp_path / "clean.csv", ROWS)] * len(BAD))
    assert_same(ds, clean)
    assert ds.bad_lines.rows_read == 3 * len(BAD)
    assert dict(ds.bad_lines.counts) == {
        "wrong number of fields": 3,
        "label is not 0 or 1": 2,
        "dense value is not a finite number": 3,
        "value is not UTF-8 text": 1,
    }


def test_headerless_line_numbers_start_at_one(tmp_path):
    path = write(tmp_path / "n.csv", [ROWS[0], ["1", "2"]], header=False)
    csv = CsvConfig(header=False, column_names=NAMES, multi_hot_columns=("tags", "ids"))
    with pytest.raises(DataError, match=r"n\.csv, line 2, field fields: wrong number"):
        dataset([path], csv=csv)


def test_bad_lines_found_exactly_whatever_the_block_size(tmp_path, monkeypatch):
    """Thousands of rows with bad lines deep inside: the error names the right line,
    skip mode drops just those lines, and tiny blocks (many block boundaries, lines
    carried over) give the same rows and line numbers as one block (catches an
    off-by-one in the split-and-reread or in line counting across blocks)."""
    rows = [
        [str(i % 2), str(i), f"u{i % 97}", f"t{i % 5}|t{i % 7}", str(i % 13), "", "1", ""]
        for i in range(3000)
    ]
    good = [",".join(r) for r in rows]
    lines = [*good[:1234], "1,1,u", *good[1234:2500], "1,x,u,a,7,,1,", *good[2500:]]
    path = tmp_path / "big.csv"
    path.write_text("\n".join([",".join(NAMES), *lines]) + "\n")
    clean = dataset([write(tmp_path / "clean.csv", rows)])
    for block_bytes in (csv_source._BLOCK_BYTES, 1000):
        monkeypatch.setattr(csv_source, "_BLOCK_BYTES", block_bytes)
        with pytest.raises(DataError, match=r"big\.csv, line 1236, field fields"):
            dataset([path])
        ds = dataset([path], on_bad_line="skip")
        assert ds.bad_lines.skipped == 2
        assert "line 2503, field price" in ds.bad_lines.examples[1]
        assert_same(ds, clean)


def _many_bad_lines(path: Path) -> Path:
    """1,000 good rows with every kind of bad line of ``BAD`` strewn among them."""
    rng = np.random.default_rng(0)
    lines = [",".join(r) for r in ROWS * 333] + [",".join(ROWS[0])]
    for k, at in enumerate(sorted(rng.choice(len(lines), 60, replace=False), reverse=True)):
        lines.insert(int(at), BAD[k % len(BAD)][0])
    text = "\n".join([",".join(NAMES), *lines]) + "\n"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    return path


def test_skip_finds_many_bad_lines_in_a_few_reads(tmp_path, monkeypatch):
    """Skip mode with a few percent of bad lines was hundreds of times slower than a
    clean file: a failing block was split 16 ways and re-read recursively, about
    16 * log16(lines) pyarrow reads per bad line. The bad lines of a block are now
    found in one pass, and the rest read as one block."""
    path = _many_bad_lines(tmp_path / "many.csv")
    reads = count_reads(monkeypatch)
    ds = dataset([path], on_bad_line="skip", csv=MULTI)
    assert ds.bad_lines.skipped == 60
    assert ds.num_samples == 1000
    # the whole block, the field count of the lines that are not UTF-8, the pass over
    # it, the good lines; and the reads of each line only pyarrow can judge: a dense
    # value that is not a number (1), a lone "\r" (2)
    kinds = [BAD[k % len(BAD)] for k in range(60)]
    one_by_one = sum(r == BadLineReason.DENSE_NOT_NUMBER for _, r, _ in kinds)
    one_by_one += 2 * sum("\r" in line for line, _, _ in kinds)
    assert len(reads) <= 4 + one_by_one < 60  # splitting: 604


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_one_pass_finds_what_splitting_finds(tmp_path, monkeypatch, policy):
    """The one-pass search of bad lines keeps the rows, counts, examples and the first
    error of the split-and-reread it replaced (which is still the fallback)."""
    path = _many_bad_lines(tmp_path / "many.csv")

    def read() -> object:
        try:
            ds = dataset([path], on_bad_line=policy, csv=MULTI)
        except DataError as e:
            return str(e)
        return ds.read(np.arange(ds.num_samples)), ds.bad_lines

    fast = read()
    monkeypatch.setattr(csv_source, "_find_bad_lines", lambda *args: None)
    split = read()
    if policy == "error":
        assert fast == split
        assert "many.csv, line 4, field qty" in str(fast)
        return
    assert fast[1] == split[1]
    for a, b in [
        (fast[0].dense, split[0].dense),
        (fast[0].labels, split[0].labels),
        (fast[0].sparse.values, split[0].sparse.values),
        (fast[0].sparse.lengths, split[0].sparse.lengths),
    ]:
        assert torch.equal(a, b)


def test_file_level_errors(tmp_path):
    """Missing file, empty file, header without a mapped column, a .gz that is not
    gzip: each a clear error naming the file."""
    with pytest.raises(DataFileNotFoundError):
        dataset([tmp_path / "missing.csv"])
    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.csv: the file is empty"):
        dataset([tmp_path / "empty.csv"])
    path = write(tmp_path / "cols.csv", [r[:5] for r in ROWS], names=NAMES[:5])
    with pytest.raises(DataError, match=r"cols\.csv, line 1: columns \['qty', 'ids'\] are not"):
        dataset([path])
    os.mkfifo(tmp_path / "pipe.csv")  # <(cat a.csv): cannot be read (no seek)
    with pytest.raises(DataError, match=r"pipe\.csv: expected a regular file, got a pipe"):
        dataset([tmp_path / "pipe.csv"])
    (tmp_path / "fake.csv.gz").write_text("label,user\n")
    with pytest.raises(DataError, match="not gzip data"):
        dataset([tmp_path / "fake.csv.gz"])
    only_header = write(tmp_path / "h.csv", [])
    with pytest.raises(DataError, match="no valid rows"):
        dataset([only_header])
    with pytest.raises(ValueError, match=r"multi_hot_columns \['price'\]"):
        read_csv([only_header], MAPPING, csv=CsvConfig(multi_hot_columns=("price",)))


def test_config_fields_are_validated():
    with pytest.raises(ValueError, match=r"CsvConfig\.delimiter must be one ASCII character"):
        CsvConfig(delimiter=";;")
    with pytest.raises(ValueError, match="delimiter"):
        CsvConfig(delimiter='"')
    assert CsvConfig(delimiter="\\t").delimiter == "\t"  # --set data.csv.delimiter=\t
    with pytest.raises(ValueError, match="set header = false"):
        CsvConfig(column_names=("a", "b"))
    with pytest.raises(ValueError, match=r"needs CsvConfig\.column_names"):
        CsvConfig(header=False)
    with pytest.raises(ValueError, match=r"column_names repeats \['a'\]"):
        CsvConfig(header=False, column_names=("a", "b", "a"))
    with pytest.raises(ValueError, match=r"multi_hot_separator '\|' contains the delimiter"):
        CsvConfig(delimiter="|", multi_hot_columns=("t",))
    with pytest.raises(ValueError, match="multi_hot_separator must be a non-empty"):
        CsvConfig(multi_hot_separator="")
    with pytest.raises(ValueError, match=r"needs DataConfig\.sparse_columns"):
        DataConfig(source="csv", train_path=("a.csv",))
    with pytest.raises(ValueError, match=r"multi_hot_columns \['x'\] are not sparse_columns"):
        DataConfig(source="csv", train_path="a", sparse_columns="u", csv={"multi_hot_columns": "x"})
    with pytest.raises(ValueError, match=r"columns \['u'\] are not in csv.column_names"):
        DataConfig(
            source="csv",
            train_path="a",
            sparse_columns="u",
            label_column="y",
            csv={"header": False, "column_names": ["y", "v"]},
        )
    with pytest.raises(ValueError, match=r"uses columns \['u'\] more than once"):
        ColumnMapping(label_column="y", dense_columns=("u",), sparse_columns=("u",))


def test_pipe_delimiter_without_multi_hot_columns_is_accepted(tmp_path):
    """``delimiter = "|"`` (an example delimiter of the docs) was refused because it is
    in the default ``multi_hot_separator``, even with no multi-hot column to split."""
    path = tmp_path / "p.csv"
    path.write_text("label|c\n1|a\n0|b\n")
    mapping = ColumnMapping(label_column="label", sparse_columns=("c",))
    columns, _ = read_csv([path], mapping, csv=CsvConfig(delimiter="|"))
    assert columns.labels.tolist() == [1.0, 0.0]


def test_multi_hot_separator_backslash_t_is_a_tab_like_the_delimiter(tmp_path):
    """``multi_hot_separator`` typed as backslash + t (``--set ...=\\t``, TOML ``"\\\\t"``)
    was kept as those two characters while ``delimiter`` spelled the same way became a
    tab: tab-joined bags were silently read as one item per row."""
    assert CsvConfig(delimiter=";", multi_hot_separator="\\t").multi_hot_separator == "\t"
    path = tmp_path / "t.csv"
    path.write_text("label;tags\n1;a\tb\tc\n0;d\te\n")
    mapping = ColumnMapping(label_column="label", sparse_columns=("tags",))
    csv = CsvConfig(delimiter=";", multi_hot_columns=("tags",), multi_hot_separator="\\t")
    columns, _ = read_csv([path], mapping, csv=csv)
    assert np.diff(columns.offsets[0]).tolist() == [3, 2]


def test_build_datasets_reads_the_csv_source(tmp_path):
    """The LOADERS registry entry passes the mapping, the csv settings and the policy."""
    path = bad_file(tmp_path / "b.csv", "")
    config = DataConfig(
        source="csv",
        train_path=str(path),
        label_column="label",
        dense_columns=("price", "qty"),
        sparse_columns=("user", "tags", "city", "ids"),
        csv={"multi_hot_columns": ["tags", "ids"]},
        on_bad_line="skip",
        train_rows=(0, 2),
        eval_rows=(2, 3),
    )
    train, held_out = build_datasets(config, TABLES)
    assert (train.num_samples, held_out.num_samples) == (2, 1)
    assert train.bad_lines.skipped == 1
    assert_same(held_out, dataset([write(tmp_path / "last.csv", ROWS[2:])]))


@pytest.mark.skipif(not AVAZU.exists(), reason="shared Avazu sample not present")
def test_avazu_sample():
    """The real Avazu layout (header, gzip, hex strings and integers): every row read,
    clicks as PROVENANCE.md counts them, 22 categorical features after dropping id."""
    with gzip.open(AVAZU, "rt") as f:
        names = f.readline().strip().split(",")
        first = f.readline().strip().split(",")
    sparse = tuple(c for c in names if c not in ("id", "click"))
    assert len(sparse) == 22
    assert sparse[0] == "hour"
    tables = [TableConfig(name=c, num_embeddings=10_000, dim=4) for c in sparse]
    ds = CsvDataset(
        [AVAZU], mapping=ColumnMapping(label_column="click", sparse_columns=sparse), tables=tables
    )
    assert ds.num_samples == 8999
    assert int(ds.labels.sum()) == 1563
    assert ds.num_dense == 0
    assert ds.bad_lines.skipped == 0
    b = ds.read(np.arange(2))
    row = dict(zip(names, first))
    assert b.sparse.to_dict()["device_ip"][0][0].item() == row_of(row["device_ip"], 10_000)
    assert b.sparse.to_dict()["hour"][0][0].item() == row_of(row["hour"], 10_000)
