"""The compiled forward of every row format equals the portable path, bit for bit.

The compiled forward pools a bag through one of three paths: eight columns a register
(FP32 rows of any dim that is a multiple of 8, the other formats' up to dim 32, each
decoding its rows 8 values at a time), a scalar loop (dim 1: a first-order term's
tables), and the generic decode-then-sum (everything else). All three do the portable
path's operations in its order (0, + w * row per id, / L for a mean), so the outputs are
the same bits; these shapes reach each path with bags of 0-7 ids and of exactly one.
"""

from __future__ import annotations

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.sparse import SparseFeatures

B = 97
# register path (8..32, FP32 also 72), scalar path (1), generic (3, 40, 72 for the others)
DIMS = (8, 16, 24, 32, 1, 3, 40, 72)


def _features(seed: int, single: bool, weighted: bool) -> SparseFeatures:
    gen = torch.Generator().manual_seed(seed)
    lengths = (
        torch.ones(len(DIMS) * B, dtype=torch.int64)
        if single
        else torch.randint(0, 8, (len(DIMS) * B,), generator=gen)
    )
    values = torch.randint(0, 300, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) * 2 - 0.5 if weighted else None
    keys = tuple(f"f{i}" for i in range(len(DIMS)))
    return SparseFeatures(keys=keys, values=values, lengths=lengths, batch_size=B, weights=weights)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("single", [False, True], ids=["pooled", "one-id"])
@pytest.mark.parametrize("weighted", [False, True], ids=["sum-mean", "weighted"])
def test_forward_of_every_format_equals_the_portable_path_bitwise(
    monkeypatch: pytest.MonkeyPatch, precision: str, single: bool, weighted: bool
) -> None:
    """Fails if a format's 8-wide decode (an INT4 nibble order, an INT8 scale or bias,
    FP16/BF16 widening), the dim-1 loop, the mean's division or the per-id weight differs
    from the portable path's by one bit, or if a dim takes a path that reads past its
    row. (Per-id weights need sum pooling.)"""
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    tables = [
        TableConfig(
            name=f"t{i}", num_embeddings=300, dim=d, precision=precision,
            pooling="mean" if i % 2 and not weighted else "sum", feature_names=(f"f{i}",),
        )
        for i, d in enumerate(DIMS)
    ]  # fmt: skip
    spec = SparseOptimizerSpec(kind="sgd", lr=0.1)
    outs = {}
    for path in ("compiled", "reference"):
        monkeypatch.setenv("TETRAREC_KERNELS", "auto" if path == "compiled" else "reference")
        ebc = FusedEmbeddingBagCollection(tables, spec, seed=3, stochastic_rounding=False)
        with torch.no_grad():
            outs[path] = [ebc(_features(s, single, weighted)).values for s in range(2)]
    for x, y in zip(outs["compiled"], outs["reference"], strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
