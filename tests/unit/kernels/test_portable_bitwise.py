"""The batched portable path gives the same bits as the per-table loop it replaced.

The oracle is the portable module as it was before the rewrite, kept importable as
``benchmarks/_portable_before.py`` (also what ``bench_portable.py`` times). Every case
runs two training steps (forward, backward, fused update) of the same module on both and
compares outputs, rows, optimizer state and per-id weight gradients bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import reference
from tetrarec.kernels.tbe import FusedEmbeddingBagCollection
from tetrarec.types import OptimizerKind, PoolingMode, Precision

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))
import _portable_before as before

KINDS = list(OptimizerKind)
PRECISIONS = [Precision.FP32, Precision.FP16, Precision.BF16, Precision.INT8, Precision.INT4]


def _tables(precision: Precision, mean: bool) -> list[TableConfig]:
    pool = PoolingMode.MEAN if mean else PoolingMode.SUM
    return [
        TableConfig(name="a", num_embeddings=40, dim=8, precision=precision,
                    feature_names=("fa", "fa2"), pooling=pool),
        TableConfig(name="b", num_embeddings=25, dim=5, precision=precision),
        TableConfig(name="c", num_embeddings=12, dim=8, precision=Precision.FP32),
        TableConfig(name="d", num_embeddings=30, dim=3, precision=precision, pooling=pool),
    ]  # fmt: skip


def _batch(ebc: FusedEmbeddingBagCollection, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    f = len(ebc.feature_names)
    lengths = torch.randint(0, 5, (f * batch,), generator=g)
    lengths[::7] = 0  # empty bags
    rows = [t.num_embeddings for t in ebc.tables for _ in t.feature_names]
    values = torch.cat([
        torch.randint(0, r // 3 + 1, (int(n),), generator=g)  # few rows: many duplicates
        for r, n in zip(rows, lengths.view(f, batch).sum(1))
    ])  # fmt: skip
    return values, lengths


def _run(monkeypatch, impl, kind, precision, mean, weighted, stochastic):
    monkeypatch.setenv("TETRAREC_KERNELS", "reference")
    monkeypatch.setattr(reference, "pooled_forward", impl.pooled_forward)
    monkeypatch.setattr(reference, "backward_update", impl.backward_update)
    spec = SparseOptimizerSpec(kind=kind, lr=0.07, weight_decay=0.01)
    ebc = FusedEmbeddingBagCollection(
        _tables(precision, mean), spec, seed=5, stochastic_rounding=stochastic
    )
    got = []
    for step in range(2):
        values, lengths = _batch(ebc, 6, step)
        psw = torch.rand(values.numel(), generator=torch.Generator().manual_seed(9))
        psw = psw if weighted else None
        out = ebc.pool_ids(values, lengths, psw)
        grad = torch.sin(torch.arange(out.numel()).float()).view_as(out) * (1 + out)
        g = ebc.update_ids(grad, values, lengths, psw, want_psw=weighted)
        got += [out, *(s.clone() for s in ebc.storages()), g if g is not None else out[:0]]
    state = ebc.fused_optimizer.state_dict()["state"]
    got += [v for t in sorted(state) for _, v in sorted(state[t].items())]
    return got


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bytes (NaNs and signed zeros compare as bits)."""
    return x.contiguous().view(torch.uint8) if x.numel() else x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_steps_are_bitwise_the_per_table_loop(monkeypatch, kind, precision) -> None:
    """Bug caught: the batched path summing a row's gradient or a bag in another order,
    rounding a row with another draw, decoding a row of mixed dims from the wrong bytes,
    or updating a row of another table (any optimizer, any row precision)."""
    for mean, weighted, stochastic in ((True, False, True), (False, True, False)):
        args = (kind, precision, mean, weighted, stochastic)
        want = _run(monkeypatch, before, *args)
        got = _run(monkeypatch, reference, *args)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype, (i, args)
            assert a.shape == b.shape, (i, args)
            assert torch.equal(_bits(a), _bits(b)), (i, args)


@pytest.mark.parametrize("bad", [-3, 40])
def test_a_bad_id_gives_the_same_answer_as_before(monkeypatch, bad) -> None:
    """Bug caught: the batched bounds check naming another feature or id than the
    per-table loop did (forward: the first feature with a bad id and its smallest bad
    id; backward: that feature's first bad id by position), or updating before it."""
    monkeypatch.setenv("TETRAREC_KERNELS", "reference")
    answers = []
    for impl in (before, reference):
        monkeypatch.setattr(reference, "pooled_forward", impl.pooled_forward)
        monkeypatch.setattr(reference, "backward_update", impl.backward_update)
        spec = SparseOptimizerSpec(kind=OptimizerKind.ADAGRAD, lr=0.1)
        ebc = FusedEmbeddingBagCollection(_tables(Precision.INT8, False), spec, seed=1)
        values, lengths = _batch(ebc, 4, 0)
        values[3], values[-2] = bad, 41
        before_rows = [s.clone() for s in ebc.storages()]
        ebc.check_bounds = True
        with pytest.raises(ValueError, match="outside its table") as fwd:
            ebc.pool_ids(values, lengths, None)
        with pytest.raises(RuntimeError, match="outside its table") as bwd:
            impl.backward_update(
                torch.ones(4, sum(ebc.feature_dims)), ebc.storages()[0], ebc._meta(0),
                values, lengths, None, ebc._states(0), ebc._cached_meta(0)[1], "adagrad",
                [0.1, 1e-8, 0.9, 0.999, 0.0], ebc._stores[0].precision.value, [0, 0, 0, 1, 0],
            )  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(before_rows, ebc.storages()))
        answers.append((str(fwd.value), str(bwd.value)))
    assert answers[0] == answers[1]


def test_rounding_noise_is_the_numpy_draw() -> None:
    """Bug caught: the tensor port of the counter-based hash (int64 wrap-around, a
    logical shift done arithmetically) drawing other bits than the C++/numpy one."""
    keys = torch.cat([torch.arange(50), torch.tensor([2**40 + 7, 2**62 + 3, 2**63 - 1])])
    for seed, iteration, col in ((0, 0, 0), (2**64 - 1, 12345, 7), (-5, 2**70, 300)):
        want = before.rounding_noise(seed, iteration, keys, col, 9)
        assert torch.equal(reference.rounding_noise(seed, iteration, keys, col, 9), want)
