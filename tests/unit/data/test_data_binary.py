import json
from pathlib import Path

import numpy as np
import pytest

from tetrarec.data import (
    DataError,
    DataFileNotFoundError,
    open_binary,
    preprocess_criteo,
    read_criteo,
)

REPO = Path(__file__).resolve().parents[3]
KAGGLE = REPO.parent / "shared/data/criteo-kaggle-dac-sample/criteo_kaggle_dac_sample.tsv.gz"


def line(i: int, label: str = "0") -> str:
    dense = [str(i * 13 + d - 50) if d % 4 else "" for d in range(13)]
    cats = [f"{(i * 2654435761 + c) % 2**32:08x}" if c % 5 else "" for c in range(26)]
    return "\t".join([label, *dense, *cats])


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_preprocess_round_trip_equals_raw_read(tmp_path):
    a = write(tmp_path / "a.tsv", [line(i, str(i % 2)) for i in range(30)])
    b = write(tmp_path / "b.tsv", [line(100 + i) for i in range(7)])
    out = tmp_path / "out"
    summary = preprocess_criteo([a, b], out, progress=False)
    assert summary.rows == 37
    assert summary.positives == 15
    assert summary.files == ((str(a), 30), (str(b), 7))
    assert summary.bad_lines.skipped == 0
    raw, _ = read_criteo([a, b])
    cols = open_binary(out)
    assert isinstance(cols.sparse, np.memmap)
    assert cols.rows == 37
    assert np.array_equal(cols.labels, raw.labels)
    assert np.array_equal(cols.dense, raw.dense)
    assert np.array_equal(cols.sparse, raw.sparse)
    # Plain numpy reads the columns too.
    assert np.load(out / "sparse.npy").shape == (37, 26)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "tetrarec-criteo"
    assert meta["version"] == 2  # 2: raw dense values
    assert meta["rows"] == 37
    assert [f["rows"] for f in meta["files"]] == [30, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tsv", "b.tsv", "out"]  # no temp dir


def test_preprocess_skip_records_summary(tmp_path):
    lines = [line(i) for i in range(10)]
    lines[4] = line(4, label="x")
    a = write(tmp_path / "a.tsv", lines)
    with pytest.raises(DataError, match=r"a\.tsv, line 5, field label"):
        preprocess_criteo([a], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a.tsv"]  # temp dir removed
    summary = preprocess_criteo([a], tmp_path / "out", on_bad_line="skip", progress=False)
    assert summary.rows == 9
    assert dict(summary.bad_lines.counts) == {"label is not 0 or 1": 1}
    assert "skipped 1 bad lines" in summary.summary()
    assert open_binary(tmp_path / "out").bad_lines.skipped == 1


def test_preprocess_refuses_existing_output_and_missing_input(tmp_path):
    a = write(tmp_path / "a.tsv", [line(0)])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep me")
    with pytest.raises(DataError, match="already exists"):
        preprocess_criteo([a], tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "x").read_text() == "keep me"
    with pytest.raises(DataFileNotFoundError, match=r"missing\.tsv"):
        preprocess_criteo([tmp_path / "missing.tsv"], tmp_path / "o2", progress=False)
    (tmp_path / "empty").mkdir()  # an empty directory is fine
    assert preprocess_criteo([a], tmp_path / "empty", progress=False).rows == 1


def test_open_binary_errors(tmp_path):
    with pytest.raises(DataFileNotFoundError):
        open_binary(tmp_path / "nothing")
    a = write(tmp_path / "a.tsv", [line(i) for i in range(5)])
    # a raw file given to the binary source: it said "directory not found" of a file
    with pytest.raises(DataError, match=r"a\.tsv: data\.source = 'binary' reads a directory"):
        open_binary(a)
    out = tmp_path / "out"
    preprocess_criteo([a], out, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DataError, match="v1"):
        open_binary(out)
    (out / "meta.json").write_text(json.dumps({**meta, "rows": 6}))
    with pytest.raises(DataError, match=r"labels\.npy: expected shape \(6,\)"):
        open_binary(out)
    (out / "meta.json").write_text(json.dumps(meta))
    data = (out / "dense.npy").read_bytes()
    (out / "dense.npy").write_bytes(data[:200])
    with pytest.raises(DataError, match=r"dense\.npy"):
        open_binary(out)


@pytest.mark.skipif(not KAGGLE.exists(), reason="shared Criteo sample not present")
def test_real_sample_round_trip(tmp_path):
    summary = preprocess_criteo([KAGGLE], tmp_path / "k", progress=False)
    assert summary.rows == 12868
    raw, _ = read_criteo([KAGGLE])
    cols = open_binary(tmp_path / "k")
    assert np.array_equal(cols.sparse, raw.sparse)
    assert np.array_equal(cols.dense, raw.dense)
