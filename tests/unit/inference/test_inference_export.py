"""Export round trip in one process: a checkpoint's model, exported and loaded, scores
the run's evaluation split exactly as the run's own final evaluation did.

Each case is a way the training run can hold its tables (fused, the reference
collection, INT8 with a cached table, an SSD table, a first-order term): an export that
read one of them wrong (a cache's rows left out, the SSD file's rows not read, the
first-order tables dropped, INT8 rows taken as FP32) changes the metrics.
"""

import json

import pytest

from tetrarec.cli import main
from tetrarec.config import RunConfig
from tetrarec.inference import load
from tetrarec.inference.export import export_checkpoint
from tetrarec.inference.scoring import evaluate_model, model_dataset
from tetrarec.train import train

TINY = [
    "data.source=synthetic",
    "data.batch_size=64",
    "data.eval_batch_size=128",
    "data.prefetch=1",
    "data.synthetic.num_samples=1024",
    "data.synthetic.eval_samples=300",
    "model.num_sparse=3",
    "model.num_embeddings=[200, 50, 400]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.sparse.kind=rowwise_adagrad",
    "optim.sparse.lr=0.1",
    "train.steps=6",
    "train.eval_every=0",
    "train.progress=false",
    "train.deterministic=true",
]

CASES = {
    "fused": [],
    "reference": ["model.embedding=reference"],
    "int8_cached": [
        "model.precision=int8",
        "model.placement=[cached, host, cached]",
        "model.cache.fraction=0.2",
    ],
    "ssd": [
        "model.precision=int8",
        "model.placement=[host, ssd, host]",
        "model.cache.fraction=0.2",
    ],
    "first_order": ["model.dlrm.first_order=true"],
}


def _train(tmp_path, extra):
    config = RunConfig().with_overrides(
        [
            *TINY,
            *extra,
            f"model.cache.dir={tmp_path / 'ssd'}",
            f"train.checkpoint_dir={tmp_path / 'ck'}",
            "train.checkpoint_every=6",
        ]
    )
    result = train(config)
    assert result.final is not None
    assert result.checkpoint is not None
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_model_scores_the_eval_split_as_the_run_did(tmp_path, case):
    """FP32 metrics of the exported model equal the run's final evaluation (exact,
    checked to 1e-6). Catches an export that misreads any of the table layouts above,
    a dense transform not saved or applied, or dense layers put back wrong."""
    (tmp_path / "ssd").mkdir()
    result = _train(tmp_path, CASES[case])
    export_checkpoint(result.checkpoint, tmp_path / "model")
    model = load(tmp_path / "model")
    got = evaluate_model(model, model_dataset(model), batch_size=100)
    want = result.final
    assert got.num_samples == want.num_samples == 300
    for name in ("auc", "log_loss", "ne", "calibration"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), abs=1e-6), name
    assert got.auc == want.auc
    assert got.log_loss == want.log_loss


def test_export_command_prints_and_writes_its_summary(tmp_path, capsys):
    """``tetrarec export`` writes a model that loads, and its line and JSON say the
    tables, bytes, step and world size of what was written (a summary of another
    model, or figures that are not the file's, fails)."""
    result = _train(tmp_path, [])
    out, summary = tmp_path / "model", tmp_path / "export.json"
    argv = ["-q", "export", "--checkpoint", str(result.checkpoint), "--output", str(out)]
    assert main([*argv, "--no-progress", "--json", str(summary)]) == 0
    line = capsys.readouterr().out.strip()
    model = load(out)
    size = (out / "tensors.safetensors").stat().st_size
    assert line == f"exported 3 tables, {size:,} bytes -> {out} (step 6, world size 1)"
    values = json.loads(summary.read_text())
    assert values == {
        "output": str(out),
        "tables": 3,
        "bytes": size,
        "step": 6,
        "world_size": 1,
        "content_hash": model.manifest.content_hash,
    }


def test_export_of_a_missing_checkpoint_or_into_a_missing_directory_is_one_line(tmp_path, capsys):
    """A checkpoint that is not there, or an output whose parent directory is missing:
    exit 2 and one line naming the path (a traceback, or a run that read every table
    before failing to write, fails)."""
    assert main(["-q", "export", "--checkpoint", str(tmp_path / "no"), "--output", "m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("tetrarec export: error: ")
    assert str(tmp_path / "no") in err
    out = tmp_path / "missing" / "model"
    argv = ["-q", "export", "--checkpoint", str(tmp_path / "no"), "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{tmp_path / 'missing'} does not exist" in err
