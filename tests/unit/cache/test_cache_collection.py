"""CachedEmbeddingBagCollection against a plain oracle and the uncached collections."""

import dataclasses

import pytest
import torch
from cache_oracle import CacheOracle

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec, count_ids
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

TABLES = [
    TableConfig(name="a", num_embeddings=24, dim=4, feature_names=("f0", "f1")),
    TableConfig(name="b", num_embeddings=16, dim=3, pooling="mean"),
]
SGD = SparseOptimizerSpec(kind="sgd", lr=0.3)
ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2, initial_accumulator=0.1)
ADAM = SparseOptimizerSpec(kind="adam", lr=0.05, weight_decay=0.01)


def with_precision(precision, tables=TABLES):
    return [dataclasses.replace(t, precision=Precision.parse(precision)) for t in tables]


def random_bags(seed, tables=TABLES, batch=4, max_len=4):
    """{feature: [[ids]]} drawn with a skew (low ids are hot), so caches hit and evict."""
    gen = torch.Generator().manual_seed(seed)
    bags = {}
    for t in tables:
        for f in t.feature_names:
            lens = torch.randint(0, max_len + 1, (batch,), generator=gen).tolist()
            bags[f] = [
                (torch.rand(n, generator=gen) ** 2 * t.num_embeddings).long().tolist() for n in lens
            ]
    return bags


def upstream(seed, out_shape):
    return torch.randn(out_shape, generator=torch.Generator().manual_seed(1000 + seed))


def train(module, steps, start=0, tables=TABLES):
    """Run ``steps`` training steps; return the outputs."""
    outs = []
    for s in range(start, start + steps):
        out = module(SparseFeatures.from_lists(random_bags(s, tables))).values
        out.backward(upstream(s, out.shape))
        outs.append(out.detach())
    return outs


@pytest.fixture
def reference_kernels(monkeypatch, portable_mode):
    """The portable kernel path: its float operations are the oracle's, bit for bit."""
    monkeypatch.setenv("TETRAREC_KERNELS", portable_mode)


@pytest.mark.parametrize("spec", [SGD, ADAGRAD], ids=["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("precision", ["int8", "fp16"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_matches_the_oracle_with_evictions(reference_kernels, spec, precision, policy):
    """Oracle over 6 steps with a cache of 1/4 of the rows (sum and mean tables).

    Catches: a wrong victim or admission order, a lost write-back or state copy on
    eviction, a cached row also updated in the backing store (two updates per step), a
    mean bag divided by its part's length instead of its whole length, rounding drawn at
    another iteration or row, counters that do not count ids.
    """
    tables = with_precision(precision)
    module = CachedEmbeddingBagCollection(
        tables, spec, CacheSpec(policy=policy, fraction=0.25), seed=11
    )
    capacity = {t.name: t.num_embeddings // 4 for t in tables}
    oracle = CacheOracle(tables, spec, policy, capacity, seed=11)
    for s in range(6):
        bags = random_bags(s, tables)
        out = module(SparseFeatures.from_lists(bags)).values
        grad = upstream(s, out.shape)
        out.backward(grad)
        want = oracle.step(bags, grad)
        torch.testing.assert_close(out.detach(), want, rtol=1e-6, atol=1e-6)
    stats = module.cache_stats()
    assert sum(s.evictions for s in stats.values()) > 0  # the cache was too small
    for t in tables:
        cached = {int(r) for r in module._caches[tables.index(t)].slot_rows.tolist() if r >= 0}
        assert cached == set(oracle.cached[t.name]), t.name
        hits, misses, evictions, write_backs = oracle.counts[t.name]
        got = stats[t.name]
        assert (got.hits, got.misses, got.evictions, got.write_backs) == (
            hits,
            misses,
            evictions,
            write_backs,
        )
        weights = module.table_weights()[t.name]
        for r in range(t.num_embeddings):
            assert torch.equal(weights[r], oracle._row(t, r)), (t.name, r)
    # checkpoint flush: the saved tables are the oracle's after its own flush
    oracle.flush()
    saved = module.state_dict()
    state = module.fused_optimizer.state_dict()["state"]
    for t in tables:
        assert torch.equal(saved[f"weights.{t.name}"], oracle.stored[t.name]), t.name
        for k, v in oracle.state[t.name].items():
            assert torch.equal(state[t.name][k].reshape(v.shape), v), (t.name, k)


def test_cache_of_every_row_equals_the_fp32_collection():
    """All rows cached: exactly FP32 training from the dequantized initial rows.

    Catches: cached rows read or updated anywhere but in FP32, admission that does not
    decode the stored row exactly, a mean bag divided twice, an output sum that is not
    exact when one part is empty.
    """
    tables = with_precision("int8")
    cached = CachedEmbeddingBagCollection(tables, ADAM, CacheSpec(fraction=1.0), seed=4)
    fp32 = FusedEmbeddingBagCollection(with_precision("fp32"), ADAM, seed=4)
    fp32.load_state_dict(
        {f"weights.{k}": v for k, v in cached.table_weights().items()}, strict=False
    )
    for x, y in zip(train(cached, 5), train(fp32, 5)):
        assert torch.equal(x, y)
    for name, w in fp32.table_weights().items():
        assert torch.equal(cached.table_weights()[name], w), name
    mine = cached.fused_optimizer.state_dict()["state"]
    for name, states in fp32.fused_optimizer.state_dict()["state"].items():
        for k, v in states.items():
            assert torch.equal(mine[name][k], v), (name, k)


@pytest.mark.parametrize("precision", ["int8", "bf16", "int4"])
def test_cache_of_no_row_equals_the_uncached_collection(precision):
    """Size 0: bitwise the low-precision FusedEmbeddingBagCollection (same rounding stream).

    Catches: the split of bags changing the pooled sums, mean pooling handled other than
    the kernel's, a backing iteration out of step (another rounding stream), a state
    dict layout other than the uncached collection's.
    """
    tables = with_precision(precision)
    cached = CachedEmbeddingBagCollection(tables, ADAGRAD, CacheSpec(fraction=0.0), seed=2)
    plain = FusedEmbeddingBagCollection(tables, ADAGRAD, seed=2)
    for x, y in zip(train(cached, 4), train(plain, 4)):
        assert torch.equal(x, y)
    saved, want = cached.state_dict(), plain.state_dict()
    for key, value in want.items():
        assert torch.equal(saved[key], value), key
    assert all(s.hits == 0 and s.misses > 0 for s in cached.cache_stats().values())


def test_host_placement_is_the_uncached_collection_beside_cached_tables():
    """A ``host`` table beside a cached one trains exactly as in the uncached collection.

    Catches: ids of an uncached table routed to the cache, or columns of one part
    written over another's.
    """
    tables = with_precision("fp16")
    mixed = CachedEmbeddingBagCollection(
        tables, SGD, CacheSpec(fraction=0.5), placements={"b": "host"}, seed=8
    )
    plain = FusedEmbeddingBagCollection(tables, SGD, seed=8)
    train(mixed, 4)
    train(plain, 4)
    assert "b" not in mixed.cache_stats()
    assert torch.equal(mixed.state_dict()["weights.b"], plain.state_dict()["weights.b"])


def test_counters_add_up_to_the_ids_looked_up():
    """``hits + misses`` is every id of every training batch; evaluation counts nothing.

    Catches: counting unique ids instead of lookups, or counting evaluation lookups.
    """
    module = CachedEmbeddingBagCollection(TABLES, SGD, CacheSpec(fraction=0.3), seed=1)
    train(module, 5)
    looked_up = {t.name: 0 for t in TABLES}
    for s in range(5):
        bags = random_bags(s)
        for t in TABLES:
            looked_up[t.name] += sum(len(b) for f in t.feature_names for b in bags[f])
    module.eval()
    module(SparseFeatures.from_lists(random_bags(99)))
    for name, stats in module.cache_stats().items():
        assert stats.hits + stats.misses == looked_up[name]
        assert stats.hits > 0
        assert stats.occupied <= stats.capacity


def test_save_load_continue_equals_uninterrupted():
    """Checkpoint after 3 steps, resume in a new module: bitwise the straight run.

    Catches: a cache not restored (slot map, FP32 rows, dirty flags, LRU clock),
    optimizer state of cached rows lost, a rounding stream restarted.
    """
    tables = with_precision("int8")

    def make(seed):
        return CachedEmbeddingBagCollection(tables, ADAGRAD, CacheSpec(fraction=0.25), seed=seed)

    straight, first = make(5), make(5)
    want = train(straight, 6)
    train(first, 3)
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    opt = first.fused_optimizer.state_dict()
    opt["state"] = {t: {k: v.clone() for k, v in s.items()} for t, s in opt["state"].items()}
    resumed = make(99)
    resumed.load_state_dict(saved)
    resumed.fused_optimizer.load_state_dict(opt)
    got = train(resumed, 3, start=3)
    for x, y in zip(got, want[3:]):
        assert torch.equal(x, y)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    assert resumed.cache_stats() == straight.cache_stats()


def test_flushing_does_not_change_training():
    """A state dict taken every step leaves training bitwise unchanged.

    Catches: a flush that marks rows clean or replaces FP32 rows by their rounded copy.
    """
    tables = with_precision("int4")
    spec = CacheSpec(policy="lru", fraction=0.25)
    flushed = CachedEmbeddingBagCollection(tables, ADAGRAD, spec, seed=6)
    quiet = CachedEmbeddingBagCollection(tables, ADAGRAD, spec, seed=6)
    for s in range(6):
        train(flushed, 1, start=s)
        flushed.state_dict()
        flushed.fused_optimizer.state_dict()
    train(quiet, 6)
    for key, value in quiet.state_dict().items():
        assert torch.equal(flushed.state_dict()[key], value), key


def test_loading_an_uncached_checkpoint_starts_with_an_empty_cache():
    """A FusedEmbeddingBagCollection checkpoint loads; the cache starts empty.

    Catches: a cached collection that cannot read the uncached layout.
    """
    tables = with_precision("fp16")
    plain = FusedEmbeddingBagCollection(tables, SGD, seed=3)
    train(plain, 2)
    module = CachedEmbeddingBagCollection(tables, SGD, CacheSpec(fraction=0.5), seed=0)
    train(module, 1)
    module.load_state_dict(plain.state_dict())
    assert all(s.occupied == 0 for s in module.cache_stats().values())
    for name, w in plain.table_weights().items():
        assert torch.equal(module.table_weights()[name], w)


def test_backward_after_a_later_forward_that_moved_its_rows_raises():
    """Two training forwards, then the first backward: an error, not a wrong update.

    Catches: silently updating the slot of a row that was evicted in between.
    """
    module = CachedEmbeddingBagCollection(
        [TableConfig(name="t", num_embeddings=8, dim=2)], SGD, CacheSpec(fraction=0.125), seed=0
    )
    first = module(SparseFeatures.from_lists({"t": [[1]]})).values
    module(SparseFeatures.from_lists({"t": [[2]]}))  # evicts row 1 (one slot)
    with pytest.raises(RuntimeError, match="before the next training forward"):
        first.sum().backward()


def test_out_of_range_id_names_feature_and_table():
    """Catches: an out-of-range id indexing the slot map (an IndexError or a wrong row)."""
    module = CachedEmbeddingBagCollection(TABLES, SGD, CacheSpec(fraction=0.5), seed=0)
    bags = random_bags(0)
    bags["f1"][0] = [24]
    with pytest.raises(ValueError, match="feature 'f1': id 24 is outside its table 'a'"):
        module(SparseFeatures.from_lists(bags))


def test_static_policy_pins_the_sample_top_rows_and_trains_like_the_oracle(reference_kernels):
    """Static: the top rows of a sample are cached from the start and never change.

    Catches: static admitting misses, or pinning other rows than the sample's top-k.
    """
    tables = with_precision("int8")
    sample = [SparseFeatures.from_lists(random_bags(s, tables)) for s in range(20, 30)]
    counts = count_ids(sample, tables)
    module = CachedEmbeddingBagCollection(
        tables,
        SGD,
        CacheSpec(policy="static", fraction=0.25),
        static_counts=counts,
        seed=3,
    )
    capacity = {t.name: t.num_embeddings // 4 for t in tables}
    oracle = CacheOracle(tables, SGD, "static", capacity, seed=3, static_counts=counts)
    pinned = {i: c.slot_rows.clone() for i, c in module._caches.items()}
    for i, t in enumerate(tables):
        order = sorted(range(t.num_embeddings), key=lambda r, c=counts[t.name]: (-c[r], r))
        assert sorted(pinned[i].tolist()) == sorted(order[: capacity[t.name]])
    for s in range(4):
        bags = random_bags(s, tables)
        out = module(SparseFeatures.from_lists(bags)).values
        out.backward(upstream(s, out.shape))
        torch.testing.assert_close(out.detach(), oracle.step(bags, upstream(s, out.shape)))
    for i, c in module._caches.items():
        assert torch.equal(c.slot_rows, pinned[i])
    assert all(s.evictions == 0 for s in module.cache_stats().values())
    for name, w in module.table_weights().items():
        t = next(t for t in tables if t.name == name)
        for r in range(t.num_embeddings):
            assert torch.equal(w[r], oracle._row(t, r)), (name, r)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_per_id_weights_split_with_their_ids(fraction):
    """Weighted bags: outputs, weight gradients and rows equal the uncached collection's.

    Catches: per-id weights not split alongside the ids (a weight applied to another
    id), or weight gradients not scattered back to their positions.
    """
    tables = with_precision("int8", [dataclasses.replace(t, pooling="sum") for t in TABLES])
    cached = CachedEmbeddingBagCollection(tables, SGD, CacheSpec(fraction=fraction), seed=9)
    other = tables if fraction == 0.0 else with_precision("fp32", tables)
    plain = FusedEmbeddingBagCollection(other, SGD, seed=9)
    if fraction:
        weights = {f"weights.{k}": v for k, v in cached.table_weights().items()}
        plain.load_state_dict(weights, strict=False)
    gen = torch.Generator().manual_seed(0)
    for s in range(3):
        bags = random_bags(s, tables)
        w = {f: [torch.rand(len(b), generator=gen).tolist() for b in v] for f, v in bags.items()}
        grads = []
        for module in (cached, plain):
            sf = SparseFeatures.from_lists(bags, weights=w)
            psw = sf.weights.clone().requires_grad_(True)
            sf = dataclasses.replace(sf, weights=psw)
            out = module(sf).values
            out.backward(upstream(s, out.shape))
            grads.append((out.detach(), psw.grad))
        assert torch.equal(grads[0][0], grads[1][0])
        assert torch.equal(grads[0][1], grads[1][1])
    for name, w in plain.table_weights().items():
        assert torch.equal(cached.table_weights()[name], w), name


def test_per_id_weights_with_some_rows_cached_follow_their_ids():
    """Mixed bags (some ids cached, some not): each weight scales its own id's row, and
    its gradient is the output gradient dotted with that row.

    Catches: weights or weight gradients of one part placed at another part's positions.
    """
    tables = with_precision("int8", [dataclasses.replace(t, pooling="sum") for t in TABLES])
    module = CachedEmbeddingBagCollection(tables, SGD, CacheSpec(fraction=0.3), seed=9)
    gen = torch.Generator().manual_seed(0)
    for s in range(3):
        bags = random_bags(s, tables)
        w = {f: [torch.rand(len(b), generator=gen).tolist() for b in v] for f, v in bags.items()}
        sf = SparseFeatures.from_lists(bags, weights=w)
        psw = sf.weights.clone().requires_grad_(True)
        out = module(dataclasses.replace(sf, weights=psw)).values
        rows = module.table_weights()  # the rows this forward read (admissions done)
        grad = upstream(s, out.shape)
        out.backward(grad)
        want_out, want_grad, col, pos = torch.zeros_like(out), [], 0, 0
        for t in tables:
            for f in t.feature_names:
                for b, bag in enumerate(bags[f]):
                    for r in bag:
                        row = rows[t.name][r]
                        want_out[b, col : col + t.dim] += psw[pos].detach() * row
                        want_grad.append((grad[b, col : col + t.dim] * row).sum())
                        pos += 1
                col += t.dim
        torch.testing.assert_close(out.detach(), want_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(psw.grad, torch.stack(want_grad), rtol=1e-5, atol=1e-6)
    stats = module.cache_stats()
    assert all(0 < s.hits < s.lookups for s in stats.values())  # really mixed


def test_loading_a_cache_of_another_size_or_policy_names_the_mismatch():
    """Catches: a checkpoint of another cache size copied into the wrong slots."""
    small = CachedEmbeddingBagCollection(TABLES, SGD, CacheSpec(fraction=0.25), seed=0)
    train(small, 1)
    saved = small.state_dict()
    big = CachedEmbeddingBagCollection(TABLES, SGD, CacheSpec(fraction=0.5), seed=0)
    with pytest.raises(ValueError, match=r"cache.slot_rows is \(6,\).*needs \(12,\)"):
        big.load_state_dict(saved)
    lfu = CachedEmbeddingBagCollection(TABLES, SGD, CacheSpec(policy="lfu", fraction=0.25))
    with pytest.raises(ValueError, match=r"cache.freq is \(0,\).*policy 'lfu'"):
        lfu.load_state_dict(saved)


def test_deterministic_across_runs_and_thread_counts():
    """Same inputs: bitwise the same outputs, rows, state and counters, 1 or 2 threads.

    Catches: an order that depends on hashing or threads (unique, sorts, index_add).
    """
    tables = with_precision("int4")
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            module = CachedEmbeddingBagCollection(
                tables, ADAM, CacheSpec(policy="lfu", fraction=0.25), seed=7
            )
            outs = train(module, 4)
            results.append((outs, module.state_dict(), module.cache_stats()))
    finally:
        torch.set_num_threads(threads)
    (a_out, a_sd, a_st), (b_out, b_sd, b_st) = results
    assert all(torch.equal(x, y) for x, y in zip(a_out, b_out))
    assert all(torch.equal(v, b_sd[k]) for k, v in a_sd.items())
    assert a_st == b_st


def test_memory_counts_each_tier():
    """Bytes by tier: INT8 backing rows, FP32 slots, FP32 state of rows and slots.

    Catches: optimizer state of the cache left out of the count, or the cache counted
    at the backing precision.
    """
    tables = with_precision("int8")
    module = CachedEmbeddingBagCollection(tables, ADAGRAD, CacheSpec(fraction=0.25), seed=0)
    mem = module.memory()
    rows = {t.name: t.num_embeddings for t in tables}
    slots = {t.name: t.num_embeddings // 4 for t in tables}
    assert mem.backing_ram == sum(rows[t.name] * Precision.INT8.row_bytes(t.dim) for t in tables)
    assert mem.cache_rows == sum(slots[t.name] * t.dim * 4 for t in tables)
    assert mem.backing_state_ram == 4 * sum(rows.values())  # row-wise Adagrad: 1 per row
    assert mem.cache_state == 4 * sum(slots.values())
    assert mem.weight_bytes == mem.backing_ram + mem.cache_rows
    assert mem.backing_ssd == mem.backing_state_ssd == 0
