"""FusedEmbeddingBagCollection: parity with the reference collection, bounds, state,
determinism, and compiled == portable."""

import dataclasses
import logging

import pytest
import torch

from tetrarec.embedding import EmbeddingBagCollection, SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

TABLES = [
    TableConfig(name="a", num_embeddings=30, dim=8, feature_names=("f0", "f1")),
    TableConfig(name="b", num_embeddings=11, dim=3, pooling="mean"),
    TableConfig(name="c", num_embeddings=5, dim=16),
]
ADAM = SparseOptimizerSpec(kind="adam", lr=0.05, weight_decay=0.01)


def random_features(seed, tables=TABLES, batch=6, max_len=4, weighted=False):
    gen = torch.Generator().manual_seed(seed)
    bags, weights = {}, {}
    for t in tables:
        for f in t.feature_names:
            lens = torch.randint(0, max_len + 1, (batch,), generator=gen).tolist()
            bags[f] = [
                torch.randint(0, t.num_embeddings, (n,), generator=gen).tolist() for n in lens
            ]
            weights[f] = [torch.rand(n, generator=gen).tolist() for n in lens]
    return SparseFeatures.from_lists(bags, weights=weights if weighted else None)


def test_same_seed_gives_the_reference_initial_weights():
    ref = EmbeddingBagCollection(TABLES, seed=3).table_weights()
    fused = FusedEmbeddingBagCollection(TABLES, ADAM, seed=3).table_weights()
    for name, w in ref.items():
        assert torch.equal(fused[name], w.detach())


def test_forward_matches_reference_sum_and_mean(kernel_path):
    ref = EmbeddingBagCollection(TABLES, seed=3)
    fused = FusedEmbeddingBagCollection(TABLES, ADAM, seed=3)
    sf = random_features(0)
    out = fused(sf)
    assert out.keys == ref.feature_names
    assert out.dims == ref.feature_dims
    torch.testing.assert_close(out.values, ref(sf).values, rtol=1e-6, atol=1e-6)


def test_forward_follows_feature_order_whatever_the_input_order(kernel_path):
    fused = FusedEmbeddingBagCollection(TABLES, ADAM, seed=3)
    sf = random_features(1)
    swapped = SparseFeatures.from_lists({k: v for k, v in reversed(list(_as_lists(sf).items()))})
    assert torch.equal(fused(swapped).values, fused(sf).values)


def _as_lists(sf):
    out = {}
    for k, (vals, lens) in sf.to_dict().items():
        parts = torch.split(vals, lens.tolist())
        out[k] = [p.tolist() for p in parts]
    return out


def test_weighted_forward_and_weight_gradient_match_reference(kernel_path):
    sum_tables = [t for t in TABLES if t.pooling.value == "sum"]
    ref = EmbeddingBagCollection(sum_tables, seed=4)
    fused = FusedEmbeddingBagCollection(sum_tables, SparseOptimizerSpec(kind="sgd", lr=0.1), seed=4)
    sf = random_features(2, tables=sum_tables, weighted=True)
    w_ref = sf.weights.clone().requires_grad_(True)
    w_fused = sf.weights.clone().requires_grad_(True)
    grad = torch.randn(6, sum(ref.feature_dims), generator=torch.Generator().manual_seed(0))
    out_ref = ref(SparseFeatures(sf.keys, sf.values, sf.lengths, sf.batch_size, w_ref))
    out_fused = fused(SparseFeatures(sf.keys, sf.values, sf.lengths, sf.batch_size, w_fused))
    torch.testing.assert_close(out_fused.values, out_ref.values, rtol=1e-6, atol=1e-6)
    out_ref.values.backward(grad)
    out_fused.values.backward(grad)
    torch.testing.assert_close(w_fused.grad, w_ref.grad, rtol=1e-5, atol=1e-6)


def test_float64_weights_pool_as_float32_on_every_path(kernel_path):
    """Bug caught: float64 per-id weights worked on the compiled kernel (which cast them)
    but failed on the portable path ("index_add_(): self (Float) and source (Double)"),
    the one a GPU runs; their gradient still reaches the float64 leaf."""
    sum_tables = [t for t in TABLES if t.pooling.value == "sum"]
    fused = FusedEmbeddingBagCollection(sum_tables, SparseOptimizerSpec(kind="sgd", lr=0.0), seed=4)
    sf = random_features(2, tables=sum_tables, weighted=True)
    w64 = sf.weights.double().requires_grad_(True)
    out = fused(SparseFeatures(sf.keys, sf.values, sf.lengths, sf.batch_size, w64))
    assert out.values.dtype == torch.float32
    assert torch.equal(out.values, fused(sf).values)
    out.values.sum().backward()
    assert w64.grad is not None
    assert w64.grad.dtype == torch.float64


def test_weights_with_mean_pooling_are_rejected():
    fused = FusedEmbeddingBagCollection(TABLES, ADAM, seed=4)
    with pytest.raises(ValueError, match="sum pooling only"):
        fused(random_features(3, weighted=True))


@pytest.mark.parametrize("bad_id", [30, -1])
def test_out_of_range_id_names_feature_id_and_table_size(kernel_path, bad_id):
    fused = FusedEmbeddingBagCollection(TABLES, ADAM, seed=0)
    bags = _as_lists(random_features(4))
    bags["f1"][2] = [1, bad_id]
    with pytest.raises(ValueError, match=rf"feature 'f1': id {bad_id} .*table 'a' of 30 rows"):
        fused(SparseFeatures.from_lists(bags))


def train(fused, steps, seed=0):
    gen = torch.Generator().manual_seed(seed + 100)
    outs = []
    for s in range(steps):
        out = fused(random_features(seed + s, tables=fused.tables)).values
        out.backward(torch.randn(out.shape, generator=gen))
        outs.append(out.detach())
    return outs


MIXED = [
    TableConfig(name="a", num_embeddings=40, dim=8, precision="fp16", feature_names=("f0", "f1")),
    TableConfig(name="b", num_embeddings=11, dim=3, pooling="mean", precision="int8"),
    TableConfig(name="c", num_embeddings=5, dim=16, precision="int4"),
    TableConfig(name="d", num_embeddings=7, dim=4, precision="bf16"),
    TableConfig(name="e", num_embeddings=9, dim=4),
]


def test_state_dict_layout_and_bitwise_round_trip(kernel_path):
    fused = FusedEmbeddingBagCollection(MIXED, ADAM, seed=0)
    train(fused, 2)
    sd = {k: v.clone() for k, v in fused.state_dict().items()}
    osd = fused.fused_optimizer.state_dict()
    opt_state = {t: {k: v.clone() for k, v in s.items()} for t, s in osd["state"].items()}
    assert sd["weights.a"].shape == (40, 8)
    assert sd["weights.a"].dtype == torch.float16
    assert sd["weights.b"].shape == (11, Precision.INT8.row_bytes(3))
    assert sd["weights.b"].dtype == torch.uint8
    assert not any(k.startswith("state.") for k in sd)  # the optimizer holds the state
    assert opt_state["e"]["exp_avg"].shape == (9, 4)
    assert opt_state["e"]["step"].shape == (9,)
    assert osd["param_groups"][0]["kind"] == "adam"
    other = FusedEmbeddingBagCollection(MIXED, ADAM, seed=99)
    other.load_state_dict(sd)
    other.fused_optimizer.load_state_dict({"state": opt_state, "param_groups": osd["param_groups"]})
    for k, v in other.state_dict().items():
        assert torch.equal(v, sd[k]), k
    for t, names in other.fused_optimizer.state_dict()["state"].items():
        for k, v in names.items():
            assert torch.equal(v, opt_state[t][k]), (t, k)
    other.seed, other.iteration = fused.seed, fused.iteration  # same rounding stream
    assert all(torch.equal(x, y) for x, y in zip(train(fused, 2, 7), train(other, 2, 7)))


def test_load_state_dict_reports_missing_and_wrong_shapes():
    fused = FusedEmbeddingBagCollection(MIXED, ADAM, seed=0)
    sd = fused.state_dict()
    del sd["weights.c"]
    result = fused.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["weights.c"]
    sd["weights.c"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"weights\.c"):
        fused.load_state_dict(sd)


def test_deterministic_bitwise_across_runs_and_thread_counts(kernel_path):
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            fused = FusedEmbeddingBagCollection(MIXED, ADAM, seed=0)
            outs = train(fused, 3)
            results.append((outs, {k: v.clone() for k, v in fused.state_dict().items()}))
    finally:
        torch.set_num_threads(threads)
    for outs, sd in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outs, results[0][0]))
        assert all(torch.equal(sd[k], results[0][1][k]) for k in sd)


def test_nondeterministic_mode_agrees_within_rounding(kernel_path):
    a = FusedEmbeddingBagCollection(TABLES, ADAM, seed=0, deterministic=True)
    b = FusedEmbeddingBagCollection(TABLES, ADAM, seed=0, deterministic=False)
    train(a, 3)
    train(b, 3)
    for name, w in a.table_weights().items():
        torch.testing.assert_close(b.table_weights()[name], w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8", "int4"])
def test_compiled_matches_reference_path(monkeypatch, precision):
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    tables = [TableConfig(name=t.name, num_embeddings=t.num_embeddings, dim=t.dim,
                          feature_names=t.feature_names, pooling=t.pooling, precision=precision)
              for t in TABLES]  # fmt: skip
    runs = {}
    for path in ("compiled", "reference"):
        monkeypatch.setenv("TETRAREC_KERNELS", "auto" if path == "compiled" else "reference")
        fused = FusedEmbeddingBagCollection(tables, ADAM, seed=0, stochastic_rounding=False)
        runs[path] = (train(fused, 3), fused.table_weights())
    for x, y in zip(runs["compiled"][0], runs["reference"][0]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    prec = Precision.parse(precision)
    for name, w in runs["reference"][1].items():
        got = runs["compiled"][1][name]
        if prec is Precision.FP32:
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
        else:  # rounding may flip by one step where the FP32 results differ in the last bit
            step = (w.amax(1, keepdim=True) - w.amin(1, keepdim=True)) / 15 + w.abs() / 128
            assert ((got - w).abs() <= step + 1e-6).all(), name


def test_forced_reference_mode_and_bad_mode(monkeypatch):
    monkeypatch.setenv("TETRAREC_KERNELS", "reference")
    assert compiled_cpu_kernels() is None
    monkeypatch.setenv("TETRAREC_KERNELS", "fastest")
    with pytest.raises(ValueError, match="fastest"):
        compiled_cpu_kernels()


def test_module_protocol():
    fused = FusedEmbeddingBagCollection(TABLES, ADAM, seed=0)
    assert isinstance(fused.fused_optimizer, torch.optim.Optimizer)
    assert fused.feature_names == ("f0", "f1", "b", "c")
    assert fused.feature_dims == (8, 8, 3, 16)
    assert list(fused.parameters()) == []
    with torch.no_grad():  # evaluation: no update
        out = fused(random_features(0)).values
    assert not out.requires_grad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
def test_cuda_runs_the_portable_path_and_matches_cpu(rounding):
    """Bug caught: the portable path (or its stochastic-rounding noise, drawn on the host)
    breaks or diverges for CUDA tensors."""
    cpu = FusedEmbeddingBagCollection(MIXED, ADAM, seed=0, stochastic_rounding=rounding)
    gpu = FusedEmbeddingBagCollection(
        MIXED, ADAM, seed=0, stochastic_rounding=rounding, device="cuda"
    )
    for s in range(2):
        sf = random_features(s, tables=MIXED)
        out_cpu = cpu(sf).values
        out_gpu = gpu(sf.to("cuda")).values
        _assert_close_but_for_rounding_flips(
            out_gpu.cpu(), out_cpu, rounding, "output", (1e-5, 1e-5)
        )
        grad = torch.randn(out_cpu.shape, generator=torch.Generator().manual_seed(s))
        out_cpu.backward(grad)
        out_gpu.backward(grad.cuda())
    for name, w in cpu.table_weights().items():
        _assert_close_but_for_rounding_flips(
            gpu.table_weights()[name].cpu(), w, rounding, name, (1e-3, 1e-2)
        )


def _assert_close_but_for_rounding_flips(got, want, rounding, what, rtol_atol):
    """Close; with stochastic rounding, the same random bits on both devices (the rule is
    bit for bit the same) but optimizer arithmetic that differs in the last FP32 bit, so a
    value within float error of a rounding boundary may round the other way: a few."""
    if rounding:
        flips = ((got - want).abs() > 1e-5).float().mean()
        assert flips < 0.02, f"{what}: {flips:.1%} of the values differ"
    else:
        torch.testing.assert_close(got, want, rtol=rtol_atol[0], atol=rtol_atol[1])


def test_failed_build_falls_back_once_with_a_warning(monkeypatch, tmp_path, caplog):
    from tetrarec.kernels import _build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh build directory
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TETRAREC_KERNELS", "auto")
    monkeypatch.delenv("CI", raising=False)  # in CI a failed build is an error
    monkeypatch.setattr(_build, "_STATE", {})
    with caplog.at_level(logging.WARNING, logger="tetrarec.kernels._build"):
        assert compiled_cpu_kernels() is None
        assert compiled_cpu_kernels() is None
    assert sum("portable PyTorch path" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(_build, "_STATE", {})
    monkeypatch.setenv("TETRAREC_KERNELS", "compiled")
    with pytest.raises(RuntimeError, match="building tetrarec CPU kernels failed"):
        compiled_cpu_kernels()


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_resumed_low_precision_training_rounds_the_same(kernel_path, precision):
    """The stochastic-rounding stream position travels in the state dict."""
    tables = [dataclasses.replace(t, precision=Precision.parse(precision)) for t in TABLES]

    def step(module, s):
        out = module(random_features(s, tables=tables)).values
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(s)))

    straight = FusedEmbeddingBagCollection(tables, ADAM, seed=5)
    first = FusedEmbeddingBagCollection(tables, ADAM, seed=5)
    for s in range(4):
        step(straight, s)
    for s in range(2):
        step(first, s)
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    saved_opt = first.fused_optimizer.state_dict()
    saved_opt["state"] = {
        t: {k: v.clone() for k, v in s.items()} for t, s in saved_opt["state"].items()
    }
    resumed = FusedEmbeddingBagCollection(tables, ADAM, seed=99)
    resumed.load_state_dict(saved)
    resumed.fused_optimizer.load_state_dict(saved_opt)
    assert resumed.iteration == first.iteration
    for s in range(2, 4):
        step(resumed, s)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    for t, names in straight.fused_optimizer.state_dict()["state"].items():
        for k, v in names.items():
            assert torch.equal(resumed.fused_optimizer.state_dict()["state"][t][k], v), (t, k)


def test_a_batch_of_no_samples_pools_nothing_and_updates_nothing(kernel_path):
    """Bug caught: the portable path (every CUDA tensor's) failing on a batch of no
    samples ("slice step cannot be zero"): a rank's share of a short last evaluation
    batch, which stopped a sharded run on every rank."""
    fused = FusedEmbeddingBagCollection(MIXED, ADAM, seed=0)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    empty = SparseFeatures.from_lists({f: [] for t in MIXED for f in t.feature_names})
    out = fused(empty).values
    assert out.shape == (0, sum(t.dim for t in MIXED for _ in t.feature_names))
    out.backward(torch.zeros_like(out))
    for name, value in fused.state_dict().items():
        if name != "rounding":  # the backward count moves on
            assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("kind", ["adam", "rowwise_adam"])
def test_compiled_adam_matches_the_reference_to_the_last_bits(monkeypatch, kind):
    """FP32 Adam, three steps at lr 0.5: the compiled and portable paths within a few
    FP32 steps of each other.

    Bug it catches: the compiled kernel's 1 - beta computed in FP32 from the rounded beta
    (1.0f - 0.999f = 0.00100004673, 5e-5 off), so its rows drifted 3e-6 from the
    reference's in one step, and INT8 rows encoded from them fell on other FP16 grids.
    """
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    spec = SparseOptimizerSpec(kind=kind, lr=0.5)
    weights = {}
    for path in ("auto", "reference"):
        monkeypatch.setenv("TETRAREC_KERNELS", path)
        fused = FusedEmbeddingBagCollection(TABLES, spec, seed=0)
        train(fused, 3)
        weights[path] = fused.table_weights()
    for name, w in weights["reference"].items():
        torch.testing.assert_close(weights["auto"][name], w, rtol=0, atol=4e-7, msg=name)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam", "rowwise_adam"])
def test_training_matches_the_reference_collection_and_its_optimizer(kernel_path, kind):
    """The reference collection with ``train.optim.build_sparse_optimizer`` is the oracle
    of ``model.embedding = "reference"``. Bug caught: its Adam was torch's SparseAdam
    (bias correction by the table's step count), so rows that skip steps (small batches
    of short bags here) trained differently from the fused module's (each row's own
    count) by up to 14% of lr in one step; row-wise Adam had no reference at all."""
    from tetrarec.train.optim import build_sparse_optimizer

    wd = 0.0 if kind in ("sgd", "adagrad") else 0.01  # torch's sparse SGD/Adagrad: no L2
    spec = SparseOptimizerSpec(kind=kind, lr=0.05, weight_decay=wd)
    ref = EmbeddingBagCollection(TABLES, seed=3)
    opt = build_sparse_optimizer(spec, list(ref.parameters()))
    fused = FusedEmbeddingBagCollection(TABLES, spec, seed=3)
    for step in range(6):
        sf = random_features(20 + step, batch=2, max_len=2)
        target = torch.randn(fused(sf).values.shape, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ((ref(sf).values - target) ** 2).sum().backward()
        opt.step()
        ((fused(sf).values - target) ** 2).sum().backward()  # the update runs in backward
    got, want = fused.table_weights(), ref.table_weights()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w.detach(), rtol=1e-5, atol=1e-6, msg=name)
