"""INT8/INT4 (and FP16) inference tables against FP32, and the two lookup paths.

Bounds are per row, from each row's own stored scale (STYLE.md section 6): an INT8/INT4
element decodes within ``scale/2`` of its FP32 value (the codes are computed on the
FP16-rounded grid, which covers the row's min and max), plus FP32 rounding of the
decode ``q * scale + bias``; a bag's error is the sum of its ids' bounds times their
weights (divided by the bag length for mean pooling).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tetrarec.embedding import TableConfig
from tetrarec.inference.embeddings import (
    BACKENDS,
    DEFAULT_BACKEND,
    TETRAREC_UP_TO_DIM,
    TORCH_FASTER,
    InferenceEmbeddingBags,
)
from tetrarec.inference.quantize import convert_rows, tables_at
from tetrarec.sparse import SparseFeatures
from tetrarec.types import PoolingMode, Precision

EPS32 = 2.0**-23
ROWS = 50
DIMS = {"a": 8, "b": 6, "c": 8}


def _tables(precision: Precision, pooling: PoolingMode) -> list[TableConfig]:
    return [
        TableConfig(name=n, num_embeddings=ROWS, dim=d, precision=precision, pooling=pooling)
        for n, d in DIMS.items()
    ]


def _fp32_rows() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    # rows of very different ranges: one global tolerance would be too loose for some
    return {
        n: torch.randn(ROWS, d, generator=gen) * torch.logspace(-3, 1, ROWS)[:, None]
        for n, d in DIMS.items()
    }


def _features(weighted: bool, batch: int = 16) -> SparseFeatures:
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 5, (len(DIMS) * batch,), generator=gen)
    values = torch.randint(ROWS, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) * 2 - 0.5 if weighted else None
    return SparseFeatures(
        keys=tuple(DIMS), values=values, lengths=lengths, batch_size=batch, weights=weights
    )


def _row_bounds(stored: torch.Tensor, fp32: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``(rows,)``: the largest decode error of any element of each row."""
    if precision is Precision.FP16:
        return fp32.abs().amax(1) * 2.0**-11  # round to nearest, 11 significant bits
    dim = fp32.shape[1]
    payload = (dim * precision.bits + 7) // 8
    scale_bias = stored[:, payload : payload + 4].contiguous().view(torch.float16).float()
    scale, bias = scale_bias[:, 0], scale_bias[:, 1]
    levels = (1 << precision.bits) - 1
    decode = 4 * EPS32 * (fp32.abs().amax(1) + bias.abs() + levels * scale)
    return scale / 2 + decode


def _bag_bounds(sf: SparseFeatures, bounds: dict[str, torch.Tensor], mean: bool) -> torch.Tensor:
    """``(B, F)``: each bag's bound: sum of |weight| x its ids' row bounds (/ L for mean)."""
    batch = sf.batch_size
    out = torch.zeros(len(sf.keys), batch)
    lengths = sf.lengths.view(len(sf.keys), batch)
    start = 0
    w = sf.weights if sf.weights is not None else torch.ones(sf.values.numel())
    for f, key in enumerate(sf.keys):
        for b in range(batch):
            n = int(lengths[f, b])
            ids, ws = sf.values[start : start + n], w[start : start + n]
            out[f, b] = (ws.abs() * bounds[key][ids]).sum() / (max(n, 1) if mean else 1)
            start += n
    return out.t()


def _per_feature(values: torch.Tensor) -> list[torch.Tensor]:
    return list(values.split(list(DIMS.values()), dim=1))


@pytest.mark.parametrize("backend", ["tetrarec", "torch", "auto"])
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("precision", [Precision.FP16, Precision.INT8, Precision.INT4])
def test_quantized_tables_pool_within_each_rows_bound_of_fp32(
    precision: Precision, weighted: bool, pooling: PoolingMode, backend: str
) -> None:
    """Catches a wrong scale or bias layout (FP16 pair swapped, INT4 nibbles reversed,
    padding read as codes), a per-sample weight or mean divisor dropped by one path:
    each breaks some row's own scale-derived bound, where a global tolerance sized for
    the widest row would let the narrow rows' errors through."""
    fp32 = _fp32_rows()
    stored = {n: convert_rows(r, Precision.FP32, precision, DIMS[n]) for n, r in fp32.items()}
    ref = InferenceEmbeddingBags(_tables(Precision.FP32, pooling), fp32)
    quant = InferenceEmbeddingBags(_tables(precision, pooling), stored, backend=backend)
    sf = _features(weighted)
    bound = _bag_bounds(
        sf,
        {n: _row_bounds(stored[n], fp32[n], precision) for n in DIMS},
        pooling is PoolingMode.MEAN,
    )
    for f, (q, r) in enumerate(zip(_per_feature(quant(sf).values), _per_feature(ref(sf).values))):
        err = (q - r).abs().amax(1)  # (B,)
        slack = 1e-6 * (r.abs().amax(1) + 1e-6)  # FP32 sums in another order
        assert bool((err <= bound[:, f] + slack).all()), (f, (err - bound[:, f]).max())


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pruned", [False, True])
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.INT8, Precision.INT4])
def test_both_lookup_paths_give_the_same_sums(
    precision: Precision, weighted: bool, pooling: PoolingMode, pruned: bool
) -> None:
    """Catches the torch path drifting from tetrarec's kernel on the same stored rows
    (a repacking error in ``torch_packed_rows``, mean or weights handled otherwise, a
    pruned table's remap not applied before PyTorch's op)."""
    fp32 = _fp32_rows()
    stored = {n: convert_rows(r, Precision.FP32, precision, DIMS[n]) for n, r in fp32.items()}
    remaps = {}
    if pruned:  # table b keeps its even ids; the zero row is the last stored row
        keep = stored["b"][0::2]
        stored["b"] = torch.cat([keep, torch.zeros_like(keep[:1])])
        remaps["b"] = torch.where(
            torch.arange(ROWS) % 2 == 0, torch.arange(ROWS) // 2, keep.shape[0]
        ).to(torch.int32)
    tables = _tables(precision, pooling)
    tables[1] = TableConfig(
        name="b", num_embeddings=stored["b"].shape[0], dim=DIMS["b"], precision=precision,
        pooling=pooling,
    )  # fmt: skip
    out = {
        b: InferenceEmbeddingBags(tables, stored, remaps=remaps, backend=b)(
            _features(weighted)
        ).values
        for b in ("tetrarec", "torch")
    }
    # Same decoded values, summed in another order: a few FP32 ulps of the bag's magnitude.
    magnitude = out["tetrarec"].abs() + 1e-6
    assert bool(((out["torch"] - out["tetrarec"]).abs() <= 64 * EPS32 * magnitude + 1e-6).all())
    if pruned:  # odd ids of table b pool to zero on both paths
        sf = SparseFeatures.from_lists({"a": [[0]], "b": [[1, 3]], "c": [[0]]})
        for b in ("tetrarec", "torch"):
            bags = InferenceEmbeddingBags(tables, stored, remaps=remaps, backend=b)
            assert torch.equal(_per_feature(bags(sf).values)[1], torch.zeros(1, DIMS["b"]))


def test_auto_is_the_default_and_says_which_path_each_precision_takes() -> None:
    """Catches the measured choice not being the default, a path report that does not
    match what runs, or the narrow-table rule not applied (tables of dims 6-8 stay on
    tetrarec's kernel; one INT8/INT4 table wider than ``TETRAREC_UP_TO_DIM`` moves its
    precision to PyTorch's bags)."""
    assert DEFAULT_BACKEND == "auto"
    wide = TETRAREC_UP_TO_DIM + 8
    for precision in (Precision.FP32, Precision.FP16, Precision.INT8, Precision.INT4):
        fp32 = _fp32_rows()
        stored = {n: convert_rows(r, Precision.FP32, precision, DIMS[n]) for n, r in fp32.items()}
        bags = InferenceEmbeddingBags(_tables(precision, PoolingMode.SUM), stored)
        assert bags.backend == "auto"
        assert bags.lookup_paths == {precision: "tetrarec"}
        assert InferenceEmbeddingBags(
            _tables(precision, PoolingMode.SUM), stored, backend="tetrarec"
        ).lookup_paths == {precision: "tetrarec"}
        tables = [
            *_tables(precision, PoolingMode.SUM),
            TableConfig(name="w", num_embeddings=ROWS, dim=wide, precision=precision),
        ]
        stored["w"] = convert_rows(torch.randn(ROWS, wide), Precision.FP32, precision, wide)
        want = "torch" if precision in TORCH_FASTER else "tetrarec"
        assert InferenceEmbeddingBags(tables, stored).lookup_paths == {precision: want}
        assert BACKENDS["auto"].path(precision, wide) == want
        assert BACKENDS["auto"].path(precision, TETRAREC_UP_TO_DIM) == "tetrarec"
    assert BACKENDS["torch"].path(Precision.FP16, 64) == "tetrarec"  # PyTorch has no FP16 bag


def test_unknown_backend_is_a_clear_error() -> None:
    """Catches a typo in the backend name running some default path."""
    with pytest.raises(ValueError, match=r"unknown lookup backend 'fbgemm'; valid: \['auto'"):
        InferenceEmbeddingBags(
            _tables(Precision.FP32, PoolingMode.SUM), _fp32_rows(), backend="fbgemm"
        )


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(("feature", "bad_id"), [("a", 5), ("b", -1), ("b", 4), ("c", 9)])
def test_an_id_outside_its_table_is_named_with_its_feature(backend, feature, bad_id) -> None:
    """Bugs caught: the one-pass bounds check (every feature's ids against their table's
    rows at once) naming the wrong feature (an off-by-one between the first bad id and
    its feature's range), letting a negative or too-large id through to a kernel, or
    checking a pruned table against its stored rows instead of the ids it answers."""
    tables = [
        TableConfig(name="a", num_embeddings=5, dim=4, feature_names=("a",)),
        TableConfig(name="b", num_embeddings=4, dim=4, feature_names=("b",)),
        TableConfig(name="c", num_embeddings=3, dim=4, feature_names=("c",)),
    ]
    rows = {t.name: torch.randn(t.num_embeddings, 4) for t in tables}
    remap = torch.tensor([0, 1, 2, 2, 1, 0, 2, 2, 2], dtype=torch.int32)  # c: 9 ids, 3 rows
    bags = InferenceEmbeddingBags(tables, rows, remaps={"c": remap}, backend=backend)
    good = {"a": [[0, 4], [1]], "b": [[3], [0, 2]], "c": [[8], [0, 1]]}
    bags(SparseFeatures.from_lists(good))  # every id in range, the pruned table's too
    bad = {k: [list(b) for b in v] for k, v in good.items()}
    bad[feature][1].append(bad_id)
    with pytest.raises(ValueError, match=rf"feature '{feature}': id {bad_id} is outside"):
        bags(SparseFeatures.from_lists(bad))


def _fake_model(dims: dict[str, int]) -> object:
    manifest = dataclasses.make_dataclass("M", [("tables", list)])(
        [{"name": n, "dim": d} for n, d in dims.items()]
    )
    return dataclasses.make_dataclass("Model", [("manifest", object)])(manifest)


def test_tables_at_never_stores_a_table_larger_than_a_wider_precision_would() -> None:
    """Bugs caught: ``--tables int8`` storing a first-order term's dim-1 table in 8-byte
    INT8 rows (twice its FP32 bytes), a dim-4 table in INT8 when FP16 takes the same
    8 bytes at more precision, or an explicit BF16 ask turned into something else."""
    fake = _fake_model({"fo": 1, "narrow": 4, "wide": 16})
    at = tables_at(fake, Precision.INT8)  # type: ignore[arg-type]
    assert at == {"fo": Precision.FP16, "narrow": Precision.FP16, "wide": Precision.INT8}
    at = tables_at(fake, Precision.INT4)  # type: ignore[arg-type]
    assert at == {"fo": Precision.FP16, "narrow": Precision.FP16, "wide": Precision.INT4}
    assert set(tables_at(fake, Precision.BF16).values()) == {Precision.BF16}  # type: ignore[arg-type]
    assert set(tables_at(fake, Precision.FP32).values()) == {Precision.FP32}  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp8 is not a table precision"):
        tables_at(fake, Precision.FP8)  # type: ignore[arg-type]


def test_the_torch_path_pools_runs_of_mixed_tables_as_tetrarecs_kernel() -> None:
    """Bugs caught in the grouped PyTorch path (one call per run of consecutive features
    whose tables share precision, dim and pooling): a run that spans a feature of another
    precision or dim, a shared table's rows stacked twice or its second feature shifted
    to the wrong rows, a run's output written to another run's columns."""
    specs = [  # name, rows, dim, precision, features
        ("a", 30, 8, Precision.INT8, ("a1", "a2")),  # a table shared by two features
        ("b", 20, 8, Precision.INT8, ("b",)),  # the same kind: one run a1 a2 b
        ("c", 25, 4, Precision.INT8, ("c",)),  # another dim: a run of its own
        ("d", 10, 8, Precision.FP16, ("d",)),  # tetrarec's kernel, between runs
        ("e", 15, 8, Precision.INT4, ("e",)),
        ("f", 12, 8, Precision.FP32, ("f",)),
    ]
    gen = torch.Generator().manual_seed(0)
    tables, stored = [], {}
    for name, rows, dim, precision, features in specs:
        tables.append(
            TableConfig(
                name=name, num_embeddings=rows, dim=dim, precision=precision,
                feature_names=features,
            )
        )  # fmt: skip
        fp32 = torch.randn(rows, dim, generator=gen)
        stored[name] = convert_rows(fp32, Precision.FP32, precision, dim)
    ids = {f: t.num_embeddings for t in tables for f in t.feature_names}
    bags = {
        f: [
            torch.randint(0, n, (int(k),), generator=gen).tolist()
            for k in torch.randint(0, 4, (9,), generator=gen)
        ]
        for f, n in ids.items()
    }
    features = SparseFeatures.from_lists(bags)
    out = {
        b: InferenceEmbeddingBags(tables, stored, backend=b)(features).values
        for b in ("tetrarec", "torch")
    }
    torch.testing.assert_close(out["torch"], out["tetrarec"], rtol=1e-5, atol=1e-5)


def test_an_odd_dim_int4_table_pools_with_tetrarecs_kernel() -> None:
    """Bug caught on a GPU run's CPU side: PyTorch's 4-bit bag reads an odd dim as one
    more column (a first-order term's dim-1 INT4 table came back (B, 2) and broke the
    output's shape), so a module with one pools its INT4 tables with tetrarec's kernel;
    INT8 odd dims are fine on PyTorch's byte bag."""
    tables = [
        TableConfig(name="odd", num_embeddings=9, dim=1, precision=Precision.INT4),
        TableConfig(name="even", num_embeddings=9, dim=4, precision=Precision.INT4),
        TableConfig(name="odd8", num_embeddings=9, dim=3, precision=Precision.INT8),
    ]
    gen = torch.Generator().manual_seed(1)
    stored = {
        t.name: convert_rows(
            torch.randn(9, t.dim, generator=gen), Precision.FP32, t.precision, t.dim
        )
        for t in tables
    }
    bags = InferenceEmbeddingBags(tables, stored, backend="torch")
    assert bags.lookup_paths == {Precision.INT4: "tetrarec", Precision.INT8: "torch"}
    features = SparseFeatures.from_lists({t.name: [[1, 2], [8]] for t in tables})
    want = InferenceEmbeddingBags(tables, stored, backend="tetrarec")(features).values
    torch.testing.assert_close(bags(features).values, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP16, Precision.INT8])
def test_a_model_without_tables_on_pytorch_checks_its_ids_in_the_kernel(precision) -> None:
    """Bug caught: ``on_torch`` listed the backend's PyTorch precisions whether or not the
    model had such tables, so an FP32 or narrow INT8 model never let tetrarec's kernel
    check the ids and paid a separate pass over them every call."""
    stored = {
        n: convert_rows(r, Precision.FP32, precision, DIMS[n]) for n, r in _fp32_rows().items()
    }
    bags = InferenceEmbeddingBags(_tables(precision, PoolingMode.SUM), stored)
    assert BACKENDS["auto"].on_torch(bags, torch.device("cpu")) == frozenset()
    checks = []
    real = bags._check_ids
    bags._check_ids = lambda *a: checks.append(1) or real(*a)  # type: ignore[method-assign]
    bags(_features(weighted=False))
    assert checks == []
    with pytest.raises(ValueError, match=r"feature 'b': id 50 is outside its table of 50 rows"):
        bags(SparseFeatures.from_lists({"a": [[0]], "b": [[1, 50]], "c": [[0]]}))
