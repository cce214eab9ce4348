"""Fused optimizers against dense references, step for step, with repeated ids.

Every step touches every row (so that the dense torch.optim rules, which update all
rows, agree with the sparse ones), and ids repeat within a step.
"""

import pytest
import torch
import torch.nn.functional as F

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import (
    FusedEmbeddingBagCollection,
    decode_rows,
    encode_rows,
    state_layout,
)
from tetrarec.sparse import SparseFeatures
from tetrarec.types import OptimizerKind, Precision

ROWS, DIM, BATCH, STEPS = 6, 5, 4, 3


def make_steps(seed=0):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        ids = torch.cat([torch.arange(ROWS), torch.randint(0, ROWS, (6,), generator=gen)])
        ids = ids[torch.randperm(12, generator=gen)]
        lengths = torch.tensor([3, 3, 3, 3])
        grad = torch.randn(BATCH, DIM, generator=gen)
        steps.append((ids, lengths, grad))
    return steps


def rowwise_adagrad_rule(p, state, spec):
    g = p.grad + spec.weight_decay * p
    state["sum"] = state.get("sum", torch.zeros(ROWS, 1)) + (g * g).mean(1, keepdim=True)
    p -= spec.lr * g / (state["sum"].sqrt() + spec.eps)


def rowwise_adam_rule(p, state, spec):
    g = p.grad + spec.weight_decay * p
    t = state["step"] = state.get("step", 0) + 1
    m = state["exp_avg"] = spec.beta1 * state.get("exp_avg", 0) + (1 - spec.beta1) * g
    g2 = (g * g).mean(1, keepdim=True)
    v = state["exp_avg_sq"] = spec.beta2 * state.get("exp_avg_sq", 0) + (1 - spec.beta2) * g2
    m_hat, v_hat = m / (1 - spec.beta1**t), v / (1 - spec.beta2**t)
    p -= spec.lr * m_hat / (v_hat.sqrt() + spec.eps)


def dense_optimizer(p, spec):
    """torch.optim for the rules it has; the published row-wise rules otherwise."""
    kw = {"lr": spec.lr, "weight_decay": spec.weight_decay}
    betas = (spec.beta1, spec.beta2)
    make = {
        OptimizerKind.SGD: lambda: torch.optim.SGD([p], **kw),
        OptimizerKind.ADAGRAD: lambda: torch.optim.Adagrad(
            [p], eps=spec.eps, initial_accumulator_value=spec.initial_accumulator, **kw
        ),
        OptimizerKind.ADAM: lambda: torch.optim.Adam([p], eps=spec.eps, betas=betas, **kw),
    }
    if spec.kind in make:
        opt = make[spec.kind]()
        return opt.step, lambda: opt.state[p]
    rule = {
        OptimizerKind.ROWWISE_ADAGRAD: rowwise_adagrad_rule,
        OptimizerKind.ROWWISE_ADAM: rowwise_adam_rule,
    }[spec.kind]
    state = {}

    @torch.no_grad()
    def step():
        rule(p, state, spec)

    return step, lambda: state


def run_dense(w0, spec, precision):
    p = torch.nn.Parameter(w0.clone())
    step, state = dense_optimizer(p, spec)
    for ids, lengths, grad in make_steps():
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        F.embedding_bag(ids, p, offsets, mode="sum").backward(grad)
        step()
        p.grad = None
        with torch.no_grad():  # the store keeps the rounded rows (round-to-nearest here)
            p.copy_(decode_rows(encode_rows(p, precision, stochastic=False), precision, DIM))
    return p.detach(), state()


def run_fused(spec, precision):
    table = TableConfig(name="t", num_embeddings=ROWS, dim=DIM, precision=precision)
    ebc = FusedEmbeddingBagCollection([table], spec, seed=7, stochastic_rounding=False)
    w0 = ebc.table_weights()["t"].clone()
    for ids, lengths, grad in make_steps():
        ebc(SparseFeatures(("t",), ids, lengths, BATCH)).values.backward(grad)
    return ebc, w0


SPECS = {
    "sgd": dict(kind="sgd", lr=0.1),
    "adagrad": dict(kind="adagrad", lr=0.1, eps=1e-8, initial_accumulator=0.1),
    "rowwise_adagrad": dict(kind="rowwise_adagrad", lr=0.1, eps=1e-8),
    "adam": dict(kind="adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95),
    "rowwise_adam": dict(kind="rowwise_adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95),
}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("name", list(SPECS))
def test_fp32_matches_dense_reference(kernel_path, name, weight_decay):
    spec = SparseOptimizerSpec(**SPECS[name], weight_decay=weight_decay)
    ebc, w0 = run_fused(spec, Precision.FP32)
    ref_w, ref_state = run_dense(w0, spec, Precision.FP32)
    assert not torch.equal(ref_w, w0)
    torch.testing.assert_close(ebc.table_weights()["t"], ref_w, rtol=1e-5, atol=1e-6)
    sd = ebc.fused_optimizer.state_dict()["state"]["t"]
    for key in state_layout(spec.kind, DIM):
        ref = torch.as_tensor(ref_state[key], dtype=torch.float32)
        got = sd[key]
        ref = ref.expand(ROWS, -1) if ref.dim() == 2 else ref.expand(ROWS)
        torch.testing.assert_close(got, ref.reshape(got.shape), rtol=1e-5, atol=1e-6)


def quantum(precision, w):
    """One rounding step of ``precision`` around the values ``w`` (R, D)."""
    if precision.is_integer:
        levels = (1 << precision.bits) - 1
        return ((w.amax(1) - w.amin(1)) / levels).unsqueeze(1).expand_as(w) * 1.01
    mantissa = {Precision.FP16: 10, Precision.BF16: 7}[precision]
    return w.abs() * 2.0**-mantissa + 1e-7


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_low_precision_matches_dense_reference_within_rounding(kernel_path, name, precision):
    prec = Precision.parse(precision)
    spec = SparseOptimizerSpec(**SPECS[name], weight_decay=0.01)
    ebc, w0 = run_fused(spec, prec)
    ref_w, _ = run_dense(w0, spec, prec)
    got = ebc.table_weights()["t"]
    assert not torch.equal(got, w0)
    assert ((got - ref_w).abs() <= 2 * quantum(prec, ref_w)).all()


def test_untouched_rows_are_bitwise_unchanged(kernel_path):
    table = TableConfig(name="t", num_embeddings=10, dim=4, precision="int8")
    spec = SparseOptimizerSpec(kind="adam", lr=0.1, weight_decay=0.1)
    ebc = FusedEmbeddingBagCollection([table], spec, seed=1)
    before = ebc.state_dict()["weights.t"].clone()
    ebc(SparseFeatures.from_lists({"t": [[2, 2], [5]]})).values.sum().backward()
    after = ebc.state_dict()["weights.t"]
    changed = (after != before).any(1).nonzero().flatten().tolist()
    assert changed == [2, 5]


def test_learning_rate_schedule_applies_to_the_next_backward(kernel_path):
    table = TableConfig(name="t", num_embeddings=4, dim=3)
    ebc = FusedEmbeddingBagCollection([table], SparseOptimizerSpec(kind="sgd", lr=1.0), seed=2)
    sf = SparseFeatures.from_lists({"t": [[1]]})
    w = ebc.table_weights()["t"].clone()
    group = ebc.fused_optimizer.param_groups[0]
    group["lr"] = 0.0
    ebc(sf).values.sum().backward()
    assert torch.equal(ebc.table_weights()["t"], w)
    group["lr"] = 0.5
    ebc(sf).values.sum().backward()
    torch.testing.assert_close(ebc.table_weights()["t"][1], w[1] - 0.5)
    group["lr"] = -1.0
    with pytest.raises(ValueError, match="-1"):
        ebc(sf).values.sum().backward()


def test_a_torch_lr_scheduler_drives_the_fused_optimizer(kernel_path):
    """Bug caught: the backward reading its lr from anywhere but the optimizer's group."""
    table = TableConfig(name="t", num_embeddings=4, dim=3)
    ebc = FusedEmbeddingBagCollection([table], SparseOptimizerSpec(kind="sgd", lr=1.0), seed=2)
    sched = torch.optim.lr_scheduler.LambdaLR(ebc.fused_optimizer, lambda step: 0.25 * (step + 1))
    sf = SparseFeatures.from_lists({"t": [[1]]})
    for expected_lr in (0.25, 0.5):
        w = ebc.table_weights()["t"][1].clone()
        ebc(sf).values.sum().backward()
        ebc.fused_optimizer.step()
        sched.step()
        torch.testing.assert_close(ebc.table_weights()["t"][1], w - expected_lr)
