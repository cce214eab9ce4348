import gzip
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tetrarec.data import (
    BadLinePolicy,
    DataConfig,
    DataError,
    DataSource,
    SyntheticConfig,
    build_datasets,
    hash_ids,
    preprocess_criteo,
)
from tetrarec.embedding import TableConfig

TABLES = [TableConfig(name=f"C{i}", num_embeddings=100 + i, dim=4) for i in range(1, 27)]


def line(i: int) -> str:
    return "\t".join([str(i % 2), *[str(i)] * 13, *[f"{i * 31 + c:08x}" for c in range(26)]])


def criteo_file(path: Path, rows: int, *, bad_at: int | None = None) -> Path:
    lines = [line(i) for i in range(rows)]
    if bad_at is not None:
        lines[bad_at] = "1\tnot enough fields"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def test_config_validation_names_field_and_values():
    with pytest.raises(
        ValueError, match=r"'synthetic', 'criteo', 'binary', 'parquet', 'csv'.*'json'"
    ):
        DataConfig(source="json")
    with pytest.raises(
        ValueError, match=r"on_bad_line must be one of 'error', 'skip', got 'ignore'"
    ):
        DataConfig(on_bad_line="ignore")
    with pytest.raises(ValueError, match=r"DataConfig\.batch_size must be > 0, got 0"):
        DataConfig(batch_size=0)
    with pytest.raises(ValueError, match="train_rows"):
        DataConfig(train_rows=(5, 5))
    with pytest.raises(ValueError, match="train_path is needed"):
        DataConfig(source="criteo")
    with pytest.raises(ValueError, match="sparse_columns"):
        DataConfig(source="parquet", train_path=("a.parquet",))
    with pytest.raises(ValueError, match="zipf"):
        SyntheticConfig(zipf=0)
    with pytest.raises(ValueError, match="target_ctr"):
        SyntheticConfig(target_ctr=1.0)
    cfg = DataConfig(source="criteo", train_path="a.tsv", train_rows=[0, 10], on_bad_line="skip")
    assert cfg.source == "criteo"
    assert cfg.source is DataSource.CRITEO
    assert cfg.on_bad_line is BadLinePolicy.SKIP
    assert cfg.train_path == ("a.tsv",)
    assert cfg.train_rows == (0, 10)
    assert DataConfig(synthetic={"num_samples": 5}).synthetic == SyntheticConfig(num_samples=5)


def test_synthetic_splits(caplog):
    tables = TABLES[:3]
    cfg = DataConfig(synthetic=SyntheticConfig(num_samples=300, eval_samples=40))
    train, held = build_datasets(cfg, tables)
    assert (train.num_samples, held.num_samples) == (300, 40)
    assert train.keys == ("C1", "C2", "C3")
    assert train.num_dense == 13
    # Row ranges select rows of train_path files; the synthetic splits ignore them, loudly.
    with caplog.at_level(logging.WARNING, logger="tetrarec.data.build"):
        ranged, _ = build_datasets(
            DataConfig(synthetic=cfg.synthetic, train_rows=(100, 200)), tables
        )
    assert ranged.num_samples == 300
    assert "ignores them" in caplog.text


def test_criteo_source_row_ranges_and_holdout(tmp_path, caplog):
    f = criteo_file(tmp_path / "day.gz", 50)
    train, held = build_datasets(DataConfig(source="criteo", train_path=(str(f),)), TABLES)
    assert (train.num_samples, held.num_samples) == (45, 5)
    b = held.read(np.array([0, 4]))
    assert b.dense[:, 0].tolist() == pytest.approx(np.log1p([45, 49]).tolist())
    assert b.sparse.keys == tuple(t.name for t in TABLES)
    c1 = b.sparse.to_dict()["C1"][0].tolist()
    assert c1 == hash_ids(np.array([45 * 31, 49 * 31]), 101).tolist()
    cfg = DataConfig(source="criteo", train_path=(str(f),), train_rows=(10, 20), eval_rows=(0, 10))
    train, held = build_datasets(cfg, TABLES)
    assert train.read(np.arange(10)).dense[:, 0].tolist() == pytest.approx(
        np.log1p(np.arange(10, 20)).tolist()
    )
    assert held.num_samples == 10
    train, held = build_datasets(
        DataConfig(source="criteo", train_path=(str(f),), train_rows=(0, 30)), TABLES
    )
    assert held.num_samples == 20
    # Bug caught: "row range [40, 60) is not inside..." without saying which range, after
    # a warning that the ranges overlap.
    with pytest.raises(ValueError, match=r"data.eval_rows \[40, 60\) is not inside the 50 rows"):
        build_datasets(
            DataConfig(source="criteo", train_path=(str(f),), eval_rows=(40, 60)), TABLES
        )
    with pytest.raises(ValueError, match=r"data.train_rows \[0, 51\) is not inside the 50"):
        build_datasets(
            DataConfig(source="criteo", train_path=(str(f),), train_rows=(0, 51), eval_rows=(0, 5)),
            TABLES,
        )
    with pytest.raises(ValueError, match="26 sparse features but the tables have 3"):
        build_datasets(DataConfig(source="criteo", train_path=(str(f),)), TABLES[:3])
    # Bug caught: a one-row input with nothing held out failed on "data.train_rows [0, 0)
    # is not inside the 1 rows", a key the run never set.
    one = criteo_file(tmp_path / "one.gz", 1)
    with pytest.raises(ValueError, match=r"has 1 row\(s\): too few to hold some out") as e:
        build_datasets(DataConfig(source="criteo", train_path=(str(one),)), TABLES)
    assert "train_rows" not in str(e.value)
    train, held = build_datasets(
        DataConfig(source="criteo", train_path=(str(criteo_file(tmp_path / "two.gz", 2)),)), TABLES
    )
    assert (train.num_samples, held.num_samples) == (1, 1)


def test_criteo_skip_is_summarized(tmp_path, caplog):
    f = criteo_file(tmp_path / "day.gz", 30, bad_at=3)
    with pytest.raises(DataError, match=r"day\.gz, line 4, field fields"):
        build_datasets(DataConfig(source="criteo", train_path=(str(f),)), TABLES)
    g = criteo_file(tmp_path / "eval.gz", 10)
    cfg = DataConfig(source="criteo", train_path=(str(f),), eval_path=(str(g),), on_bad_line="skip")
    with caplog.at_level(logging.WARNING, logger="tetrarec.data.build"):
        train, held = build_datasets(cfg, TABLES)
    assert (train.num_samples, held.num_samples) == (29, 10)
    assert train.bad_lines.skipped == 1
    assert "skipped 1 bad lines (1 wrong number of fields)" in caplog.text


def test_binary_source_equals_criteo_source(tmp_path):
    f = criteo_file(tmp_path / "day.gz", 40)
    preprocess_criteo([f], tmp_path / "bin", progress=False)
    raw = build_datasets(DataConfig(source="criteo", train_path=(str(f),)), TABLES)
    binary = build_datasets(
        DataConfig(source="binary", train_path=(str(tmp_path / "bin"),)), TABLES
    )
    for a, b in zip(raw, binary):
        idx = np.array([3, 1, a.num_samples - 1, 2])
        x, y = a.read(idx), b.read(idx)
        assert torch.equal(x.dense, y.dense)
        assert torch.equal(x.sparse.values, y.sparse.values)
        assert torch.equal(x.labels, y.labels)


def test_parquet_source(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(
        pa.table({"y": [0, 1, 1, 0], "x": [1.0, 2.0, 3.0, 4.0], "ids": [[1], [2, 3], [], [4]]}), p
    )
    cfg = DataConfig(
        source="parquet",
        train_path=(str(p),),
        dense_columns=("x",),
        sparse_columns=("ids",),
        label_column="y",
        train_rows=(0, 3),
    )
    train, held = build_datasets(cfg, [TableConfig(name="ids", num_embeddings=10, dim=4)])
    assert (train.num_samples, held.num_samples) == (3, 1)
    assert train.read(np.arange(3)).sparse.lengths.tolist() == [1, 2, 0]
