import math

import pytest
import torch
from torch import nn

from tetrarec.config import DecayKind, DenseOptimizerKind, OptimConfig
from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.train.optim import (
    RowWiseAdagrad,
    build_dense_optimizer,
    build_sparse_optimizer,
    set_learning_rate,
)
from tetrarec.train.schedule import lr_scale
from tetrarec.types import OptimizerKind

IDS = [torch.tensor([1, 3, 3, 7]), torch.tensor([3, 0, 1, 1]), torch.tensor([7, 7, 2, 3])]


def _bag(seed: int = 0) -> nn.EmbeddingBag:
    torch.manual_seed(seed)
    return nn.EmbeddingBag(8, 4, mode="sum", sparse=True)


def _loss(weight_out: torch.Tensor, step: int) -> torch.Tensor:
    target = torch.arange(weight_out.numel(), dtype=torch.float32).view_as(weight_out) / 10
    return ((weight_out - target * (step + 1)) ** 2).sum()


def _sparse_steps(opt_factory, steps: int = 3) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    bag = _bag()
    opt = opt_factory([bag.weight])
    for s, ids in enumerate(IDS[:steps]):
        opt.zero_grad()
        _loss(bag(ids, torch.tensor([0, 2])), s).backward()
        opt.step()
    return bag.weight.detach().clone(), opt


def _rowwise_reference(lr: float, eps: float, wd: float, init: float) -> torch.Tensor:
    """The published rule on a dense copy, row by row, written out plainly."""
    bag = _bag()
    w = bag.weight.detach().clone()
    acc = torch.full((8,), init)
    for s, ids in enumerate(IDS):
        wv = w.clone().requires_grad_(True)
        out = torch.nn.functional.embedding_bag(ids, wv, torch.tensor([0, 2]), mode="sum")
        _loss(out, s).backward()
        g = wv.grad
        for r in sorted(set(ids.tolist())):
            gr = g[r] + wd * w[r]
            acc[r] += (gr * gr).mean()
            w[r] -= lr * gr / (math.sqrt(acc[r]) + eps)
    return w


@pytest.mark.parametrize(("wd", "init"), [(0.0, 0.0), (0.1, 0.5)])
def test_rowwise_adagrad_matches_plain_rule_with_repeated_ids(wd: float, init: float) -> None:
    got, opt = _sparse_steps(
        lambda ps: RowWiseAdagrad(ps, lr=0.1, eps=1e-6, weight_decay=wd, initial_accumulator=init)
    )
    want = _rowwise_reference(0.1, 1e-6, wd, init)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # rows never touched (4, 5, 6) keep their initial value and accumulator
    torch.testing.assert_close(got[4:7], _bag().weight.detach()[4:7], rtol=0, atol=0)
    assert opt.state[opt.param_groups[0]["params"][0]]["sum"][4:7].tolist() == [init] * 3


def test_rowwise_adagrad_dense_grad_equals_sparse_grad() -> None:
    sparse, _ = _sparse_steps(lambda ps: RowWiseAdagrad(ps, lr=0.1), steps=1)
    bag = _bag()
    dense_w = nn.Parameter(bag.weight.detach().clone())
    opt = RowWiseAdagrad([dense_w], lr=0.1)
    out = torch.nn.functional.embedding_bag(IDS[0], dense_w, torch.tensor([0, 2]), mode="sum")
    _loss(out, 0).backward()
    opt.step()
    touched = sorted(set(IDS[0].tolist()))
    torch.testing.assert_close(dense_w.detach()[touched], sparse[touched])


@pytest.mark.parametrize(
    ("kind", "dense_factory"),
    [
        (OptimizerKind.SGD, lambda ps: torch.optim.SGD(ps, lr=0.05)),
        (OptimizerKind.ADAGRAD, lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-8)),
    ],
)
def test_sparse_builders_match_torch_dense_optimizers(kind, dense_factory) -> None:
    spec = SparseOptimizerSpec(kind=kind, lr=0.05)
    got, _ = _sparse_steps(lambda ps: build_sparse_optimizer(spec, ps))
    bag = _bag()
    w = nn.Parameter(bag.weight.detach().clone())
    opt = dense_factory([w])
    for s, ids in enumerate(IDS):
        opt.zero_grad()
        out = torch.nn.functional.embedding_bag(ids, w, torch.tensor([0, 2]), mode="sum")
        _loss(out, s).backward()
        opt.step()
    torch.testing.assert_close(got, w.detach(), rtol=1e-6, atol=1e-6)


def _lazy_adam_reference(rowwise: bool, lr: float, b1: float, b2: float, wd: float) -> torch.Tensor:
    """Adam as docs/training.md states it, row by row: each row's own step count."""
    w = _bag().weight.detach().clone().double()
    m, v = torch.zeros_like(w), torch.zeros(8, 1 if rowwise else 4, dtype=torch.float64)
    t = [0] * 8
    for s, ids in enumerate(IDS):
        wv = w.float().clone().requires_grad_(True)
        out = torch.nn.functional.embedding_bag(ids, wv, torch.tensor([0, 2]), mode="sum")
        _loss(out, s).backward()
        for r in sorted(set(ids.tolist())):
            g = wv.grad[r].double() + wd * w[r]
            t[r] += 1
            m[r] = b1 * m[r] + (1 - b1) * g
            v[r] = b2 * v[r] + (1 - b2) * ((g * g).mean() if rowwise else g * g)
            w[r] -= lr * (m[r] / (1 - b1 ** t[r])) / ((v[r] / (1 - b2 ** t[r])).sqrt() + 1e-8)
    return w.float()


@pytest.mark.parametrize("kind", [OptimizerKind.ADAM, OptimizerKind.ROWWISE_ADAM])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_sparse_adam_counts_each_rows_own_steps_as_the_fused_rule(kind, wd) -> None:
    """Bug caught: the reference embedding's Adam was torch.optim.SparseAdam, whose bias
    correction counts the table's steps: a row that had skipped a step (rows 0 and 2
    here) took another step size than the fused embedding's ("lazy" Adam, each row's
    own count), so model.embedding = "reference" trained other rows than "fused" (0.126
    apart after 5 steps). Row-wise Adam and weight decay had no reference at all."""
    spec = SparseOptimizerSpec(kind=kind, lr=0.05, beta1=0.8, beta2=0.9, weight_decay=wd)
    got, opt = _sparse_steps(lambda ps: build_sparse_optimizer(spec, ps))
    want = _lazy_adam_reference(kind == OptimizerKind.ROWWISE_ADAM, 0.05, 0.8, 0.9, wd)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    steps = opt.state[opt.param_groups[0]["params"][0]]["step"].view(-1).tolist()
    assert steps == [1, 2, 1, 3, 0, 0, 0, 2]  # each row's own count
    # A state of another layout (SparseAdam's, one step count per table) is refused.
    _, sparse_adam = _sparse_steps(lambda ps: torch.optim.SparseAdam(ps, lr=0.05))
    with pytest.raises(ValueError, match="does not fit this optimizer"):
        opt.load_state_dict(sparse_adam.state_dict())
    opt.load_state_dict(opt.state_dict())  # its own: fine


def test_unsupported_sparse_settings_raise() -> None:
    w = [nn.Parameter(torch.zeros(3, 2))]
    with pytest.raises(ValueError, match=r"weight_decay=0\.1"):
        build_sparse_optimizer(SparseOptimizerSpec(kind="adagrad", weight_decay=0.1), w)
    with pytest.raises(ValueError, match="2-D"):
        RowWiseAdagrad([nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("kind", list(DenseOptimizerKind))
def test_dense_builders_and_set_learning_rate(kind: DenseOptimizerKind) -> None:
    p = nn.Parameter(torch.ones(2))
    opt = build_dense_optimizer(OptimConfig(dense=kind, dense_lr=0.3), [p])
    assert opt.param_groups[0]["lr"] == 0.3
    set_learning_rate(opt, 0.01)
    assert opt.param_groups[0]["lr"] == 0.01


def test_schedule_warmup_then_linear_and_cosine_decay() -> None:
    lin = OptimConfig(
        warmup_steps=4, decay=DecayKind.LINEAR, decay_start=8, decay_steps=8, min_lr_scale=0.25
    )
    assert [lr_scale(s, lin) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_scale(7, lin) == 1.0
    assert lr_scale(8, lin) == 1.0  # decay_start: still the full rate (as documented)
    assert lr_scale(9, lin) == pytest.approx(1 - 0.75 / 8)  # the first step lowered
    assert lr_scale(12, lin) == pytest.approx(1 - 0.75 * 0.5)
    assert lr_scale(16, lin) == pytest.approx(0.25)
    assert lr_scale(1000, lin) == pytest.approx(0.25)
    cos = OptimConfig(decay=DecayKind.COSINE, decay_start=0, decay_steps=10, min_lr_scale=0.0)
    assert lr_scale(0, cos) == 1.0
    assert lr_scale(5, cos) == pytest.approx(0.5)
    assert lr_scale(10, cos) == pytest.approx(0.0)
    assert lr_scale(3, OptimConfig()) == 1.0
    with pytest.raises(ValueError, match="decay_steps"):
        OptimConfig(decay=DecayKind.COSINE, decay_steps=0)


@pytest.mark.parametrize("kind", ["adam", "rowwise_adam"])
def test_a_loaded_row_rule_state_joins_its_parameter_whatever_it_was_saved_as(kind) -> None:
    """Bug caught on an H200: torch's ``load_state_dict`` leaves any state named "step"
    as loaded (its own is a host scalar), so the row rule's per-row step column stayed on
    the host when a resume ran on CUDA and the next step indexed it with device row ids;
    here a step column saved as FP64 stayed FP64. Every state tensor must come back as
    FP32 beside its parameter, and the next step must run."""
    p = nn.Parameter(torch.randn(6, 4))
    spec = SparseOptimizerSpec(kind=kind, lr=0.1)
    opt = build_sparse_optimizer(spec, [p])
    saved = opt.state_dict()
    saved["state"][0] = {k: v.double() + 1 for k, v in saved["state"][0].items()}
    opt.load_state_dict(saved)
    for v in opt.state[p].values():
        assert v.dtype == torch.float32
        assert v.device == p.device
    assert torch.equal(opt.state[p]["step"], torch.ones(6, 1))
    p.grad = torch.randn(6, 4)
    opt.step()
    assert torch.equal(opt.state[p]["step"], torch.full((6, 1), 2.0))
