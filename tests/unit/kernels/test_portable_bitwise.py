"""The batched portable path (what a GPU runs) gives the same bits as the per-table loop.

The oracle is the loop in ``kernels/reference.py`` (the definition, what the CPU runs
with ``TETRAREC_KERNELS=reference``); the batched path is ``reference_batched.py``, run
on the CPU with ``TETRAREC_KERNELS=batched``. Every case runs two training steps
(forward, backward, fused update) of the same module on both and compares outputs,
rows, optimizer state and per-id weight gradients bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import reference, reference_batched
from tetrarec.kernels.tbe import FusedEmbeddingBagCollection
from tetrarec.types import OptimizerKind, PoolingMode, Precision

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


def _run(monkeypatch, mode, kind, precision, mean, weighted, stochastic):
    monkeypatch.setenv("TETRAREC_KERNELS", mode)
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
        want = _run(monkeypatch, "reference", *args)
        got = _run(monkeypatch, "batched", *args)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype, (i, args)
            assert a.shape == b.shape, (i, args)
            assert torch.equal(_bits(a), _bits(b)), (i, args)


@pytest.mark.parametrize("bad", [-3, 40])
def test_a_bad_id_gives_the_same_answer_as_the_loop(monkeypatch, bad) -> None:
    """Bug caught: the batched bounds check naming another feature or id than the
    per-table loop did (forward: the first feature with a bad id and its smallest bad
    id; backward: that feature's first bad id by position), or updating before it."""
    answers = []
    for mode, impl in (("reference", reference), ("batched", reference_batched)):
        monkeypatch.setenv("TETRAREC_KERNELS", mode)
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


def _spy(monkeypatch, module: Any, calls: list[str]) -> None:
    """Record each call of ``module``'s forward and backward + update, then run it."""
    for name in ("pooled_forward", "backward_update"):
        real = getattr(module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(f"{module.__name__.rsplit('.', 1)[-1]}.{_name}")
            return _real(*args)

        monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize(
    ("mode", "runs"), [("reference", "reference"), ("batched", "reference_batched")]
)
def test_each_mode_runs_its_portable_path_on_the_cpu(monkeypatch, mode, runs) -> None:
    """Bug caught: ``TETRAREC_KERNELS=batched`` running the loop (or the compiled
    kernel) on the CPU, so the CPU lanes never run what a GPU runs, or ``reference``
    running the batched path, so the definition is never run against it."""
    monkeypatch.setenv("TETRAREC_KERNELS", mode)
    calls: list[str] = []
    _spy(monkeypatch, reference, calls)
    _spy(monkeypatch, reference_batched, calls)
    spec = SparseOptimizerSpec(kind=OptimizerKind.SGD, lr=0.1)
    ebc = FusedEmbeddingBagCollection(_tables(Precision.FP32, False), spec, seed=1)
    values, lengths = _batch(ebc, 4, 0)
    out = ebc.pool_ids(values, lengths, None)
    ebc.update_ids(out, values, lengths, None)
    assert calls == [f"{runs}.pooled_forward", f"{runs}.backward_update"]


def test_every_kernel_mode_names_a_portable_path_for_the_cpu() -> None:
    """Bug caught: a ``TETRAREC_KERNELS`` mode added to ``_build`` with no portable path
    in ``ops._CPU_PORTABLE`` (a KeyError at the first op call without the compiled
    kernel), or ``batched`` mapped to the loop."""
    from tetrarec.kernels import _build, ops

    assert set(ops._CPU_PORTABLE) == set(_build._MODES)
    assert ops._CPU_PORTABLE["batched"] is reference_batched
    assert ops._CPU_PORTABLE["reference"] is reference
