import json
import logging
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.testing.checkpoint_crash import reseal
from tetrarec.train import (
    NonFiniteLossError,
    evaluate_checkpoint,
    latest_checkpoint,
    read_checkpoint,
    train,
)
from tetrarec.train.checkpoint import best_checkpoint, list_checkpoints
from tetrarec.train.metrics import CALIBRATION_BOUNDS

TINY = [
    "data.source=synthetic",
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.prefetch=1",
    "data.synthetic.num_samples=128",  # 4 batches per epoch: runs cross epochs
    "data.synthetic.eval_samples=96",
    "model.num_sparse=4",
    "model.num_embeddings=[50, 20, 7, 100]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.dense_lr=0.05",
    "optim.sparse.lr=0.1",
    "optim.warmup_steps=2",
    "optim.decay=cosine",
    "optim.decay_start=3",
    "optim.decay_steps=4",
    "train.progress=false",
    "train.deterministic=true",
    "train.log_every=0",
]


def tiny(tmp_path, *extra: str) -> RunConfig:
    return RunConfig().with_overrides([*TINY, f"train.checkpoint_dir={tmp_path}", *extra])


def _scramble_global_rngs() -> None:
    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)


EMBEDDING_CASES = [
    ("reference", "rowwise_adagrad"),
    ("reference", "adagrad"),
    ("reference", "adam"),
    ("reference", "sgd"),
    ("fused", "rowwise_adagrad"),
    ("fused", "adam"),
    ("fused", "rowwise_adam"),
    # no per-table state: the checkpoint named no table and every resume was refused
    ("fused", "sgd"),
]


@pytest.mark.parametrize("interrupt_at", [1, 5])
@pytest.mark.parametrize(("embedding", "sparse_kind"), EMBEDDING_CASES)
def test_resumed_run_equals_uninterrupted_run_bitwise(
    tmp_path, embedding, sparse_kind, interrupt_at
) -> None:
    base = [f"model.embedding={embedding}", f"optim.sparse.kind={sparse_kind}", "optim.dense=adam"]
    straight = train(tiny(tmp_path / "a", *base, "train.steps=7"))
    train(tiny(tmp_path / "b", *base, f"train.steps={interrupt_at}"))
    _scramble_global_rngs()  # a fresh process would start from other RNG states
    resumed = train(tiny(tmp_path / "b", *base, "train.steps=7"), resume=True)
    assert resumed.start_step == interrupt_at
    assert resumed.steps == straight.steps == 7
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert a.step == b.step == 7
    assert sorted(a.tensors) == sorted(b.tensors)
    # optimizer state is in the file: the sparse optimizer's, or the fused module's own
    has_state = any(k.startswith(("sparse_optim.", "embedding.state")) for k in a.tensors)
    assert has_state == (sparse_kind != "sgd")
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name
    assert a.meta["dense_optim"] == b.meta["dense_optim"]
    assert a.meta.get("sparse_optim") == b.meta.get("sparse_optim")
    assert resumed.final == straight.final


# Optimizer settings other than the learning rates, changed from TINY's defaults.
NEW_SETTINGS = [
    "optim.dense_weight_decay=0.5",
    "optim.dense_eps=0.1",
    "optim.sparse.weight_decay=0.5",
    "optim.sparse.eps=0.1",
]


@pytest.mark.parametrize(
    ("embedding", "sparse_kind", "betas"),
    [("reference", "rowwise_adagrad", []), ("fused", "adam", ["optim.sparse.beta1=0.5"])],
)
def test_a_resume_takes_the_optimizer_settings_from_its_config(
    tmp_path, embedding, sparse_kind, betas
) -> None:
    """The checkpoint gives a resume its optimizers' state, the config their settings.
    A run interrupted with its checkpoint's settings rewritten to other values resumes
    bitwise as if never interrupted, and a run resumed with changed settings holds and
    records them. Bug caught: loading the optimizer state copied the saved weight decay,
    eps and betas over the config's (dense, reference sparse and fused), so a changed
    setting was silently ignored while the new checkpoints' config recorded it."""
    old = [f"model.embedding={embedding}", f"optim.sparse.kind={sparse_kind}", "optim.dense=adam"]
    new = [*old, *NEW_SETTINGS, *betas]
    straight = train(tiny(tmp_path / "a", *new, "train.steps=5"))
    train(tiny(tmp_path / "b", *new, "train.steps=2"))
    train(tiny(tmp_path / "c", *old, "train.steps=2"))
    # b's checkpoint as if written with the old settings (its state is the new run's)
    old_meta = json.loads((latest_checkpoint(tmp_path / "c") / "meta.json").read_text())
    meta_path = latest_checkpoint(tmp_path / "b") / "meta.json"
    meta = json.loads(meta_path.read_text())
    for optim in ("dense_optim", "sparse_optim"):
        assert meta[optim]["param_groups"] != old_meta[optim]["param_groups"]
        meta[optim]["param_groups"] = old_meta[optim]["param_groups"]
    meta_path.write_text(json.dumps(meta))
    reseal(meta_path.parent)  # an edit on purpose: past the manifest's check
    _scramble_global_rngs()
    resumed = train(tiny(tmp_path / "b", *new, "train.steps=5"), resume=True)
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name
    assert a.meta["dense_optim"] == b.meta["dense_optim"]
    assert a.meta["sparse_optim"] == b.meta["sparse_optim"]
    assert resumed.final == straight.final
    # the old run resumed with the new settings: its optimizers hold and save them
    train(tiny(tmp_path / "c", *new, "train.steps=3"), resume=True)
    c = read_checkpoint(latest_checkpoint(tmp_path / "c"))
    (dense,) = c.meta["dense_optim"]["param_groups"]
    assert (dense["weight_decay"], dense["eps"]) == (0.5, 0.1)
    (sparse,) = c.meta["sparse_optim"]["param_groups"]
    assert (sparse["weight_decay"], sparse["eps"]) == (0.5, 0.1)
    if betas:
        assert sparse["betas"][0] == 0.5


def test_evals_checkpoints_pruning_and_json_summary(tmp_path) -> None:
    out = tmp_path / "summary.json"
    result = train(
        tiny(
            tmp_path / "ck",
            "train.steps=5",
            "train.eval_every=2",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=2",
            f"train.json={out}",
        )
    )
    assert [s for s, _ in result.evals] == [2, 4, 5]
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_00000004", "step_00000005"]
    summary = json.loads(out.read_text())
    assert summary["steps"] == 5
    assert summary["samples_per_s"] > 0
    assert set(summary["final"]) >= {"auc", "ne", "log_loss", "calibration", "accuracy"}
    assert summary["final"] == result.final.to_dict()
    assert summary["config"]["train"]["steps"] == 5
    # the checkpoint alone rebuilds the model and gives the same final metrics
    assert evaluate_checkpoint(result.checkpoint) == result.final


def test_non_finite_loss_stops_names_the_step_and_keeps_last_good_checkpoint(tmp_path) -> None:
    # SGD at lr 1e30 blows the weights up after step 1; step 2's loss is not finite.
    config = tiny(
        tmp_path,
        "optim.dense=sgd",
        "optim.dense_lr=1e30",
        "optim.warmup_steps=0",
        "optim.decay=none",
        "train.steps=10",
        "train.checkpoint_every=1",
    )
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(\w+\) at step (\d+)") as e:
        train(config)
    step = e.value.step
    assert step >= 2
    assert f"at step {step};" in str(e.value)
    last = latest_checkpoint(tmp_path)
    assert e.value.checkpoint == last
    assert last.name == f"step_{step - 1:08d}"
    data = read_checkpoint(last)
    assert all(bool(t.isfinite().all()) for t in data.tensors.values() if t.is_floating_point())


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path) -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(ValueError, match="tensorboard_dir is set but TensorBoard is not installed"):
        train(tiny(tmp_path, "train.steps=1", f"train.tensorboard_dir={tmp_path}/tb"))
    # Checked before anything is built (bug caught: checked by rank 0 alone, last, while
    # the other ranks went on into a collective and failed there with a misleading
    # timeout): data that does not exist is not reached.
    with pytest.raises(ValueError, match="TensorBoard is not installed"):
        train(
            tiny(tmp_path, "train.steps=1", f"train.tensorboard_dir={tmp_path}/tb").with_overrides(
                [
                    "data.source=csv",
                    f"data.train_path={tmp_path}/nope.csv",
                    "data.sparse_columns=[a]",
                ]
            )
        )


def test_settings_that_cannot_work_fail_before_training(tmp_path) -> None:
    # (a resume with no checkpoint yet starts from step 0: test_train_checkpoint_manifest.py)
    # a resume at another batch size would start from the wrong row (the data position
    # counts batches), silently
    train(tiny(tmp_path / "b", "train.steps=2"))
    with pytest.raises(ValueError, match=r"trained with data\.batch_size=32, this run has 16"):
        train(tiny(tmp_path / "b", "train.steps=4", "data.batch_size=16"), resume=True)
    # a summary path that is a directory fails before training, not after it
    with pytest.raises(ValueError, match=r"train\.json=.* is a directory"):
        train(tiny(tmp_path / "c", "train.steps=1", f"train.json={tmp_path}"))
    (tmp_path / "afile").write_text("")  # once "[Errno 17] File exists", naming no key
    # a summary under a file failed the same way, after the whole run
    with pytest.raises(ValueError, match=r"train\.json=.*afile/s\.json'.*afile' is a file"):
        train(tiny(tmp_path / "e", "train.steps=1", f"train.json={tmp_path / 'afile' / 's.json'}"))
    with pytest.raises(ValueError, match=r"train\.checkpoint_dir=.*afile' is a file"):
        train(tiny(tmp_path / "afile", "train.steps=1"))
    with pytest.raises(ValueError, match=r"model\.cache\.dir=.*afile' is a file"):
        train(tiny(tmp_path / "d", "train.steps=1", f"model.cache.dir={tmp_path / 'afile'}"))
    with pytest.raises(ValueError, match=r"13 dense features but model\.dlrm\.num_dense is 5"):
        train(tiny(tmp_path, "train.steps=1", "model.dlrm.num_dense=5"))


@pytest.mark.parametrize(
    ("key", "was", "now"),
    [
        ("optim.dense", "adagrad", "adam"),
        ("optim.dense", "adam", "adagrad"),
        ("optim.dense", "sgd", "adam"),
        ("optim.sparse.kind", "adagrad", "rowwise_adagrad"),
        ("optim.sparse.kind", "rowwise_adagrad", "adam"),
        ("optim.sparse.kind", "sgd", "adagrad"),
    ],
)
def test_a_resume_with_another_optimizer_kind_is_refused_before_any_step(
    tmp_path, key, was, now
) -> None:
    """The saved optimizer state is its kind's (sums, moments, none). Bugs caught: a
    dense optimizer switched on resume failed at the first step with a raw KeyError
    ('betas', 'sum', 'exp_avg'), the reference embedding's one with a KeyError or a
    shape error from torch, and a switch from SGD silently started the new optimizer's
    state afresh."""
    reference = "model.embedding=reference"
    train(tiny(tmp_path, reference, f"{key}={was}", "train.steps=2"))
    message = (
        f"resume: {latest_checkpoint(tmp_path)} was trained with {key}={was!r}, this run has "
        f"{now!r}: its optimizer state is that optimizer's, so resume with {key}={was!r} "
        "(or start a new run)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        train(tiny(tmp_path, reference, f"{key}={now}", "train.steps=3"), resume=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]


def test_loss_goes_down_and_metrics_are_sane(tmp_path) -> None:
    result = train(
        tiny(tmp_path, "train.steps=12", "train.eval_every=4", "data.synthetic.num_samples=2048")
    )
    first, last = result.evals[0][1], result.evals[-1][1]
    assert last.log_loss < first.log_loss
    assert 0.0 <= last.accuracy <= 1.0
    assert math.isfinite(last.ne)


def test_resume_with_another_model_shape_is_a_clear_error(tmp_path) -> None:
    train(tiny(tmp_path, "train.steps=1"))
    with pytest.raises(ValueError, match="checkpoint does not fit the model"):
        train(tiny(tmp_path, "train.steps=2", "model.num_embeddings=[50, 20, 7, 101]"), resume=True)
    with pytest.raises(ValueError, match=r"past train\.steps=0"):
        train(tiny(tmp_path, "train.steps=0"), resume=True)


@pytest.mark.parametrize(
    ("precision", "sparse_kind"),
    [("int8", "rowwise_adagrad"), ("fp16", "adam")],
)
def test_low_precision_rows_resume_bitwise(tmp_path, precision, sparse_kind) -> None:
    """Low-precision rows with stochastic rounding (the fused module's default) end to
    end: 6 steps straight equal 3 steps, a resume, and 3 more, bit for bit, in the
    packed rows, their scale/bias, the optimizer state and the rounding stream. A
    resume that restarted the rounding stream, or re-quantized rows from a dequantized
    copy, would round the next updates differently and fail here."""
    base = [
        "model.embedding=fused",
        f"model.precision={precision}",
        f"optim.sparse.kind={sparse_kind}",
        "optim.dense=adam",
    ]
    straight = train(tiny(tmp_path / "a", *base, "train.steps=6"))
    train(tiny(tmp_path / "b", *base, "train.steps=3"))
    _scramble_global_rngs()
    resumed = train(tiny(tmp_path / "b", *base, "train.steps=6"), resume=True)
    assert resumed.start_step == 3
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert a.step == b.step == 6
    assert sorted(a.tensors) == sorted(b.tensors)
    rows = [t for k, t in a.tensors.items() if k.startswith("embedding.") and "weights" in k]
    # the rows really are stored in the low precision (not FP32 rows that were cast)
    expect = {"int8": torch.uint8, "fp16": torch.float16}[precision]
    assert {t.dtype for t in rows} == {expect}, sorted(a.tensors)
    assert int(a.tensors["embedding.rounding"][1]) == 6  # one rounding stream step per step
    # the rows and states first, the stream position last: the rows are what rounding hits
    for name in sorted(a.tensors, key=lambda k: k == "embedding.rounding"):
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert resumed.final == straight.final


# keep_best, early stopping, epochs, dropout: tiny runs with an evaluation every step.
# With TINY's schedule (cosine decay to 0 at step 7) the eval AUC peaks mid-run.
EVERY_STEP = ["train.threads=1", "train.eval_every=1", "train.keep_best=auc"]


def _expected_best(evals) -> tuple[int, int]:
    """(best step, evaluations since it) by AUC, first of equals, computed plainly."""
    best_step, best_auc, since = None, None, 0
    for step, m in evals:
        if best_auc is None or m.auc > best_auc:
            best_step, best_auc, since = step, m.auc, 0
        else:
            since += 1
    return best_step, since


def test_keep_best_checkpoints_the_best_step_and_keeps_it(tmp_path, caplog) -> None:
    """The best evaluation's step is the one reported, checkpointed, linked as
    ``best`` and kept although ``keep_checkpoints=1`` prunes every other old one;
    ``tetrarec eval`` of the link gives the best metrics. Bugs caught: the last or
    the first evaluation reported as best, the best checkpoint pruned, the link at
    another step, the summary without the best, and no calibration warning (or one
    in the wrong direction) for a miscalibrated evaluation."""
    out = tmp_path / "summary.json"
    ck = tmp_path / "ck"
    caplog.set_level(logging.INFO, logger="tetrarec.train.loop")
    result = train(
        tiny(
            ck,
            *EVERY_STEP,
            "train.steps=8",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=1",
            f"train.json={out}",
        )
    )
    assert [s for s, _ in result.evals] == list(range(1, 9))
    step, since = _expected_best(result.evals)
    assert 1 < step < 8, "the test needs a best evaluation in the middle of the run"
    assert (result.best.step, result.best.since) == (step, since)
    assert result.best.metrics == dict(result.evals)[step]
    assert [p.name for p in list_checkpoints(ck)] == [f"step_{step:08d}", "step_00000008"]
    assert best_checkpoint(ck) == ck / f"step_{step:08d}"
    assert result.best_checkpoint == str(ck / f"step_{step:08d}")
    assert evaluate_checkpoint(ck / "best") == result.best.metrics
    assert read_checkpoint(ck / "best").meta["best"]["step"] == step
    summary = json.loads(out.read_text())
    assert summary["best"] == {"metric": "auc", "step": step, **result.best.metrics.to_dict()}
    assert summary["best_checkpoint"] == result.best_checkpoint
    assert summary["stopped_early"] is False
    # calibration: a warning, with its direction, exactly for the evaluations outside
    warned = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    outside = 0
    for s, m in result.evals:
        note = [w for w in warned if w.startswith(f"eval at step {s}: miscalibrated")]
        low, high = CALIBRATION_BOUNDS
        if low <= m.calibration <= high:
            assert note == []
        else:
            outside += 1
            word = "over-predicts" if m.calibration > high else "under-predicts"
            assert len(note) == 1
            assert word in note[0]
    assert outside > 0, "the test needs a miscalibrated evaluation"


def test_a_fresh_run_in_a_used_checkpoint_dir_is_refused_or_starts_over(tmp_path) -> None:
    """A second run without ``--resume`` in a directory where a longer run left
    checkpoints. Bugs caught: the new run's checkpoints pruned as older than the earlier
    run's (its best then fails to link, or a resume picks the earlier run's newest), the
    earlier run's checkpoints silently deleted without ``overwrite_checkpoints``, and a
    ``best`` link left at the earlier run's step."""
    ck = tmp_path / "ck"
    first = [*EVERY_STEP, "train.checkpoint_every=1", "train.keep_checkpoints=1"]
    train(tiny(ck, *first, "train.steps=8"))
    before = [p.name for p in list_checkpoints(ck)]
    refused = r"holds an earlier run's checkpoints \(newest: step_00000008\)"
    with pytest.raises(ValueError, match=refused):
        train(tiny(ck, *first, "train.steps=3"))
    assert [p.name for p in list_checkpoints(ck)] == before  # nothing deleted
    again = train(tiny(ck, *first, "train.steps=3", "train.overwrite_checkpoints=true"))
    step, _ = _expected_best(again.evals)
    names = sorted({f"step_{step:08d}", "step_00000003"})
    assert [p.name for p in list_checkpoints(ck)] == names
    assert best_checkpoint(ck) == ck / f"step_{step:08d}"
    assert latest_checkpoint(ck).name == "step_00000003"


def test_keep_best_without_a_finite_metric_warns_and_links_nothing(tmp_path, caplog) -> None:
    """Evaluation rows of one label have no AUC. Bugs caught: a ``nan`` taken as the
    best (a ``best`` link to it), a log line naming a best "step None", and a run that
    ends with no best without saying so."""
    ck = tmp_path / "ck"
    caplog.set_level(logging.INFO, logger="tetrarec.train.loop")
    result = train(tiny(ck, *EVERY_STEP, "train.steps=3", "data.synthetic.target_ctr=1e-9"))
    assert all(math.isnan(m.auc) for _, m in result.evals)
    assert result.best.step is None
    assert result.best_checkpoint is None
    assert best_checkpoint(ck) is None
    messages = [r.getMessage() for r in caplog.records]
    assert not any("None" in m for m in messages)
    assert "no evaluation with a finite auc yet (2 so far)" in messages
    assert any("no evaluation had a finite auc" in m for m in messages)


def test_resume_with_no_best_yet_continues_and_still_reports_no_best(tmp_path, caplog) -> None:
    """A ``keep_best`` run whose every evaluation was ``nan`` (no best yet), resumed.
    Bug caught: the resume crashed formatting the saved best's step, ``None``, into a
    checkpoint name (``TypeError: unsupported format string passed to
    NoneType.__format__``)."""
    ck = tmp_path / "ck"
    one_label = [*EVERY_STEP, "data.synthetic.target_ctr=1e-9"]
    train(tiny(ck, *one_label, "train.steps=2"))
    caplog.set_level(logging.INFO, logger="tetrarec.train.loop")
    resumed = train(tiny(ck, *one_label, "train.steps=4"), resume=True)
    assert (resumed.start_step, resumed.steps) == (2, 4)
    assert (resumed.best.step, resumed.best.metrics, resumed.best.since) == (None, None, 4)
    assert resumed.best_checkpoint is None
    assert best_checkpoint(ck) is None
    assert resumed.to_dict()["best"] is None
    assert any("no evaluation had a finite auc" in r.getMessage() for r in caplog.records)


def test_a_cached_checkpoint_into_an_uncached_model_is_refused_by_name(tmp_path) -> None:
    """Evaluating (or resuming) a cached run's checkpoint with ``model.placement`` changed
    to ``host``: one sentence naming the tables and the setting (it was torch's list of
    "Unexpected key(s) ... cache.C1.counters ..." for every table)."""
    cached = ["model.placement=cached", "model.cache.fraction=0.5", "train.steps=2"]
    result = train(tiny(tmp_path / "ck", *cached))
    assert evaluate_checkpoint(result.checkpoint) == result.final
    with pytest.raises(ValueError, match=r"tables C1, C2, C3, C4 were saved cached") as e:
        evaluate_checkpoint(result.checkpoint, overrides=["model.placement=host"])
    assert "give model.placement the checkpoint's value" in str(e.value)
    assert "Unexpected" not in str(e.value)


@pytest.mark.parametrize(
    "changed", [["model.cache.fraction=0.25"], ["model.cache.policy=lfu"]], ids=str
)
def test_eval_with_other_cache_settings_is_refused_by_name(tmp_path, changed) -> None:
    """Bug caught: ``tetrarec eval`` of a cached checkpoint with another cache size or
    policy failed on a saved tensor's shape ("cache.slot_rows ... size mismatch"),
    naming no setting; ``--resume`` said which settings differ, eval now does too."""
    cached = ["model.placement=cached", "model.cache.fraction=0.5", "train.steps=2"]
    result = train(tiny(tmp_path / "ck", *cached))
    with pytest.raises(ValueError, match=r"^eval: .* model\.cache policy=lru fraction=0\.5, not "):
        evaluate_checkpoint(result.checkpoint, overrides=changed)


def test_eval_reads_the_model_and_not_the_optimizer_states(tmp_path, monkeypatch) -> None:
    """Bugs caught: ``tetrarec eval`` read every tensor of the checkpoint, the optimizer
    states too (under Adam twice the tables' size), to evaluate the model, read the
    whole file once more for the config alone, and built the tables with their Adam
    state, which evaluation never uses (peak memory 6.8 GiB for 1.7 GB of rows)."""
    import importlib

    import safetensors

    from tetrarec.train import build, checkpoint

    evaluate = importlib.import_module("tetrarec.train.evaluate")  # the module, not the function
    built = []

    def build_parts(*args, **kwargs):
        built.append(build.build_parts(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(evaluate, "build_parts", build_parts)

    result = train(tiny(tmp_path / "ck", "optim.sparse.kind=adam", "train.steps=2"))
    saved = set(read_checkpoint(result.checkpoint).tensors)
    assert any(name.startswith("sparse_optim.") for name in saved)
    read: list[str] = []

    def load_file(file: str) -> dict[str, torch.Tensor]:
        with safetensors.safe_open(file, framework="pt") as f:
            read.extend(f.keys())
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    class Opened:
        def __init__(self, file: str, framework: str) -> None:
            self.f = safetensors.safe_open(file, framework=framework)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(checkpoint, "load_file", load_file)
    monkeypatch.setattr(checkpoint, "safe_open", Opened)
    assert evaluate_checkpoint(result.checkpoint) == result.final
    model = {n for n in saved if n.startswith(("model.", "embedding."))}
    assert sorted(read) == sorted(model)
    buffers = dict(built[0].model.get_submodule("embeddings").named_buffers())
    assert any(name.startswith("_weights_") for name in buffers)
    assert not [n for n, b in buffers.items() if n.startswith("_state_") and b.numel()]


def test_early_stop_after_exactly_patience_evaluations_without_improvement(tmp_path) -> None:
    """Bugs caught: stopping one evaluation early or late (the count of non-improving
    evaluations off by one, or not reset by an improvement), a second evaluation of the
    stop step at the end, and a final checkpoint missing at the stop step."""
    patience = 2
    ck = tmp_path / "ck"
    result = train(tiny(ck, *EVERY_STEP, "train.steps=8", f"train.early_stop_patience={patience}"))
    assert result.stopped_early
    steps = [s for s, _ in result.evals]
    assert steps == list(range(1, result.steps + 1))  # one evaluation per step, no repeat
    assert result.steps < 8
    # the first time `patience` evaluations in a row did not improve is the last one
    for k in range(1, len(result.evals)):
        assert _expected_best(result.evals[:k])[1] < patience, f"should have stopped at {k}"
    assert _expected_best(result.evals)[1] == patience
    assert result.final == result.evals[-1][1]
    assert latest_checkpoint(ck).name == f"step_{result.steps:08d}"
    assert result.to_dict()["stopped_early"] is True


def test_patience_running_out_at_the_last_planned_step_is_no_early_stop(tmp_path, caplog) -> None:
    """A run planned to end exactly where its patience runs out ends at its planned
    step: it did not stop early (``TrainResult.stopped_early``: before the planned
    number of steps), nor does a resume of it. Bug caught: ``stopped_early`` true and
    "stopped early at step N of N" logged whenever the final evaluation was the
    ``patience``-th without improvement."""
    run = [*EVERY_STEP, "train.early_stop_patience=2"]
    stop = train(tiny(tmp_path / "a", *run, "train.steps=8")).steps
    assert stop < 8, "the test needs a run that stops early"
    caplog.set_level(logging.INFO, logger="tetrarec.train.loop")
    planned = train(tiny(tmp_path / "b", *run, f"train.steps={stop}"))
    assert (planned.steps, planned.best.since, planned.stopped_early) == (stop, 2, False)
    assert planned.to_dict()["stopped_early"] is False
    again = train(tiny(tmp_path / "b", *run, f"train.steps={stop}"), resume=True)
    assert (again.start_step, again.steps, again.stopped_early) == (stop, stop, False)
    assert not any("stop" in r.getMessage() for r in caplog.records)


def test_resumed_run_keeps_the_same_best_and_stops_at_the_same_step(tmp_path) -> None:
    """Interrupted after the best evaluation and before the early stop, then resumed:
    the same best (step, metrics, count) and the same stop step as straight through.
    Bugs caught: best-so-far not restored (the resumed run would take its own first
    evaluation as best), the count of non-improving evaluations restarted (it would
    stop later), the resumed start step's evaluation counted twice, and a best
    checkpoint left without its link (a crash between the two) never linked again, so
    pruning could delete it."""
    run = [*EVERY_STEP, "train.early_stop_patience=2", "train.checkpoint_every=2"]
    straight = train(tiny(tmp_path / "a", *run, "train.steps=8"))
    assert straight.stopped_early
    best_step = straight.best.step
    stop = straight.steps
    assert best_step < stop - 1, "the test needs an interruption after the best"
    train(tiny(tmp_path / "b", *run, f"train.steps={stop - 1}"))
    # as if the process died between the best's checkpoint and its link
    (tmp_path / "b" / "best").unlink()
    _scramble_global_rngs()
    resumed = train(tiny(tmp_path / "b", *run, "train.steps=8"), resume=True)
    assert resumed.start_step == stop - 1
    assert resumed.best == straight.best
    assert (resumed.steps, resumed.stopped_early) == (stop, True)
    assert best_checkpoint(tmp_path / "b").name == f"step_{best_step:08d}"
    assert Path(resumed.best_checkpoint).name == f"step_{best_step:08d}"
    # resuming the stopped run makes no step and reports the same
    again = train(tiny(tmp_path / "b", *run, "train.steps=8"), resume=True)
    assert (again.start_step, again.steps, again.stopped_early) == (stop, stop, True)
    assert again.best == straight.best


def test_dropout_resumes_bitwise_and_epochs_set_the_steps(tmp_path) -> None:
    """With dropout, a run interrupted and resumed equals one straight through, bit
    for bit: the masks come from the checkpointed torch RNG. Bugs caught: masks from a
    generator the checkpoint does not hold, or reseeded at resume, and dropout that
    never acts (the weights would equal those of a run without it). The resumed run
    sets its length in epochs: 1.25 epochs of 4 batches are 5 steps. The run without
    dropout keeps its best with evaluations only at the end: the final one is best."""
    base = ["train.threads=1", "model.dlrm.dropout=0.3", "model.dlrm.top_mlp=[8, 8, 1]"]
    straight = train(tiny(tmp_path / "a", *base, "train.steps=5"))
    train(tiny(tmp_path / "b", *base, "train.steps=3"))
    _scramble_global_rngs()
    resumed = train(tiny(tmp_path / "b", *base, "train.epochs=1.25"), resume=True)
    assert (resumed.start_step, resumed.steps) == (3, 5)
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name
    assert resumed.final == straight.final
    # without dropout (and with keep_best but no eval_every: the final eval is the best)
    plain = train(
        tiny(
            tmp_path / "c",
            "train.threads=1",
            "model.dlrm.top_mlp=[8, 8, 1]",
            "train.steps=5",
            "train.keep_best=auc",
        )
    )
    c = read_checkpoint(latest_checkpoint(tmp_path / "c"))
    assert not torch.equal(
        a.tensors["model.over_arch.layers.1.weight"], c.tensors["model.over_arch.layers.1.weight"]
    )
    assert (plain.best.step, plain.best.metrics) == (5, plain.final)
    assert best_checkpoint(tmp_path / "c") == latest_checkpoint(tmp_path / "c")
