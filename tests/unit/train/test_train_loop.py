import json
import math
import random

import numpy as np
import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.train import (
    NonFiniteLossError,
    evaluate_checkpoint,
    latest_checkpoint,
    read_checkpoint,
    train,
)
from tetrarec.train.checkpoint import list_checkpoints

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


def test_resume_without_checkpoint_and_bad_dense_width(tmp_path) -> None:
    with pytest.raises(ValueError, match="resume: no checkpoint"):
        train(tiny(tmp_path / "none", "train.steps=1"), resume=True)
    with pytest.raises(ValueError, match=r"13 dense features but model\.dlrm\.num_dense is 5"):
        train(tiny(tmp_path, "train.steps=1", "model.dlrm.num_dense=5"))


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
