"""Files without labels (Criteo's 39-field ``test.txt``, csv and parquet without the label
column): read for scoring (``require_labels=False``) as the same rows a labeled copy
gives, their labels NaN and ``has_labels`` false; training refuses them as before."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tetrarec.data import (
    BadLinePolicy,
    DataConfig,
    DataError,
    DataSource,
    build_datasets,
    evaluation_dataset,
    read_criteo,
)
from tetrarec.data import criteo as criteo_mod
from tetrarec.data.datasets import has_labels
from tetrarec.embedding import TableConfig

CRITEO_TABLES = [TableConfig(name=f"C{i}", num_embeddings=50 + i, dim=4) for i in range(1, 27)]
MAPPED_TABLES = [
    TableConfig(name="site", num_embeddings=30, dim=4),
    TableConfig(name="device", num_embeddings=70, dim=4),
]
MAPPING = {
    "label_column": "click",
    "dense_columns": ("price", "age"),
    "sparse_columns": ("site", "device"),
}


def _criteo_fields(i: int) -> list[str]:
    """Line ``i``'s label, 13 dense values (some empty) and 26 categoricals (some empty)."""
    dense = ["" if (i + j) % 7 == 0 else str((i * 13 + j) % 41 - 3) for j in range(13)]
    cats = ["" if (i + c) % 11 == 0 else f"{(i * 31 + c * 977) % 4096:08x}" for c in range(26)]
    return [str(i % 2), *dense, *cats]


def _write_lines(path: Path, rows: list[list[str]]) -> str:
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    return str(path)


def _all_rows(ds):
    return ds.read(np.arange(ds.num_samples))


def _assert_same_rows(got, want) -> None:
    """Dense and sparse parts of two batches are equal."""
    np.testing.assert_array_equal(got.dense.numpy(), want.dense.numpy())
    assert got.sparse.keys == want.sparse.keys
    np.testing.assert_array_equal(got.sparse.values.numpy(), want.sparse.values.numpy())
    np.testing.assert_array_equal(got.sparse.lengths.numpy(), want.sparse.lengths.numpy())


def _criteo_config(*paths: str, on_bad_line: str = "error") -> DataConfig:
    return DataConfig(source="criteo", train_path=paths, on_bad_line=on_bad_line)


def _scoring_read(config: DataConfig, tables, files, require_labels=False):
    return evaluation_dataset(config, tables, None, files, require_labels=require_labels)


def test_criteo_39_field_file_reads_as_the_labeled_rows_without_labels(tmp_path):
    """``test.txt``'s layout (no label field) read for scoring gives exactly the dense and
    sparse values of the same lines with a label in front, labels NaN and
    ``has_labels`` false. Catches the fields read shifted by one (I1 taken as the label,
    C26 lost), the file refused for its field count, or labels filled with 0 that
    metrics would use."""
    rows = [_criteo_fields(i) for i in range(40)]
    labeled = _write_lines(tmp_path / "train.tsv", rows)
    unlabeled = _write_lines(tmp_path / "test.txt", [r[1:] for r in rows])
    config = _criteo_config(labeled)
    want = _scoring_read(config, CRITEO_TABLES, [labeled])
    got = _scoring_read(config, CRITEO_TABLES, [unlabeled])
    assert has_labels(want)
    assert not has_labels(got)
    assert got.num_samples == 40
    _assert_same_rows(_all_rows(got), _all_rows(want))
    assert np.isnan(_all_rows(got).labels.numpy()).all()
    # the raw reader says so too, and the labeled file keeps its labels when not required
    block, _ = read_criteo([unlabeled], require_labels=False)
    assert not block.labeled
    labels = _all_rows(want).labels.numpy()
    np.testing.assert_array_equal(labels, [i % 2 for i in range(40)])


@pytest.mark.parametrize("block_bytes", [None, 64])
def test_criteo_file_mixing_39_and_40_fields_follows_on_bad_line(
    tmp_path, monkeypatch, block_bytes
):
    """The first line decides a file's layout; a line of the other layout is a bad line:
    skipped and counted under ``skip`` (the other rows read as usual, labels NaN), one
    error naming the file, line and field count under ``error``. Read in blocks of a
    line or so too (``block_bytes=64``). Catches a layout decided per line or per block
    (a 40-field line read with its label taken as I1), labels of 0 from the line-by-line
    parse."""
    if block_bytes is not None:
        monkeypatch.setattr(criteo_mod, "_BLOCK_BYTES", block_bytes)
    rows = [_criteo_fields(i) for i in range(12)]
    lines = [r[1:] for r in rows]
    lines[5] = rows[5]  # one labeled line in a file without labels
    mixed = _write_lines(tmp_path / "mixed.txt", lines)
    clean = _write_lines(tmp_path / "clean.txt", [r[1:] for i, r in enumerate(rows) if i != 5])
    skip = _criteo_config(mixed, on_bad_line="skip")
    got = _scoring_read(skip, CRITEO_TABLES, [mixed])
    assert got.bad_lines is not None
    assert got.bad_lines.skipped == 1
    assert not has_labels(got)
    _assert_same_rows(_all_rows(got), _all_rows(_scoring_read(skip, CRITEO_TABLES, [clean])))
    blocks = list(criteo_mod.iter_criteo_blocks(mixed, on_bad_line="skip", require_labels=False))
    assert sum(b.rows for b in blocks) == 11
    assert all(not b.labeled and np.isnan(b.labels).all() for b in blocks)
    with pytest.raises(DataError) as e:
        _scoring_read(_criteo_config(mixed), CRITEO_TABLES, [mixed])
    assert str(e.value).startswith(f"{mixed}, line 6")
    assert "expected 39 tab-separated fields, got 40" in str(e.value)
    assert "\n" not in str(e.value)


def _mapped_rows(n: int) -> dict[str, list]:
    return {
        "click": [i % 2 for i in range(n)],
        "price": [round(0.25 * i - 1.5, 2) for i in range(n)],
        "age": [(i * 7) % 50 for i in range(n)],
        "site": [f"s{i % 9}" for i in range(n)],
        "device": [f"d{(i * 5) % 23}" for i in range(n)],
    }


def _write_csv(path: Path, columns: dict[str, list]) -> str:
    names = list(columns)
    lines = [",".join(names)]
    lines += [",".join(str(columns[c][i]) for c in names) for i in range(len(columns[names[0]]))]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _write_parquet(path: Path, columns: dict[str, list]) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


WRITERS = {DataSource.CSV: _write_csv, DataSource.PARQUET: _write_parquet}


@pytest.mark.parametrize("source", [DataSource.CSV, DataSource.PARQUET])
def test_file_without_the_label_column_reads_as_the_labeled_rows(tmp_path, source):
    """A csv or parquet file without ``data.label_column``, read for scoring, gives the
    rows of the same file with the column (and the columns in another order), labels
    NaN and ``has_labels`` false. Catches the missing column refused when scoring, the
    mapping read by position (dense values shifted into the label's place), or
    labels of 0 reported as present."""
    columns = _mapped_rows(25)
    write = WRITERS[source]
    ext = source.value
    labeled = write(tmp_path / f"a.{ext}", columns)
    without = {k: v for k, v in reversed(columns.items()) if k != "click"}
    unlabeled = write(tmp_path / f"b.{ext}", without)
    config = DataConfig(source=source, train_path=(labeled,), **MAPPING)
    want = _scoring_read(config, MAPPED_TABLES, [labeled])
    got = _scoring_read(config, MAPPED_TABLES, [unlabeled])
    assert has_labels(want)
    assert not has_labels(got)
    _assert_same_rows(_all_rows(got), _all_rows(want))
    assert np.isnan(_all_rows(got).labels.numpy()).all()
    np.testing.assert_array_equal(_all_rows(want).labels.numpy(), columns["click"])


@pytest.mark.parametrize("source", [DataSource.CRITEO, DataSource.CSV, DataSource.PARQUET])
def test_reading_files_with_and_without_labels_together_drops_every_label(tmp_path, source):
    """A labeled and an unlabeled file scored together: the dataset has no labels at all
    (every one NaN), not labels for some rows only. Catches a half-labeled dataset that
    says ``has_labels`` (metrics over the labeled half, or over NaN) or that keeps the
    labeled file's labels beside NaN."""
    if source == DataSource.CRITEO:
        rows = [_criteo_fields(i) for i in range(10)]
        labeled = _write_lines(tmp_path / "a.tsv", rows)
        unlabeled = _write_lines(tmp_path / "b.txt", [r[1:] for r in rows])
        config, tables = _criteo_config(labeled), CRITEO_TABLES
    else:
        columns = _mapped_rows(10)
        labeled = WRITERS[source](tmp_path / f"a.{source.value}", columns)
        without = {k: v for k, v in columns.items() if k != "click"}
        unlabeled = WRITERS[source](tmp_path / f"b.{source.value}", without)
        config = DataConfig(source=source, train_path=(labeled,), **MAPPING)
        tables = MAPPED_TABLES
    got = _scoring_read(config, tables, [labeled, unlabeled])
    assert got.num_samples == 20
    assert not has_labels(got)
    assert np.isnan(_all_rows(got).labels.numpy()).all()


def _unlabeled_inputs(tmp_path: Path) -> dict[DataSource, tuple[DataConfig, list, str]]:
    """Per source: a training config over a file without labels, its tables, the file."""
    criteo = _write_lines(tmp_path / "test.txt", [_criteo_fields(i)[1:] for i in range(30)])
    out = {DataSource.CRITEO: (_criteo_config(criteo), CRITEO_TABLES, criteo)}
    without = {k: v for k, v in _mapped_rows(30).items() if k != "click"}
    for source, write in WRITERS.items():
        path = write(tmp_path / f"train.{source.value}", without)
        out[source] = (
            DataConfig(source=source, train_path=(path,), **MAPPING),
            MAPPED_TABLES,
            path,
        )
    return out


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (DataSource.CRITEO, r"line 1, field fields: .*expected 40 tab-separated fields, got 39"),
        (DataSource.CSV, r"columns \['click'\] are not in the header line"),
        (DataSource.PARQUET, r"columns \['click'\] are not in the file"),
    ],
)
def test_training_on_files_without_labels_still_fails_with_one_line(tmp_path, source, message):
    """Training (``build_datasets``) and evaluation with labels required refuse a file
    without labels, one line naming the file and the label column (or the field count).
    Catches the scoring-only leniency leaking into training (a model trained on NaN or
    zero labels)."""
    config, tables, path = _unlabeled_inputs(tmp_path)[source]
    for read in (
        lambda: build_datasets(config, tables),
        lambda: _scoring_read(config, tables, [path], require_labels=True),
    ):
        with pytest.raises(DataError, match=message) as e:
            read()
        assert str(e.value).startswith(path)
        assert "\n" not in str(e.value)


def test_unlabeled_csv_under_skip_still_checks_the_other_columns(tmp_path):
    """Without the label column the other columns are still checked: a non-numeric
    dense value is a bad line, skipped and counted. Catches the label's absence
    turning off the per-column checks of the bad-line pass."""
    columns = {k: v for k, v in _mapped_rows(8).items() if k != "click"}
    columns["price"][3] = "cheap"
    path = _write_csv(tmp_path / "a.csv", columns)
    config = DataConfig(source="csv", train_path=(path,), on_bad_line=BadLinePolicy.SKIP, **MAPPING)
    got = _scoring_read(config, MAPPED_TABLES, [path])
    assert got.num_samples == 7
    assert got.bad_lines is not None
    assert got.bad_lines.skipped == 1
    assert not has_labels(got)
