"""The device cache's code path (slots and backing rows in separate storages), on the CPU.

``CachedEmbeddingBagCollection(device="cuda")`` moves rows between its FP32 slots (on the
device) and its backing rows (in host memory) through host staging buffers
(``movement.StagedRows``). ``force_staged_copies=True`` runs exactly that code on the CPU,
where it must equal the in-place CPU cache bit for bit: outputs, per-id weight gradients,
every stored row and optimizer state after a flush, the slot maps and counters.
"""

import dataclasses

import pytest
import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec, count_ids
from tetrarec.cache.movement import InPlaceRows, StagedRows, TableRows
from tetrarec.cache.parts import CACHE
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2, initial_accumulator=0.1)
ADAM = SparseOptimizerSpec(kind="adam", lr=0.05, weight_decay=0.01)


def tables(precision, pooling):
    """Two tables that share nothing (dims 4 and 3); ``pooling`` of the second."""
    return [
        TableConfig(
            name="a", num_embeddings=24, dim=4, feature_names=("f0", "f1"), precision=precision
        ),
        TableConfig(name="b", num_embeddings=16, dim=3, precision=precision, pooling=pooling),
    ]


def batch(seed, tabs, weighted):
    """Skewed bags (low ids hot: hits, misses and evictions), with weights if asked."""
    gen = torch.Generator().manual_seed(seed)
    bags = {}
    for t in tabs:
        for f in t.feature_names:
            lens = torch.randint(0, 5, (4,), generator=gen).tolist()
            bags[f] = [
                (torch.rand(n, generator=gen) ** 2 * t.num_embeddings).long().tolist() for n in lens
            ]
    sf = SparseFeatures.from_lists(bags)
    if weighted:
        w = (torch.rand(sf.values.numel(), generator=gen) + 0.5).requires_grad_()
        sf = SparseFeatures.from_lengths(sf.keys, sf.values, sf.lengths, weights=w)
    return sf


def build(tabs, spec, policy, backing, tmp_path, **kwargs):
    counts = count_ids([batch(s, tabs, False) for s in range(3)], tabs)
    return CachedEmbeddingBagCollection(
        tabs,
        spec,
        CacheSpec(policy=policy, fraction=0.25, directory=str(tmp_path)),
        placements={t.name: backing for t in tabs},
        static_counts=counts if policy == "static" else None,
        seed=5,
        **kwargs,
    )


def run(module, tabs, weighted, steps=4):
    """Train ``steps`` steps (a state dict taken after step 2); outputs and psw grads."""
    got = []
    for s in range(steps):
        sf = batch(s, tabs, weighted)
        out = module(sf).values
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + s)))
        got.append(out.detach())
        if weighted:
            got.append(sf.weights.grad)
        if s == 1:
            module.state_dict()  # a flush mid-run changes nothing
    return got


def assert_same_state(a, b):
    """Bitwise: outputs aside, everything a checkpoint and the trainer read."""
    sa, sb = a.state_dict(), b.state_dict()  # flushes: every backing row complete
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key
    oa = a.fused_optimizer.state_dict()["state"]
    ob = b.fused_optimizer.state_dict()["state"]
    for table, states in oa.items():
        for name, value in states.items():
            assert torch.equal(value, ob[table][name]), (table, name)
    assert a.cache_stats() == b.cache_stats()
    for name, w in a.table_weights().items():
        assert torch.equal(w, b.table_weights()[name]), name
    assert a.iteration == b.iteration


@pytest.mark.parametrize("variant", ["sum-mean", "weighted"])
@pytest.mark.parametrize("backing", ["cached", "ssd"])
@pytest.mark.parametrize("precision", ["fp16", "int8"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "static"])
def test_staged_path_equals_the_in_place_path_bitwise(
    tmp_path, policy, precision, backing, variant
):
    """4 training steps through the staging buffers equal the in-place CPU cache bitwise.

    Catches: a staged admission copied to the wrong slots or with the wrong state, a
    victim not written back (or written back with other rounding draws), the state of a
    clean cached row not copied back at a flush, host parts' ids or per-id weights split
    other than the in-place path's, a part's rounding stream out of step when the staged
    path skips a part with no ids, counters or slot maps that diverge.
    """
    tabs = tables(precision, "sum" if variant == "weighted" else "mean")
    weighted = variant == "weighted"
    in_place = build(tabs, ADAGRAD, policy, backing, tmp_path / "a")
    staged = build(tabs, ADAGRAD, policy, backing, tmp_path / "b", force_staged_copies=True)
    assert isinstance(in_place._mover, InPlaceRows)
    assert isinstance(staged._mover, StagedRows)  # the switch is not ignored
    for x, y in zip(run(in_place, tabs, weighted), run(staged, tabs, weighted), strict=True):
        assert torch.equal(x, y)
    stats = staged.cache_stats()
    if policy != "static":
        assert sum(s.write_backs for s in stats.values()) > 0  # victims were written back
    assert_same_state(in_place, staged)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_staged_path_with_the_portable_kernels_and_adam(
    monkeypatch, tmp_path, policy, portable_mode
):
    """The portable kernels (what a CUDA device runs) and Adam's two per-element states.

    Catches: staging buffers that only work with the compiled row codecs (a non-contiguous
    buffer, another dtype), state tensors of width D mixed up in the one device-to-host
    copy of a write-back (rows, ``exp_avg``, ``exp_avg_sq`` side by side).
    """
    monkeypatch.setenv("TETRAREC_KERNELS", portable_mode)
    tabs = tables("int8", "mean")
    in_place = build(tabs, ADAM, policy, "cached", tmp_path)
    staged = build(tabs, ADAM, policy, "cached", tmp_path, force_staged_copies=True)
    for x, y in zip(run(in_place, tabs, False), run(staged, tabs, False), strict=True):
        assert torch.equal(x, y)
    assert_same_state(in_place, staged)


def test_staged_resume_equals_uninterrupted(tmp_path):
    """A staged collection loaded from a checkpoint goes on as the uninterrupted one.

    Catches: the cached rows or their state not refreshed into the slots through the
    staging path after a load (``refresh_state``), a resumed cache on other slots.
    """
    tabs = tables("int8", "sum")
    whole = build(tabs, ADAGRAD, "lru", "cached", tmp_path, force_staged_copies=True)
    run(whole, tabs, False, steps=5)
    first = build(tabs, ADAGRAD, "lru", "cached", tmp_path, force_staged_copies=True)
    run(first, tabs, False, steps=3)
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    optim = first.fused_optimizer.state_dict()
    resumed = build(tabs, ADAGRAD, "lru", "cached", tmp_path, force_staged_copies=True)
    resumed.load_state_dict(saved)
    resumed.fused_optimizer.load_state_dict(optim)
    for s in range(3, 5):
        sf = batch(s, tabs, False)
        out = resumed(sf).values
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + s)))
    assert_same_state(whole, resumed)


def test_staged_lookup_adds_the_parts_then_divides_by_the_whole_bag(tmp_path):
    """The pooled output is (0 + backing part's sum + cache part's sum) / bag length.

    A column gets at most two contributions (its table's backing part and the cache), so
    their order cannot show; what can is where the mean's division goes and which parts
    are added. Checked bitwise on bags that mix cached and uncached ids.

    Catches: a part divided by its own share of the bag, a part's sum dropped (a host
    part skipped although it has ids, the cache part's sum not added), pooled rows
    added to the wrong columns.
    """
    tabs = tables("int8", "mean")
    module = build(tabs, ADAGRAD, "lru", "cached", tmp_path, force_staged_copies=True)
    run(module, tabs, False, steps=2)  # warm: some rows cached
    sf = batch(7, tabs, False)
    prepared = module.prepare(sf, admit=False)
    route = prepared.route
    parts = module._parts
    assert all(v.numel() for v in route.values)  # both parts pool ids of this batch
    assert bool((route.lengths[0] > 0).logical_and(route.lengths[1] > 0).any())  # mixed bags
    want = torch.zeros(route.batch, sum(module.feature_dims))
    for p in sorted(range(len(parts)), key=lambda p: parts[p].kind == CACHE):
        pooled = parts[p].module.pool_ids(route.values[p], route.lengths[p], None)
        want[:, parts[p].columns] += pooled
    want /= route.divisor
    assert torch.equal(module.pooled_lookup(prepared), want)


@pytest.mark.parametrize("spec", [ADAGRAD, ADAM, SparseOptimizerSpec(kind="sgd", lr=0.1)])
def test_staged_rows_move_what_in_place_rows_move(spec):
    """Each of the four movements, staged against in-place, on shuffled slots and rows.

    Catches: staged rows scattered to slot ``j`` instead of ``slots[j]`` (or gathered from
    row ``j``), state columns of another name, an SGD collection (no state) failing the
    one device-to-host copy.
    """
    from tetrarec.kernels.optim_rules import state_layout
    from tetrarec.kernels.quant import encode_rows, row_width

    gen = torch.Generator().manual_seed(0)
    dim, rows_n, slots_n, n = 5, 30, 8, 5
    layout = state_layout(spec.kind, dim)

    def backing():
        w = encode_rows(torch.randn(rows_n, dim, generator=gen), Precision.INT8, stochastic=False)
        assert w.shape[1] == row_width(Precision.INT8, dim)
        st = {k: torch.randn(rows_n, width, generator=gen) for k, width in layout.items()}
        return TableRows(w, st, Precision.INT8)

    def slots():
        st = {k: torch.randn(slots_n, width, generator=gen) for k, width in layout.items()}
        return TableRows(torch.randn(slots_n, dim, generator=gen), st, Precision.FP32)

    def clone(t):
        return dataclasses.replace(
            t, rows=t.rows.clone(), state={k: v.clone() for k, v in t.state.items()}
        )

    rows = torch.randperm(rows_n, generator=gen)[:n]
    where = torch.randperm(slots_n, generator=gen)[:n]
    flags = [1, 7, 3, 100, 0]
    b0, s0 = backing(), slots()
    for move in ("load", "store", "copy_state_back", "refresh_state"):
        got = []
        for mover in (InPlaceRows(), StagedRows(torch.device("cpu"))):
            b, s = clone(b0), clone(s0)
            if move == "load":
                mover.load(b, rows, s, where)
            elif move == "store":
                mover.store(s, where, b, rows, flags)
            elif move == "copy_state_back":
                mover.copy_state_back(s, where, b, rows)
            else:
                mover.refresh_state(b, rows, s, where)
            got.append((b, s))
        (b1, s1), (b2, s2) = got
        assert torch.equal(b1.rows, b2.rows), move
        assert torch.equal(s1.rows, s2.rows), move
        for k in layout:
            assert torch.equal(b1.state[k], b2.state[k]), (move, k)
            assert torch.equal(s1.state[k], s2.state[k]), (move, k)
        changed = not torch.equal(b1.rows, b0.rows) or not torch.equal(s1.rows, s0.rows)
        assert changed or move in ("copy_state_back", "refresh_state"), move


def test_device_placement_and_meta_device_are_refused_on_the_cpu():
    """Catches: a ``device`` table silently kept in host memory on a CPU collection, a
    meta device accepted (a cache with no rows)."""
    table = TableConfig(name="t", num_embeddings=10, dim=4, precision="int8")
    spec = CacheSpec(fraction=0.5)
    with pytest.raises(ValueError, match="placement 'device' keeps its rows in device memory"):
        CachedEmbeddingBagCollection([table], ADAGRAD, spec, placements={"t": "device"})
    with pytest.raises(ValueError, match="'meta' is not a device"):
        CachedEmbeddingBagCollection([table], ADAGRAD, spec, device="meta")


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_part_without_ids_keeps_its_rounding_stream(tmp_path, staged):
    """Every part's iteration advances once per backward, also when it had no id.

    With every row cached the backing part never gets an id, and its lookup and update
    are skipped; a later write-back draws its rounding bits at the backing part's
    iteration, which must still be the step count.

    Catches: a skipped part whose iteration stays behind (write-backs and flushes then
    round with another step's draws), a skip that also drops a part that had ids.
    """
    tabs = tables("int8", "sum")
    module = CachedEmbeddingBagCollection(
        tabs, ADAGRAD, CacheSpec(fraction=1.0), seed=5, force_staged_copies=staged
    )
    run(module, tabs, False, steps=3)
    assert module.iteration == 3
    assert [p.module.iteration for p in module._parts] == [3] * len(module._parts)
    assert len(module._parts) == 2  # the backing part exists, without an id


def test_a_device_cache_counts_its_slots_as_device_memory():
    """``CacheMemory``: slots on a device are device bytes, not process memory.

    Catches: a device cache's slots and state reported as RAM (a memory budget or the
    benchmark's RSS comparison then counts them twice), ``device`` tables' rows left out
    of the weight bytes.
    """
    from tetrarec.cache import CacheMemory

    sizes = {
        "backing_ram": 100,
        "backing_ssd": 1000,
        "backing_state_ram": 10,
        "backing_state_ssd": 20,
        "cache_rows": 40,
        "cache_state": 4,
        "metadata": 7,
    }
    cpu = CacheMemory(**sizes)
    assert (cpu.ram_bytes, cpu.device_bytes, cpu.weight_bytes) == (161, 0, 1140)
    gpu = CacheMemory(**sizes, backing_device=200, backing_state_device=2, cache_device="cuda")
    assert (gpu.ram_bytes, gpu.device_bytes, gpu.weight_bytes) == (117, 246, 1340)
