"""The fitted dense transform travels with the checkpoint: resume and evaluation reuse it."""

import json
import logging
import math
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.data import (
    DataConfig,
    DataSource,
    DenseSpec,
    DenseTransform,
    ParquetDataset,
    TransformedDataset,
    build_datasets,
)
from tetrarec.data.build import LOADERS
from tetrarec.train import (
    build_parts,
    build_tables,
    evaluate,
    evaluate_checkpoint,
    latest_checkpoint,
    load_model_state,
    read_checkpoint,
    train,
)

ROWS, TRAIN = 320, 256


def write_data(path: Path, *, seed: int = 0, age_scale: float = 1.0, rows=ROWS) -> Path:
    """An age and a calendar year (very different scales) that drive the label."""
    rng = np.random.default_rng(seed)
    age = rng.integers(18, 90, rows).astype(float)
    year = rng.integers(1950, 2020, rows).astype(float)
    logit = (age - 50) / 15 - (year - 1985) / 20
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    age[:TRAIN] *= age_scale  # only the training rows change
    ids = rng.integers(0, 1000, (2, rows))
    pq.write_table(
        pa.table({"y": label, "age": age, "year": year, "c0": ids[0], "c1": ids[1]}), path
    )
    return path


def config(data: Path, ckpt: Path, *extra: str) -> RunConfig:
    return RunConfig().with_overrides(
        [
            "data.source=parquet",
            f"data.train_path={data}",
            "data.dense_columns=[age, year]",
            "data.sparse_columns=[c0, c1]",
            "data.label_column=y",
            f"data.train_rows=[0, {TRAIN}]",
            "data.dense_transform=standardize",
            "data.dense_clip=[-3, 3]",
            "data.batch_size=32",
            "data.eval_batch_size=64",
            "data.prefetch=1",
            "model.num_sparse=2",
            "model.dlrm.num_dense=2",
            "model.num_embeddings=[30, 30]",
            "model.dlrm.bottom_mlp=[8, 4]",
            "model.dlrm.top_mlp=[8, 1]",
            "optim.dense=adam",
            "optim.dense_lr=0.05",
            "train.progress=false",
            "train.deterministic=true",
            "train.log_every=0",
            f"train.checkpoint_dir={ckpt}",
            *extra,
        ]
    )


def test_resume_is_bitwise_and_the_checkpoint_holds_the_training_statistics(tmp_path) -> None:
    """Bugs caught: statistics missing from the checkpoint, or fitted on other rows than
    the training rows; a resumed run feeding other dense inputs than an uninterrupted one."""
    data = write_data(tmp_path / "d.parquet")
    straight = train(config(data, tmp_path / "a", "train.steps=6"))
    train(config(data, tmp_path / "b", "train.steps=3"))
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    resumed = train(config(data, tmp_path / "b", "train.steps=6"), resume=True)
    assert resumed.start_step == 3
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name
    assert resumed.final == straight.final
    saved = DenseTransform.from_dict(a.meta["dense_transform"])
    assert saved == DenseTransform.from_dict(b.meta["dense_transform"])
    table = pq.read_table(data)
    raw = np.stack([table["age"].to_numpy(), table["year"].to_numpy()], 1)[:TRAIN]
    np.testing.assert_allclose(saved.mean, raw.mean(0), rtol=1e-12)
    np.testing.assert_allclose(saved.std, raw.std(0), rtol=1e-12)
    assert saved.clip == ((-3.0, 3.0), (-3.0, 3.0))
    assert saved.columns == ("age", "year")


def strict_json(text: str) -> object:
    """``text`` parsed as strict JSON: ``NaN``/``Infinity`` refused, as JSON.parse does."""

    def refuse(token: str) -> object:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_an_open_clip_bound_and_a_nan_metric_are_strict_json_and_resume_bitwise(
    tmp_path,
) -> None:
    """Bug caught: ``dense_clip = [-inf, 3]`` was written as ``-Infinity`` in meta.json and
    the --json summary, and a NaN metric (the AUC of one evaluation row) as ``NaN``:
    neither is JSON, strict parsers refuse the files. The clip bound must still come back
    as -inf (a bitwise resume, ``tetrarec eval`` giving the run's metrics) and a NaN
    metric of the saved best evaluation as NaN; a checkpoint of the previous format
    (bare ``-Infinity`` and ``NaN``) still evaluates and resumes bitwise."""
    data = write_data(tmp_path / "d.parquet")
    run = (
        "data.dense_clip=[-inf, 3]",
        f"data.eval_rows=[{TRAIN}, {TRAIN + 1}]",  # one label: AUC and NE are NaN
        "train.eval_every=2",
        "train.keep_best=log_loss",
    )
    summary = tmp_path / "a.json"
    straight = train(config(data, tmp_path / "a", "train.steps=6", f"train.json={summary}", *run))
    assert math.isnan(straight.final.auc)
    written = strict_json(summary.read_text())
    assert written["final"]["auc"] is None
    assert written["best"]["ne"] is None
    assert written["config"]["data"]["dense_clip"] == ["-inf", 3.0]
    np.testing.assert_equal(
        evaluate_checkpoint(straight.checkpoint).to_dict(), straight.final.to_dict()
    )
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    assert DenseTransform.from_dict(a.meta["dense_transform"]).clip == ((-math.inf, 3.0),) * 2

    def old_format(meta: dict) -> dict:
        """``meta`` as the previous code wrote it: infinities as floats, NaN metrics."""
        meta = json.loads(json.dumps(meta).replace('"-inf"', "-Infinity"))
        metrics = meta["best"]["metrics"]
        metrics.update({k: math.nan for k, v in metrics.items() if v is None})
        return meta

    for ckpt, rewrite in ((tmp_path / "b", None), (tmp_path / "c", old_format)):
        first = train(config(data, ckpt, "train.steps=3", *run))
        meta_path = Path(first.checkpoint) / "meta.json"
        meta = strict_json(meta_path.read_text())
        assert meta["dense_transform"]["clip"] == [["-inf", 3.0], ["-inf", 3.0]]
        assert meta["best"]["metrics"]["auc"] is None
        if rewrite is not None:
            meta_path.write_text(json.dumps(rewrite(meta)))
            (meta_path.parent / "manifest.json").unlink()  # old checkpoints had none
            assert "-Infinity" in meta_path.read_text()
            assert "NaN" in meta_path.read_text()
        np.testing.assert_equal(
            evaluate_checkpoint(first.checkpoint).to_dict(), first.final.to_dict()
        )
        torch.manual_seed(1), np.random.seed(1), random.seed(1)
        resumed = train(config(data, ckpt, "train.steps=6", *run), resume=True)
        assert resumed.start_step == 3
        b = read_checkpoint(latest_checkpoint(ckpt))
        for name, tensor in a.tensors.items():
            assert torch.equal(tensor, b.tensors[name]), (ckpt.name, name)
        np.testing.assert_equal(resumed.to_dict()["best"], straight.to_dict()["best"])
        np.testing.assert_equal(resumed.final.to_dict(), straight.final.to_dict())


def test_resume_and_evaluation_use_the_saved_statistics_never_a_refit(tmp_path) -> None:
    """Bug caught: statistics refitted from whatever the data files hold now (here the
    training rows changed after the checkpoint; the evaluation rows did not)."""
    data = write_data(tmp_path / "d.parquet")
    result = train(config(data, tmp_path / "ck", "train.steps=3"))
    ckpt = result.checkpoint
    write_data(data, age_scale=3.0)  # same eval rows, other training rows
    cfg = config(data, tmp_path / "ck", "train.steps=3")
    refit, _ = build_datasets(cfg.data, build_tables(cfg.model))
    saved = DenseTransform.from_dict(read_checkpoint(ckpt).meta["dense_transform"])
    assert refit.transform != saved  # a refit would change the inputs
    assert evaluate_checkpoint(ckpt) == result.final
    resumed = train(cfg, resume=True)  # no step left: evaluates with the restored inputs
    assert resumed.start_step == 3
    assert resumed.final == result.final


def test_evaluating_a_runs_eval_path_split_reads_only_eval_path(tmp_path) -> None:
    """Bug caught: evaluating a checkpoint on its own split went through build_datasets,
    which parses every training file even when the rows come from data.eval_path (the
    dense statistics are the checkpoint's): slow for a big training set, and "input file
    not found" once the training file was moved away. The metrics are the run's, with
    data.eval_rows still selecting rows of eval_path, before and after the move."""
    data = write_data(tmp_path / "d.parquet")
    held = write_data(tmp_path / "held.parquet", seed=3, rows=100)
    run = (f"data.eval_path={held}", "data.eval_rows=[10, 90]", "train.steps=3")
    result = train(config(data, tmp_path / "ck", *run))
    assert evaluate_checkpoint(result.checkpoint) == result.final
    data.rename(tmp_path / "moved.parquet")
    assert evaluate_checkpoint(result.checkpoint) == result.final


def test_evaluate_checkpoint_on_other_data_applies_the_saved_statistics(tmp_path) -> None:
    """Bugs caught: evaluation data standardized with its own statistics (the other file
    has other means), or fed raw."""
    data = write_data(tmp_path / "d.parquet")
    result = train(config(data, tmp_path / "ck", "train.steps=3"))
    other = write_data(tmp_path / "other.parquet", seed=5, rows=100)
    # On the CPU, as the evaluation below it (on a GPU machine train.device resolves to
    # CUDA, whose sums differ in the last bits: the GPU check found the exact == failing).
    got = evaluate_checkpoint(result.checkpoint, data=[str(other)], overrides=["train.device=cpu"])
    cfg = config(data, tmp_path / "ck")
    parts = build_parts(cfg, num_dense=2)
    meta = load_model_state(result.checkpoint, parts.model)
    saved = DenseTransform.from_dict(meta["dense_transform"])
    raw = ParquetDataset(
        [other],
        dense_columns=("age", "year"),
        sparse_columns=("c0", "c1"),
        label_column="y",
        tables=build_tables(cfg.model),
    )
    with_saved = evaluate(parts.model, TransformedDataset(raw, saved), batch_size=64)
    assert got == with_saved
    own = DenseTransform.fit(
        raw, DenseSpec(columns=saved.columns, kinds=saved.kinds, clip=saved.clip)
    )
    assert got != evaluate(parts.model, TransformedDataset(raw, own), batch_size=64)


def test_checkpoint_without_saved_statistics_evaluates_with_the_source_default(
    tmp_path,
) -> None:
    """Checkpoints written before statistics were saved (their runs used the source's
    default transform) still evaluate, on their own split and on other files."""
    data = write_data(tmp_path / "d.parquet")
    result = train(
        config(data, tmp_path / "ck", "train.steps=2", "data.dense_transform=auto",
               "data.dense_clip=none")
    )  # fmt: skip
    meta_path = Path(result.checkpoint) / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta.pop("dense_transform")["kinds"] == ["none", "none"]
    meta_path.write_text(json.dumps(meta))
    (meta_path.parent / "manifest.json").unlink()  # old checkpoints had none
    assert evaluate_checkpoint(result.checkpoint) == result.final
    assert evaluate_checkpoint(result.checkpoint, data=[str(data)]).num_samples == ROWS


def test_dense_columns_reordered_since_the_fit_are_refused_renamed_ones_warned(
    tmp_path, caplog
) -> None:
    """Bug caught: the saved statistics applied by position whatever the mapping says
    now: evaluating (or resuming) with data.dense_columns = [year, age] standardized each
    year with the ages' mean and std, silently (AUC of a broken model, NE 9e34)."""
    data = write_data(tmp_path / "d.parquet")
    result = train(config(data, tmp_path / "ck", "train.steps=3"))
    swap = ["data.dense_columns=[year, age]"]
    with pytest.raises(ValueError, match=r"order \(year, age\).*fitted on \(age, year\)"):
        evaluate_checkpoint(result.checkpoint, data=[str(data)], overrides=swap)
    with pytest.raises(ValueError, match=r"order \(year, age\)"):  # the run's own split
        evaluate_checkpoint(result.checkpoint, overrides=swap)
    with pytest.raises(ValueError, match=r"order \(year, age\)"):
        train(config(data, tmp_path / "ck", "train.steps=6", *swap), resume=True)
    # The same columns under other names (a renamed file): evaluated by position, warned.
    renamed = tmp_path / "renamed.parquet"
    pq.write_table(pq.read_table(data).rename_columns(["y", "a", "yr", "c0", "c1"]), renamed)
    with caplog.at_level(logging.WARNING):
        got = evaluate_checkpoint(
            result.checkpoint, data=[str(renamed)], overrides=["data.dense_columns=[a, yr]"]
        )
    assert got == evaluate_checkpoint(result.checkpoint, data=[str(data)])
    assert "fitted on (age, year): applying it by position" in caplog.text


def test_a_binary_source_with_two_directories_is_refused(tmp_path) -> None:
    """Bug caught: `tetrarec eval --data DIR1 DIR2` with source binary evaluated DIR1 only,
    without a word (training already refused two directories)."""
    cfg = DataConfig(source="binary", train_path=(str(tmp_path),))
    with pytest.raises(ValueError, match=r"reads one directory.*got 2"):
        LOADERS[DataSource.BINARY]((str(tmp_path / "a"), str(tmp_path / "b")), cfg, [])
