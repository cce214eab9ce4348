"""``train.device``: reading it, resolving it once, and the run on the device it names.

The CPU tests run everywhere. Resolution is checked against a simulated CUDA inventory
(``torch.cuda.is_available`` and ``device_count`` patched: the answer torch would give
on a GPU node, not a stand-in for a tetrarec component). The ``gpu`` tests train the
same tiny run on CUDA and on the CPU and compare them within a stated tolerance:

- rows, dense weights and optimizer state: ``rtol=1e-4, atol=1e-5`` (FP32 sums and
  products reordered by the device's kernels, over 2 steps);
- log loss: ``rtol=1e-4``; AUC: ``abs 2e-3`` (a logit pair closer than float error may
  swap ranks: one swap moves the AUC by 1 / (positives x negatives) ~ 4e-4 here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tetrarec.comm import LaunchInfo, init_from_env
from tetrarec.config import DeviceKind, RunConfig, TrainConfig
from tetrarec.train import build_parts, evaluate_checkpoint, latest_checkpoint, read_checkpoint
from tetrarec.train import train as run_training
from tetrarec.train.runtime import _run_device

TINY = [
    "data.source=synthetic",
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.prefetch=1",
    "data.synthetic.num_samples=128",
    "data.synthetic.eval_samples=96",
    "model.num_sparse=4",
    "model.num_embeddings=[50, 20, 7, 100]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.dense_lr=0.05",
    "optim.sparse.lr=0.1",
    "train.progress=false",
    "train.log_every=0",
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny(checkpoints: Path, *extra: str) -> RunConfig:
    return RunConfig().with_overrides([*TINY, f"train.checkpoint_dir={checkpoints}", *extra])


@pytest.fixture
def cuda_inventory(monkeypatch):
    """Make torch report ``n`` CUDA devices (0: none), as it would on such a machine."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_device_is_read_strictly_but_not_checked_against_this_machine() -> None:
    """Bugs caught: an unknown device accepted (or mis-named in the error); a GPU run's
    config that a machine without CUDA cannot even read (to plan it, or to evaluate its
    checkpoint with train.device=cpu)."""
    assert RunConfig().train.device is DeviceKind.AUTO
    config = RunConfig().with_overrides(["train.device=cuda"])  # read, even without CUDA
    assert config.train.device is DeviceKind.CUDA
    assert config.to_dict()["train"]["device"] == "cuda"
    assert RunConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"train\.device: 'gpu' is not one of auto, cpu, cuda"):
        RunConfig().with_overrides(["train.device=gpu"])


def test_resolution_without_cuda(cuda_inventory) -> None:
    """Bugs caught: ``cuda`` silently trained on the CPU (or failing deep inside torch
    instead of naming the setting); ``auto`` asking for a GPU that is not there."""
    cuda_inventory(0)
    assert TrainConfig(device=DeviceKind.AUTO).resolve_device(0) == torch.device("cpu")
    assert TrainConfig(device=DeviceKind.CPU).resolve_device(0) == torch.device("cpu")
    with pytest.raises(
        ValueError, match=r"train\.device = 'cuda' but torch\.cuda\.is_available\(\) is false"
    ) as e:
        TrainConfig(device=DeviceKind.CUDA).resolve_device(0)
    assert "valid: auto, cpu, cuda" in str(e.value)


def test_resolution_with_cuda_follows_the_local_rank(cuda_inventory) -> None:
    """Bugs caught: every rank of a node put on GPU 0 (LOCAL_RANK ignored); a local rank
    without a GPU of its own allowed to share one (NCCL then fails obscurely); ``cpu``
    overridden by an available GPU."""
    cuda_inventory(2)
    assert TrainConfig(device=DeviceKind.AUTO).resolve_device(1) == torch.device("cuda", 1)
    assert TrainConfig(device=DeviceKind.CUDA).resolve_device(0) == torch.device("cuda", 0)
    assert TrainConfig(device=DeviceKind.CPU).resolve_device(1) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"local rank 2 has no GPU of its own \(2 visible\)"):
        TrainConfig(device=DeviceKind.AUTO).resolve_device(2)


def test_under_a_gloo_group_the_caller_joined_auto_trains_on_the_cpu(tmp_path, cuda_inventory):
    """Bugs caught: ``auto`` picking a GPU inside a gloo group (the test harness's, on a GPU
    machine): its all-to-alls cannot move CUDA tensors; an explicit ``cuda`` joining that
    group anyway instead of naming the mismatch."""
    cuda_inventory(1)
    launch = LaunchInfo(rank=0, world_size=2, local_rank=0, local_world_size=2)
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert _run_device(TrainConfig(), launch) == torch.device("cpu")
        cuda = TrainConfig(device=DeviceKind.CUDA)
        assert _run_device(cuda, launch) == torch.device("cuda", 0)
        with pytest.raises(ValueError, match=r"already joined a gloo process group.*needs nccl"):
            init_from_env(launch, device=torch.device("cuda", 0), timeout_s=10)
    finally:
        dist.destroy_process_group()
    # Without a group of the caller's, auto takes the GPU.
    assert _run_device(TrainConfig(), launch) == torch.device("cuda", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_run_without_cuda_stops_before_building_anything(tmp_path) -> None:
    """Bug caught: the run starts (data, model, checkpoints) and then fails, or trains on
    the CPU, when the config asks for CUDA on a machine without it."""
    with pytest.raises(ValueError, match=r"train\.device = 'cuda'"):
        run_training(tiny(tmp_path / "ck", "train.steps=1", "train.device=cuda"))
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("embedding", ["reference", "fused"])
def test_build_parts_puts_every_tensor_on_the_device(tmp_path, embedding) -> None:
    """Bugs caught: dense layers (or the embedding rows) left on the CPU for a run on
    another device; the dense optimizer built before the move (its state elsewhere).
    The meta device stands in for a GPU: a tensor left behind stays on the CPU."""
    config = tiny(tmp_path, f"model.embedding={embedding}", "optim.dense=adagrad")
    meta = torch.device("meta")
    parts = build_parts(config, num_dense=13, device=meta)
    assert parts.device == meta
    where = {n: t.device for n, t in parts.model.named_parameters()}
    where.update({n: t.device for n, t in parts.model.named_buffers()})
    assert where
    assert {n: d for n, d in where.items() if d != meta} == {}
    for optimizer in parts.optimizers:
        for state in optimizer.state.values():
            # torch.optim keeps its step counters on the host by design
            on = {k: v.device for k, v in state.items() if k != "step"}
            assert set(on.values()) <= {meta}, on
    assert build_parts(config, num_dense=13).device == torch.device("cpu")


def test_cached_tables_get_the_run_device(tmp_path) -> None:
    """Bug caught: a GPU run silently building the host-memory cache (its slots on the
    CPU, every batch's ids on the GPU): the run's device must reach the cached
    collection, which refuses a device that holds no rows (the GPU case itself is
    ``tests/unit/cache/test_cache_device.py``)."""
    config = tiny(tmp_path, "model.placement=cached", "model.cache.fraction=0.5")
    with pytest.raises(ValueError, match=r"'meta' is not a device"):
        build_parts(config, num_dense=13, device=torch.device("meta"))


def test_explicit_cpu_run_equals_the_default_run_bitwise(tmp_path) -> None:
    """Bug caught: the device plumbing (moving batches and the model, the evaluation's
    device) changes the CPU run: its checkpoint or metrics differ from the default's.
    (Here the default, ``auto``, resolves to the CPU.)"""
    if torch.cuda.is_available():
        pytest.skip("auto resolves to CUDA here")
    steps = ["train.steps=3", "train.deterministic=true", "train.eval_every=2"]
    default = run_training(tiny(tmp_path / "auto", *steps))
    explicit = run_training(tiny(tmp_path / "cpu", *steps, "train.device=cpu"))
    assert explicit.evals == default.evals
    a = read_checkpoint(latest_checkpoint(tmp_path / "auto"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "cpu"))
    assert sorted(a.tensors) == sorted(b.tensors)
    assert "rng.cuda" not in a.tensors  # a CPU run saves no GPU generator
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name


def _assert_runs_close(cpu_dir: Path, cuda_dir: Path) -> None:
    a = read_checkpoint(latest_checkpoint(cpu_dir))
    b = read_checkpoint(latest_checkpoint(cuda_dir))
    assert "rng.cuda" in b.tensors
    for name, want in a.tensors.items():
        got = b.tensors[name]
        assert got.device == torch.device("cpu"), name  # saved from the host
        if name.startswith("rng."):
            continue
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert torch.equal(got, want), name


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("embedding", "deterministic"),
    [("fused", True), ("fused", False), ("reference", True)],
)
def test_two_steps_on_cuda_match_the_cpu_run(tmp_path, embedding, deterministic) -> None:
    """Bugs caught: a batch, label or table left on the host (a device error), the
    compiled CPU kernels called with CUDA tensors, evaluation or the checkpoint broken
    on CUDA, or a CUDA step that computes something else than the CPU's."""
    extra = [
        "train.steps=2",
        f"model.embedding={embedding}",
        f"train.deterministic={str(deterministic).lower()}",
    ]
    cpu = run_training(tiny(tmp_path / "cpu", *extra, "train.device=cpu"))
    cuda = run_training(tiny(tmp_path / "cuda", *extra, "train.device=cuda"))
    assert cpu.final is not None
    assert cuda.final is not None
    assert cuda.final.num_samples == cpu.final.num_samples
    assert cuda.final.log_loss == pytest.approx(cpu.final.log_loss, rel=1e-4)
    assert cuda.final.auc == pytest.approx(cpu.final.auc, abs=2e-3)
    _assert_runs_close(tmp_path / "cpu", tmp_path / "cuda")


@pytest.mark.gpu
@needs_cuda
def test_cuda_run_resumes_bitwise_and_its_checkpoint_evaluates_on_the_cpu(tmp_path) -> None:
    """Bugs caught: a checkpoint that cannot be loaded back onto the GPU, a resume that
    loses the GPU generator or optimizer state, a GPU checkpoint that a CPU cannot read."""
    extra = ["train.deterministic=true", "model.dlrm.dropout=0.25", "train.device=cuda"]
    straight = run_training(tiny(tmp_path / "a", *extra, "train.steps=3"))
    run_training(tiny(tmp_path / "b", *extra, "train.steps=1"))
    resumed = run_training(tiny(tmp_path / "b", *extra, "train.steps=3"), resume=True)
    assert resumed.final == straight.final
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name
    assert straight.checkpoint is not None
    on_cpu = evaluate_checkpoint(straight.checkpoint, overrides=["train.device=cpu"])
    assert straight.final is not None
    assert on_cpu.log_loss == pytest.approx(straight.final.log_loss, rel=1e-4)
