"""The compiled kernel's fast paths, at sizes that reach them, against the portable path.

The forward splits each thread's range of bags feature by feature and prefetches 6-24
ids ahead; the backward sorts each feature's ids on its own when no table is shared by
two features (else one global sort), and updates FP32 rows in place. The batches here
have a few hundred ids per feature (more than the prefetch distance), bags of 0-7 ids,
and 2 threads whose ranges split a feature in the middle.
"""

from __future__ import annotations

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.sparse import SparseFeatures

B = 200  # 3 features x 200 bags: 2 threads split the range inside feature 1
ABC = 16 + 8 + 32  # output columns of tables a, b, c


def _tables(precision: str, shared: bool) -> list[TableConfig]:
    """Three tables, one feature each; ``shared`` adds a table looked up by two features
    (with empty bags), which forces the global sort without changing any update."""
    tables = [
        TableConfig(name="a", num_embeddings=500, dim=16, precision=precision),
        TableConfig(name="b", num_embeddings=70, dim=8, precision=precision, pooling="mean"),
        TableConfig(name="c", num_embeddings=5000, dim=32, precision=precision),  # 13 bits
    ]
    if shared:
        tables.append(
            TableConfig(name="z", num_embeddings=4, dim=8, precision=precision,
                        feature_names=("z0", "z1"))
        )  # fmt: skip
    return tables


def _features(seed: int, tables: list[TableConfig]) -> SparseFeatures:
    gen = torch.Generator().manual_seed(seed)
    bags = {}
    for t in tables:
        for f in t.feature_names:
            hi = 0 if t.name == "z" else 8
            lens = torch.randint(0, hi + 1, (B,), generator=gen).tolist()
            # skewed ids: hot rows repeat within and across bags (duplicates to merge)
            ids = (torch.rand(sum(lens), generator=gen) ** 3 * t.num_embeddings).long()
            bags[f] = [x.tolist() for x in torch.split(ids, lens)]
    return SparseFeatures.from_lists(bags)


def _train(ebc: FusedEmbeddingBagCollection, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    outs = []
    for s in range(steps):
        sf = _features(s, list(ebc.tables))
        out = ebc(sf).values
        grad = torch.zeros(out.shape)
        grad[:, :ABC] = torch.randn(B, ABC, generator=gen)  # table z's columns get none
        out.backward(grad)
        outs.append(out.detach()[:, :ABC])
    return outs


def _state(ebc: FusedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """Weights and optimizer state of tables a, b, c (one helper: the keys may move)."""
    return {
        k: v.clone()
        for k, v in ebc.state_dict().items()
        if k != "rounding" and k.split(".")[1] in ("a", "b", "c")
    }


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_fast_paths_match_the_portable_path(
    monkeypatch: pytest.MonkeyPatch, optimizer: str, precision: str
) -> None:
    """Fails if the per-feature ranges, the prefetch bounds, the per-feature sort or the
    in-place FP32 update lose, duplicate or misplace an id's contribution."""
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    spec = SparseOptimizerSpec(kind=optimizer, lr=0.05)
    threads = torch.get_num_threads()
    results = {}
    try:
        torch.set_num_threads(2)
        for path in ("compiled", "reference"):
            monkeypatch.setenv("TETRAREC_KERNELS", "auto" if path == "compiled" else "reference")
            ebc = FusedEmbeddingBagCollection(
                _tables(precision, False), spec, seed=0, stochastic_rounding=False
            )
            results[path] = (_train(ebc), _state(ebc))
    finally:
        torch.set_num_threads(threads)
    tol = {"rtol": 1e-5, "atol": 1e-5} if precision == "fp32" else {"rtol": 2e-3, "atol": 2e-3}
    for x, y in zip(results["compiled"][0], results["reference"][0]):
        torch.testing.assert_close(x, y, **tol)
    for k, v in results["reference"][1].items():
        torch.testing.assert_close(results["compiled"][1][k].float(), v.float(), **tol, msg=k)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_per_feature_sort_equals_global_sort_bitwise(precision: str) -> None:
    """Fails if sorting each feature's ids on their own changes any sum or its order
    (it must equal the global sort bitwise), or depends on the thread count."""
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    spec = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.05)
    threads = torch.get_num_threads()
    runs = []
    try:
        for shared, n in ((False, 1), (False, 2), (True, 2)):
            torch.set_num_threads(n)
            ebc = FusedEmbeddingBagCollection(_tables(precision, shared), spec, seed=0)
            runs.append((_train(ebc), _state(ebc)))
    finally:
        torch.set_num_threads(threads)
    for outs, state in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outs, runs[0][0]))
        assert state.keys() == runs[0][1].keys()
        assert all(torch.equal(state[k], runs[0][1][k]) for k in state)
