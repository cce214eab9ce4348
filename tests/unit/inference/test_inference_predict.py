"""``tetrarec predict``: the scores it writes are the model's on the same rows, with the
row's index or id and (when the input has labels) the label beside them, and bad input
is one line naming it."""

import csv
import dataclasses
import gzip
import io
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tetrarec.cli import main
from tetrarec.config import RunConfig
from tetrarec.data import DataError
from tetrarec.inference import load
from tetrarec.inference.export import export_checkpoint
from tetrarec.inference.predict import PredictSettings, predict_files
from tetrarec.inference.scoring import evaluate_model, model_dataset
from tetrarec.train import train

COMMON = [
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.prefetch=1",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "train.steps=4",
    "train.epochs=none",
    "train.eval_every=0",
    "train.progress=false",
    "train.checkpoint_every=4",
]


def _criteo_lines(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        dense = [str(rng.randrange(0, 50)) if rng.random() > 0.1 else "" for _ in range(13)]
        cats = [f"{rng.randrange(0, 300):08x}" for _ in range(26)]
        lines.append("\t".join([str(rng.randrange(2)), *dense, *cats]))
    return lines


def _csv_rows(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [
        [f"row-{seed}-{i}", str(rng.randrange(2)), f"{rng.uniform(0, 9):.3f}", rng.choice("abcde"),
         rng.choice(["x", "y", "z", "w"]) + str(rng.randrange(20))]
        for i in range(n)
    ]  # fmt: skip


def _write_csv(path, rows, header=("id", "click", "price", "site", "device")) -> None:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(header)
    writer.writerows(rows)
    data = text.getvalue().encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def _export(tmp_path, overrides):
    result = train(RunConfig().with_overrides([*COMMON, *overrides]))
    export_checkpoint(result.checkpoint, tmp_path / "model")
    return tmp_path / "model"


@pytest.fixture(scope="module")
def criteo_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("criteo")
    (tmp / "train.tsv").write_text("\n".join(_criteo_lines(300, 0)) + "\n")
    return _export(
        tmp,
        [
            "data.source=criteo",
            f'data.train_path=["{tmp / "train.tsv"}"]',
            "model.num_sparse=26",
            "model.num_embeddings=60",
            "model.dlrm.num_dense=13",
            "model.dlrm.first_order=true",
            f"train.checkpoint_dir={tmp / 'ck'}",
        ],
    )


@pytest.fixture(scope="module")
def csv_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("csv")
    _write_csv(tmp / "train.csv", _csv_rows(300, 0))
    return _export(
        tmp,
        [
            "data.source=csv",
            f'data.train_path=["{tmp / "train.csv"}"]',
            'data.label_column="click"',
            'data.dense_columns=["price"]',
            'data.sparse_columns=["site", "device"]',
            "model.num_sparse=2",
            "model.num_embeddings=[10, 40]",
            "model.dlrm.num_dense=1",
            f"train.checkpoint_dir={tmp / 'ck'}",
        ],
    )


def _model_scores(model_dir, files, batch_size):
    """What ``InferenceModel.predict`` gives on the rows of ``files`` (read ``batch_size``
    at a time: a matrix product's sums depend on the batch's shape in the last bit)."""
    model = load(model_dir)
    ds = model_dataset(model, files)
    scores, labels = [], []
    for start in range(0, ds.num_samples, batch_size):
        batch = ds.read(np.arange(start, min(start + batch_size, ds.num_samples)))
        scores.append(model.predict(batch.dense, batch.sparse).numpy())
        labels.append(batch.labels.numpy())
    return np.concatenate(scores), np.concatenate(labels)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_predict_on_criteo_writes_the_models_scores_in_row_order(
    criteo_model, tmp_path, capsys, fmt
):
    """The written scores equal ``InferenceModel.predict`` on the same rows, with the
    0-based row index and the label; the batch size (7, not a divisor of 50) does not
    change them. Catches rows out of order, a batch dropped or repeated at the end,
    the dense transform not applied, labels or indices shifted between chunks, a CSV
    writer that rounds the scores."""
    data = tmp_path / "score.tsv"
    data.write_text("\n".join(_criteo_lines(50, 1)) + "\n")
    out = tmp_path / f"scores.{fmt}"
    argv = ["-q", "predict", "--model", str(criteo_model), "--input", str(data)]
    assert main([*argv, "--output", str(out), "--batch-size", "7", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"scored 50 rows -> {out} ({fmt})")
    scores, labels = _model_scores(criteo_model, [str(data)], 7)
    if fmt == "parquet":
        table = pq.read_table(out).to_pydict()
    else:
        with out.open() as f:
            table = {k: [float(x) for x in v] for k, v in _columns(csv.DictReader(f)).items()}
    assert list(table) == ["row", "score", "label"]
    assert table["row"] == list(range(50))
    np.testing.assert_array_equal(np.array(table["score"], dtype=np.float32), scores)
    np.testing.assert_array_equal(np.array(table["label"], dtype=np.float32), labels)


def _columns(reader):
    out: dict[str, list[str]] = {}
    for row in reader:
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return out


def test_predict_on_csv_with_string_ids_writes_the_id_column(csv_model, tmp_path):
    """A CSV whose sparse values are strings, scored with ``--id-column id`` over two
    files (the second gzipped): the ids are the input's, in order, beside
    ``InferenceModel.predict``'s scores. Catches ids not aligned with the rows, the
    second file's rows lost, a gzipped file's ids unread, string ids hashed otherwise
    than in training."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv.gz"
    rows_a, rows_b = _csv_rows(20, 1), _csv_rows(13, 2)
    _write_csv(a, rows_a)
    _write_csv(b, rows_b)
    summary = predict_files(
        load(csv_model),
        PredictSettings(
            files=(str(a), str(b)), output=tmp_path / "s.parquet", batch_size=8,
            id_column="id",
        ),
    )  # fmt: skip
    assert summary.rows == 33
    table = pq.read_table(tmp_path / "s.parquet").to_pydict()
    assert table["id"] == [r[0] for r in rows_a + rows_b]
    scores, _labels = _model_scores(csv_model, [str(a), str(b)], 8)
    np.testing.assert_array_equal(np.array(table["score"], dtype=np.float32), scores)
    assert table["label"] == [int(r[1]) for r in rows_a + rows_b]
    assert summary.mean_score == pytest.approx(float(scores.astype(np.float64).mean()))


def test_skip_bad_lines_drops_them_and_says_how_many(criteo_model, tmp_path, capsys):
    """``--on-bad-line skip`` overrides the model's ``error``: the bad line is left out,
    the other rows score as the model does, the summary counts it. Catches an override
    that is ignored (an error) or a bad line scored as a row."""
    lines = _criteo_lines(10, 3)
    lines.insert(4, "1\tnot a line")
    data = tmp_path / "bad.tsv"
    data.write_text("\n".join(lines) + "\n")
    out, summary = tmp_path / "s.csv", tmp_path / "s.json"
    argv = ["-q", "predict", "--model", str(criteo_model), "--input", str(data), "--no-progress"]
    assert main([*argv, "--output", str(out), "--on-bad-line", "skip", "--json", str(summary)]) == 0
    assert "skipped 1 bad lines" in capsys.readouterr().out
    values = json.loads(summary.read_text())
    assert values["rows"] == 10
    assert values["bad_lines"]["skipped"] == 1
    with out.open() as f:
        assert len(list(csv.DictReader(f))) == 10


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("tetrarec predict: error: ")
    return err


def test_bad_line_under_error_names_file_line_and_field(criteo_model, tmp_path, capsys):
    """The model's own rule (``error``): one line naming the file and line; no output
    file is left behind (a half-written output that looks complete fails)."""
    lines = _criteo_lines(5, 3)
    lines[2] = lines[2].replace("\t", "\tx", 1)  # label "0x" or "1x"
    data = tmp_path / "bad.tsv"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "s.parquet"
    argv = ["-q", "predict", "--model", str(criteo_model), "--input", str(data)]
    err = _one_line_error(capsys, [*argv, "--output", str(out)])
    assert f"{data}, line 3" in err
    assert list(tmp_path.iterdir()) == [data]


def test_csv_missing_a_column_the_model_needs_names_it_and_the_file(csv_model, tmp_path, capsys):
    """A CSV without the ``device`` column: one line naming the column and the file
    (a KeyError traceback from deep in the reader fails)."""
    data = tmp_path / "nodevice.csv"
    _write_csv(data, [r[:4] for r in _csv_rows(5, 1)], header=("id", "click", "price", "site"))
    argv = ["-q", "predict", "--model", str(csv_model), "--input", str(data)]
    err = _one_line_error(capsys, [*argv, "--output", str(tmp_path / "s.parquet")])
    assert str(data) in err
    assert "device" in err


def test_missing_input_and_missing_output_directory_are_one_line(csv_model, tmp_path, capsys):
    """A missing input file, an output in a directory that does not exist, an id column
    the input lacks: each one line naming it, exit 2, before any scoring."""
    data = tmp_path / "a.csv"
    _write_csv(data, _csv_rows(5, 1))
    base = ["-q", "predict", "--model", str(csv_model)]
    err = _one_line_error(
        capsys, [*base, "--input", str(tmp_path / "no.csv"), "--output", str(tmp_path / "s.csv")]
    )
    assert f"not found: {tmp_path / 'no.csv'}" in err
    out = tmp_path / "nodir" / "s.csv"
    err = _one_line_error(capsys, [*base, "--input", str(data), "--output", str(out)])
    assert f"directory '{tmp_path / 'nodir'}' does not exist" in err
    argv = [*base, "--input", str(data), "--output", str(tmp_path / "s.csv"), "--id-column", "uid"]
    err = _one_line_error(capsys, argv)
    assert "'uid'" in err
    assert str(data) in err
    err = _one_line_error(capsys, [*base, "--input", str(data), "--output", str(tmp_path / "s.x")])
    assert "--format" in err


def test_scores_do_not_depend_on_the_batch_size(criteo_model, tmp_path):
    """Batch 1 and batch 64 give the same scores (a model whose output depended on the
    other rows of its batch, e.g. a layer left in training mode, fails)."""
    data = tmp_path / "s.tsv"
    data.write_text("\n".join(_criteo_lines(9, 5)) + "\n")
    model = load(criteo_model)
    got = []
    for size in (1, 64):
        out = tmp_path / f"b{size}.parquet"
        predict_files(model, PredictSettings(files=(str(data),), output=out, batch_size=size))
        got.append(torch.tensor(pq.read_table(out).column("score").to_pylist()))
    torch.testing.assert_close(got[0], got[1], rtol=1e-6, atol=1e-7)


def test_parquet_input_with_source_override_scores_as_the_same_csv_rows(csv_model, tmp_path):
    """The csv model scores a parquet file of the same rows (``--source parquet``, string
    ids, an id column) exactly as it scores the csv. Catches ``--source`` ignored (the
    parquet file read as csv fails) and parquet ids not written."""
    rows = _csv_rows(17, 4)
    _write_csv(tmp_path / "a.csv", rows)
    pq.write_table(
        pa.table(
            {
                "id": [r[0] for r in rows],
                "click": [int(r[1]) for r in rows],
                "price": [float(r[2]) for r in rows],
                "site": [r[3] for r in rows],
                "device": [r[4] for r in rows],
            }
        ),
        tmp_path / "a.parquet",
    )
    model = load(csv_model)
    for name, source in (("a.csv", None), ("a.parquet", "parquet")):
        settings = PredictSettings(
            files=(str(tmp_path / name),), output=tmp_path / f"{name}.out.parquet",
            source=source, id_column="id",
        )  # fmt: skip
        predict_files(model, settings)
    via_csv = pq.read_table(tmp_path / "a.csv.out.parquet").to_pydict()
    via_parquet = pq.read_table(tmp_path / "a.parquet.out.parquet").to_pydict()
    assert via_parquet["id"] == [r[0] for r in rows]
    assert via_parquet == via_csv


def test_a_model_of_synthetic_data_asks_for_a_source(criteo_model, tmp_path):
    """A model trained on synthetic data has no file source: the error says to give
    ``--source`` (not ``data.source``, a key the predict user cannot set)."""
    model = load(criteo_model)
    model = dataclasses.replace(
        model, config=model.config.with_overrides(["data.source=synthetic"])
    )
    data = tmp_path / "a.tsv"
    data.write_text("\n".join(_criteo_lines(3, 1)) + "\n")
    settings = PredictSettings(files=(str(data),), output=tmp_path / "s.csv")
    with pytest.raises(
        ValueError, match=r"data.source is 'synthetic', which reads no files: give --source"
    ):
        predict_files(model, settings)
    scored = predict_files(model, dataclasses.replace(settings, source="criteo"))
    assert scored.rows == 3


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_criteo_test_txt_without_labels_scores_as_the_labeled_rows(
    criteo_model, tmp_path, capsys, fmt
):
    """Criteo's ``test.txt`` layout (39 fields, no label) is scored: the same scores as
    the same lines with a label in front, and no ``label`` column (the JSON summary says
    ``labeled: false``). Catches the file refused for its field count, fields shifted by
    one (I1 read as the label), or a made-up label column written."""
    lines = _criteo_lines(23, 6)
    labeled, unlabeled = tmp_path / "train.tsv", tmp_path / "test.txt"
    labeled.write_text("\n".join(lines) + "\n")
    unlabeled.write_text("\n".join(line.split("\t", 1)[1] for line in lines) + "\n")
    model = load(criteo_model)
    want = tmp_path / "want.parquet"
    predict_files(model, PredictSettings(files=(str(labeled),), output=want, batch_size=5))
    out, summary = tmp_path / f"scores.{fmt}", tmp_path / "s.json"
    argv = ["-q", "predict", "--model", str(criteo_model), "--input", str(unlabeled)]
    argv += ["--output", str(out), "--batch-size", "5", "--no-progress", "--json", str(summary)]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith(f"scored 23 rows -> {out}")
    if fmt == "parquet":
        table = pq.read_table(out).to_pydict()
    else:
        with out.open() as f:
            table = {k: [float(x) for x in v] for k, v in _columns(csv.DictReader(f)).items()}
    assert list(table) == ["row", "score"]
    assert table["row"] == list(range(23))
    np.testing.assert_array_equal(
        np.array(table["score"], dtype=np.float32),
        np.array(pq.read_table(want).column("score").to_pylist(), dtype=np.float32),
    )
    assert json.loads(summary.read_text())["labeled"] is False
    assert list(pq.read_table(want).column_names) == ["row", "score", "label"]


def _without(columns: tuple[str, ...], drop: str) -> tuple[list[int], tuple[str, ...]]:
    keep = [i for i, c in enumerate(columns) if c != drop]
    return keep, tuple(columns[i] for i in keep)


@pytest.mark.parametrize("source", ["csv", "parquet"])
def test_csv_and_parquet_without_the_label_column_score_as_the_labeled_rows(
    csv_model, tmp_path, source
):
    """A csv (or, with ``--source parquet``, a parquet) file of requests without the
    ``click`` column: the ids and scores of the same rows with the column, and no
    ``label`` column. Catches the file refused for the missing label, the columns read
    by position once one is gone, or labels of 0 written for rows that have none."""
    header = ("id", "click", "price", "site", "device")
    rows = _csv_rows(19, 7)
    keep, names = _without(header, "click")
    unlabeled_rows = [[r[i] for i in keep] for r in rows]
    labeled = tmp_path / "labeled.csv"
    _write_csv(labeled, rows)
    if source == "csv":
        unlabeled = tmp_path / "requests.csv.gz"
        _write_csv(unlabeled, unlabeled_rows, header=names)
    else:
        unlabeled = tmp_path / "requests.parquet"
        pq.write_table(
            pa.table(
                {
                    "id": [r[0] for r in unlabeled_rows],
                    "price": [float(r[1]) for r in unlabeled_rows],
                    "site": [r[2] for r in unlabeled_rows],
                    "device": [r[3] for r in unlabeled_rows],
                }
            ),
            unlabeled,
        )
    model = load(csv_model)
    settings = PredictSettings(
        files=(str(labeled),), output=tmp_path / "want.parquet", batch_size=6, id_column="id"
    )
    predict_files(model, settings)
    summary = predict_files(
        model,
        dataclasses.replace(
            settings,
            files=(str(unlabeled),),
            output=tmp_path / "got.parquet",
            source=None if source == "csv" else "parquet",
        ),
    )
    assert summary.rows == 19
    assert not summary.labeled
    want = pq.read_table(tmp_path / "want.parquet").to_pydict()
    got = pq.read_table(tmp_path / "got.parquet").to_pydict()
    assert list(got) == ["id", "score"]
    assert got == {"id": want["id"], "score": want["score"]}
    assert want["label"] == [int(r[1]) for r in rows]


def test_metrics_on_input_without_labels_refuse(csv_model, tmp_path):
    """``evaluate_model`` over rows read without labels is a clear error, never metrics
    over NaN or made-up labels; reading the file with labels required (how metrics
    ask for data) names the missing column and the file. Catches a scoring dataset
    whose NaN labels reach the metrics, or the leniency becoming the default."""
    data = tmp_path / "requests.csv"
    keep, names = _without(("id", "click", "price", "site", "device"), "click")
    _write_csv(data, [[r[i] for i in keep] for r in _csv_rows(6, 8)], header=names)
    model = load(csv_model)
    unlabeled = model_dataset(model, [str(data)], require_labels=False)
    with pytest.raises(ValueError, match="cannot compute metrics: the input has no labels"):
        evaluate_model(model, unlabeled)
    with pytest.raises(DataError, match=r"columns \['click'\] are not in the header line"):
        model_dataset(model, [str(data)])
