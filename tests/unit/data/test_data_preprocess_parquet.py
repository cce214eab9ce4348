"""Parquet string columns, and ``preprocess csv|parquet``: parse once, read back the same.

The round trips compare every tensor of the batches bit for bit: a preprocessed file
read with ``source = "parquet"`` must give exactly what reading the original gives.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tetrarec.cli import main
from tetrarec.data import (
    ColumnMapping,
    CsvConfig,
    CsvDataset,
    DataError,
    ParquetDataset,
    hash_ids,
    preprocess_to_parquet,
)
from tetrarec.embedding import TableConfig

MASK = 2**64 - 1
TABLES = [
    TableConfig(name="user", num_embeddings=100, dim=4),
    TableConfig(name="tags", num_embeddings=50, dim=4, feature_names=("tags", "city")),
]
MAPPING = ColumnMapping(label_column="y", dense_columns=("d",), sparse_columns=("u", "t", "c"))
CSV_TEXT = (
    "y,d,u,t,c,extra\n"
    "1,2.5,u1,a|b,7,x\n"
    "0,,,,,\n"
    "2,1,bad,label,row,x\n"
    "1,-3.25,u2,b,07,\n"
    "0,0.1,u1,c|a|b,7,z\n"
)


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h


def batches_equal(a, b):
    x, y = a.read(np.arange(a.num_samples)), b.read(np.arange(b.num_samples))
    assert a.num_samples == b.num_samples
    assert a.keys == b.keys
    for s, t in [
        (x.dense, y.dense),
        (x.labels, y.labels),
        (x.sparse.values, y.sparse.values),
        (x.sparse.lengths, y.sparse.lengths),
    ]:
        assert s.dtype == t.dtype
        assert torch.equal(s, t)


def test_parquet_string_and_list_string_columns(tmp_path):
    """String, large_string, dictionary<string> and list<string> columns hash like the
    csv source (catches a string column rejected, or hashed differently from text),
    with null and "" as raw 0 and a null list as an empty bag."""
    path = tmp_path / "s.parquet"
    pq.write_table(
        pa.table(
            {
                "y": pa.array(["1", "0", "1"]),  # text labels are accepted too
                "d": [1.0, None, 3.0],
                "u": pa.array(["u1", None, ""], pa.large_string()),
                "t": pa.array([["a", "b"], None, ["b", None]], pa.list_(pa.string())),
                "c": pa.array(["7", "07", "7"]).dictionary_encode(),
            }
        ),
        path,
    )
    ds = ParquetDataset(
        [path],
        dense_columns=("d",),
        sparse_columns=("u", "t", "c"),
        label_column="y",
        tables=TABLES,
    )
    b = ds.read(np.arange(3))
    d = b.sparse.to_dict()

    def rows(values, n):
        raw = np.array([fnv1a64(v.encode()) if v else 0 for v in values], dtype=np.uint64)
        return hash_ids(raw.view(np.int64), n).tolist()

    assert b.labels.tolist() == [1.0, 0.0, 1.0]
    assert d["user"][0].tolist() == rows(["u1", "", ""], 100)
    assert d["tags"][0].tolist() == rows(["a", "b", "b", ""], 50)
    assert d["tags"][1].tolist() == [2, 0, 2]
    assert d["city"][0].tolist() == rows(["7", "07", "7"], 50)
    bad = tmp_path / "bad.parquet"
    pq.write_table(
        pa.table(
            {
                "y": ["1", "yes"],
                "d": [1.0, 1.0],
                "u": ["a", "b"],
                "t": [["a"], ["b"]],
                "c": ["a", "b"],
            }
        ),
        bad,
    )
    with pytest.raises(
        DataError, match=r"bad\.parquet, field y: label is not 0 or 1 \(row 2 holds 'yes'"
    ):
        ParquetDataset(
            [bad],
            dense_columns=("d",),
            sparse_columns=("u", "t", "c"),
            label_column="y",
            tables=TABLES,
        )


def test_preprocess_csv_reads_back_bit_identical(tmp_path):
    """csv -> preprocess -> parquet gives the same batches as the csv itself, with the
    multi-hot column as list<int64> and the one-hot ones as int64 (catches ids stored
    after table hashing, dense or labels rounded, bags misaligned, a skipped line written
    or not counted)."""
    src = tmp_path / "in.csv"
    src.write_text(CSV_TEXT)
    csv = CsvConfig(multi_hot_columns=("t",))
    out = tmp_path / "out" / "ids.parquet"
    summary = preprocess_to_parquet(
        [src], out, source="csv", mapping=MAPPING, csv=csv, on_bad_line="skip", progress=False
    )
    assert (summary.rows, summary.positives, summary.bad_lines.skipped) == (4, 2, 1)
    assert summary.bad_lines.counts == {"label is not 0 or 1": 1}
    schema = pq.read_schema(out)
    types = [schema.field(c).type for c in ("y", "d", "u", "t", "c")]
    assert types[:3] + types[4:] == [pa.float32(), pa.float32(), pa.int64(), pa.int64()]
    assert pa.types.is_list(types[3])
    assert types[3].value_type == pa.int64()
    meta = json.loads(pq.read_metadata(out).metadata[b"tetrarec"])
    assert meta["bad_lines"]["skipped"] == 1
    assert meta["files"] == [[str(src), 4]]
    original = CsvDataset([src], mapping=MAPPING, tables=TABLES, csv=csv, on_bad_line="skip")
    back = ParquetDataset(
        [out], dense_columns=("d",), sparse_columns=("u", "t", "c"), label_column="y", tables=TABLES
    )
    batches_equal(original, back)
    assert pq.read_table(out).column("u")[0].as_py() == np.uint64(fnv1a64(b"u1")).astype(np.int64)
    with pytest.raises(DataError, match="the output already exists"):
        preprocess_to_parquet([src], out, source="csv", mapping=MAPPING, csv=csv, progress=False)
    with pytest.raises(DataError, match=r"in\.csv, line 4, field y"):
        preprocess_to_parquet(
            [src], tmp_path / "o2.parquet", source="csv", mapping=MAPPING, csv=csv, progress=False
        )
    assert not (tmp_path / "o2.parquet").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_preprocess_parquet_strings_to_ids(tmp_path):
    """parquet with string columns -> preprocess -> int64 ids: the same batches."""
    src = tmp_path / "s.parquet"
    pq.write_table(
        pa.table(
            {
                "y": pa.array([1, 0, 1], pa.int8()),
                "d": [0.5, None, 2.0],
                "u": ["u1", None, "u3"],
                "t": pa.array([["a"], [], None], pa.list_(pa.string())),
                "c": pa.array([3, 4, None], pa.int32()),
            }
        ),
        src,
    )
    out = tmp_path / "ids.parquet"
    preprocess_to_parquet([src, src], out, source="parquet", mapping=MAPPING, progress=False)
    assert pq.read_schema(out).field("u").type == pa.int64()

    def load(paths):
        return ParquetDataset(
            paths,
            dense_columns=("d",),
            sparse_columns=("u", "t", "c"),
            label_column="y",
            tables=TABLES,
        )

    batches_equal(load([src, src]), load([out]))
    with pytest.raises(ValueError, match=r"reads sources 'csv', 'parquet', got 'criteo'"):
        preprocess_to_parquet([src], tmp_path / "x.parquet", source="criteo", mapping=MAPPING)


def test_cli_preprocess_csv_uses_the_run_config(tmp_path, capsys):
    """``tetrarec preprocess csv --config run.toml --output F``: the [data] mapping and
    [data.csv] settings of the run apply, --set overrides them, and the printed summary
    reports the rows and the skipped line written."""
    src = tmp_path / "in.tsv"
    src.write_text(CSV_TEXT.replace(",", "\t"))
    run = tmp_path / "run.toml"
    run.write_text(
        f"""
[data]
source = "csv"
train_path = ["{src}"]
label_column = "y"
dense_columns = ["d"]
sparse_columns = ["u", "t", "c"]
[data.csv]
delimiter = "\\t"
multi_hot_columns = ["t"]
"""
    )
    out = tmp_path / "ids.parquet"
    argv = ["-q", "preprocess", "csv", "--config", str(run), "--output", str(out), "--no-progress"]
    assert main([*argv, "--set", "data.on_bad_line=skip"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote 4 rows (2 positive) from 1 file(s) to {out}" in printed
    assert "skipped 1 bad lines (1 label is not 0 or 1)" in printed
    assert pq.read_table(out).num_rows == 4
    assert main([*argv[:-2], str(tmp_path / "o2.parquet")]) == 2  # on_bad_line "error"
    assert "in.tsv, line 4, field y: label is not 0 or 1" in capsys.readouterr().err


@pytest.mark.parametrize("path_from", ["--input", "--set"])
def test_cli_preprocess_takes_the_path_from_input_or_set_and_writes_json(
    tmp_path, capsys, path_from
):
    """A config without ``data.train_path`` failed ("train_path is needed for source
    'csv'") whatever ``--input`` or ``--set data.train_path=...`` said: the file was
    validated before either applied (``train`` merged first, as the README says). And
    ``--json``, which every other command with figures has, was refused."""
    src = tmp_path / "in.csv"
    src.write_text(CSV_TEXT)
    run = tmp_path / "run.toml"
    run.write_text(
        '[data]\nsource = "csv"\nlabel_column = "y"\ndense_columns = ["d"]\n'
        'sparse_columns = ["u", "t", "c"]\non_bad_line = "skip"\n'
        '[data.csv]\nmulti_hot_columns = ["t"]\n'
    )
    out, summary = tmp_path / "ids.parquet", tmp_path / "s.json"
    given = ["--input", str(src)] if path_from == "--input" else ["--set", f"data.train_path={src}"]
    argv = ["-q", "preprocess", "csv", "--config", str(run), "--output", str(out)]
    assert main([*argv, *given, "--no-progress", "--json", str(summary)]) == 0, capsys.readouterr()
    written = json.loads(summary.read_text())
    assert written["rows"] == pq.read_table(out).num_rows == 4
    assert written["positives"] == 2
    assert written["files"] == [{"path": str(src), "rows": 4}]
    assert written["bad_lines"]["skipped"] == 1


def test_cli_preprocess_input_keeps_a_file_name_beyond_the_bmp(tmp_path, capsys):
    """``--input`` with an emoji (beyond the Basic Multilingual Plane) in the file name
    failed "input file not found: .../data_\\ud83d\\ude00.csv": the path was handed to
    the TOML override parser as ``json.dumps`` text, whose surrogate-pair escape TOML
    refuses, so the escaped text itself was taken as the file name."""
    src = tmp_path / 'data_\U0001f600 "q" \\ \x7f.csv'
    src.write_text(CSV_TEXT)
    run = tmp_path / "run.toml"
    run.write_text(
        '[data]\nsource = "csv"\nlabel_column = "y"\ndense_columns = ["d"]\n'
        'sparse_columns = ["u", "t", "c"]\non_bad_line = "skip"\n'
    )
    out = tmp_path / "ids.parquet"
    argv = ["-q", "preprocess", "csv", "--config", str(run), "--output", str(out)]
    assert main([*argv, "--input", str(src), "--no-progress"]) == 0, capsys.readouterr().err
    assert pq.read_table(out).num_rows == 4


def test_preprocess_with_every_line_skipped_says_why(tmp_path):
    """``preprocess csv`` with every line skipped said only "no valid rows in the
    input", not why the lines were dropped."""
    src = tmp_path / "all.csv"
    src.write_text("y,d,u,t,c\n2,1,a,b,c\n")
    with pytest.raises(DataError, match=r"no valid rows in the input: .*1 label is not 0 or 1"):
        preprocess_to_parquet(
            [src], tmp_path / "o.parquet", source="csv", mapping=MAPPING, on_bad_line="skip"
        )
