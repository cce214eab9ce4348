"""The fused and the cached collection through one protocol (``tetrarec.kernels.LocalLookup``).

The sharding code runs every local module through the same calls (prepare, pooled
lookup, row-gradient shares, row-state additions, apply gradients) and never asks which
module it holds. With FP32 tables and a cache that holds every row, the cached module
pools and trains every id in its FP32 slots with the same kernels, so the two must
agree bitwise at every step. The trainer's side (``tetrarec.embedding.HeldTables``):
every collection, sharded or not, reports its tables and cache counters.
"""

from dataclasses import replace

import pytest
import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CachePolicy, CacheSpec
from tetrarec.comm import Communicator
from tetrarec.embedding import EmbeddingBagCollection, HeldTables, SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection, LocalLookup, PreparedIds
from tetrarec.sharding import (
    LookupOptions,
    ShardedEmbeddingBagCollection,
    ShardingEnv,
    TablePlacement,
    plan_by_type,
)
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Placement, Precision, ShardingType

TABLES = [
    TableConfig(name="a", num_embeddings=24, dim=4, feature_names=("f0", "f1")),
    TableConfig(name="b", num_embeddings=16, dim=3, pooling="mean"),
]
SUM_TABLES = [replace(t, pooling="sum") for t in TABLES]
SPEC = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2, weight_decay=0.05)
B = 6


def bags(seed, tables):
    """{feature: [[ids]]}, with repeated ids (duplicates are summed in position order)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in tables:
        for f in t.feature_names:
            lens = torch.randint(0, 5, (B,), generator=gen).tolist()
            out[f] = [
                torch.randint(0, t.num_embeddings, (n,), generator=gen).tolist() for n in lens
            ]
    return out


def weights_of(b, seed):
    gen = torch.Generator().manual_seed(seed)
    return {f: [torch.rand(len(bag), generator=gen).tolist() for bag in v] for f, v in b.items()}


def both(tables, staged=False):
    """A fused collection and a cached one whose static cache pins every row."""
    fused = FusedEmbeddingBagCollection(tables, SPEC, seed=3)
    cached = CachedEmbeddingBagCollection(
        tables,
        SPEC,
        CacheSpec(policy=CachePolicy.STATIC, fraction=1.0),
        static_counts={t.name: torch.ones(t.num_embeddings) for t in tables},
        seed=3,
        force_staged_copies=staged,
    )
    return fused, cached


def protocol_step(local: LocalLookup, sf: SparseFeatures, grad: torch.Tensor, delta_seed: int):
    """One training step the way the sharding code runs it, through the protocol only."""
    prepared = local.prepare(sf, admit=True)  # forward: a cache's policy step first
    assert isinstance(prepared, PreparedIds)
    pooled = local.pooled_lookup(prepared)
    shares = [local.row_gradient_shares(i, grad, prepared, SPEC.weight_decay) for i in (0, 1)]
    for i, (rows, _) in enumerate(shares):  # what column blocks add before the update
        gen = torch.Generator().manual_seed(delta_seed + i)
        local.add_to_row_state_(i, "sum", rows, torch.rand(rows.numel(), generator=gen))
    psw_grad = local.apply_gradients(grad, prepared, want_psw=sf.weights is not None)
    return pooled, shares, psw_grad


def assert_same_state(fused, cached, step):
    for name, w in fused.table_weights().items():
        assert torch.equal(cached.table_weights()[name], w), (step, name)
    for name, state in fused.optimizer_state().items():
        for key, value in state.items():
            assert torch.equal(cached.optimizer_state()[name][key], value), (step, name, key)


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_fused_and_fully_cached_collections_agree_through_the_protocol(staged, weighted):
    """Both collections answer ``LocalLookup``; with every row cached, the same prepared
    batch gives the same pooled rows, row-gradient shares, per-id weight gradients,
    and rows and optimizer state after the row-state additions and the update.

    Bugs caught: one collection's protocol step reading another batch than it was
    prepared with (the cached update taking its per-id weights from elsewhere than its
    lookup, the fused ``prepare`` dropping them), a cached prepared batch whose slots
    differ from the rows it pools (ids pooled from the backing store while the update
    trains the slots), a shares report naming slots as rows, the fused
    ``add_to_row_state_`` writing another table's or another row's state, and the mean
    division applied twice or not at all on one side: any of these gives a cached
    shard (data-parallel replica, column block) other rows than a fused one, now that
    the sharding code runs both through the same calls.
    """
    tables = SUM_TABLES if weighted else TABLES
    fused, cached = both(tables, staged)
    assert isinstance(fused, LocalLookup)
    assert isinstance(cached, LocalLookup)
    every_row = {t.name: torch.arange(t.num_embeddings) for t in tables}
    assert cached.cached_rows().keys() == every_row.keys()
    for name, rows in every_row.items():
        assert torch.equal(cached.cached_rows()[name], rows), name
    assert fused.cache_stats() == {}
    assert fused.cached_rows() == {}
    for step in range(3):
        b = bags(step, tables)
        w = weights_of(b, 100 + step) if weighted else None
        sf = SparseFeatures.from_lists(b, weights=w)
        grad = torch.randn(
            B, sum(fused.feature_dims), generator=torch.Generator().manual_seed(step)
        )
        want, want_shares, want_psw = protocol_step(fused, sf, grad, 10 * step)
        got, shares, psw = protocol_step(cached, sf, grad, 10 * step)
        assert torch.equal(got, want), step
        for (rows, share), (want_rows, want_share) in zip(shares, want_shares):
            assert torch.equal(rows, want_rows), step
            assert torch.equal(share, want_share), step
        if weighted:
            assert torch.equal(psw, want_psw), step
        else:
            assert psw is None
            assert want_psw is None
        assert_same_state(fused, cached, step)
    assert all(s.hits > 0 and s.misses == 0 for s in cached.cache_stats().values())


def test_prepare_refuses_what_a_lookup_cannot_take_in_both_collections():
    """``prepare`` checks the key order and per-id weights with mean pooling alike in
    both. Bug caught: the fused collection pooling a batch keyed in another order
    through its own feature order (rows of one table looked up in another)."""
    for module in both(TABLES):
        wrong_order = SparseFeatures.from_lists({"b": [[1]], "f0": [[2]], "f1": [[3]]})
        with pytest.raises(ValueError, match="must be keyed"):
            module.prepare(wrong_order, admit=False)
        weighted = SparseFeatures.from_lists(
            {"f0": [[1]], "f1": [[2]], "b": [[3]]},
            weights={"f0": [[1.0]], "f1": [[1.0]], "b": [[1.0]]},
        )
        with pytest.raises(ValueError, match="sum pooling only"):
            module.prepare(weighted, admit=False)


def one_rank_sharded(kind):
    base = plan_by_type(TABLES, kind, world_size=1)
    where = TablePlacement(
        placement=Placement.CACHED, cache_fraction=0.25, precision=Precision.FP32
    )
    plan = replace(base, tables=(replace(base.tables[0], placement=where), *base.tables[1:]))
    options = LookupOptions(optimizer=SPEC, seed=5, cache=CacheSpec(fraction=0.25))
    return ShardedEmbeddingBagCollection(TABLES, plan, ShardingEnv(Communicator.single()), options)


def test_every_collection_reports_its_tables_and_cache_counters():
    """``HeldTables``: the reference, fused, cached and sharded collections all answer
    ``shard_layout``, ``cache_stats``, ``counted_cache_stats`` and ``cached_rows``; an
    unsharded one holds its whole tables. Bug caught: the trainer (pinned-row report,
    cache counters in the log, checkpoint layout) having to ask which collection it
    holds, or a collection without a cache failing where it should report nothing."""
    whole = [
        {"name": "a", "table": "a", "rows": [0, 24], "cols": [0, 4]},
        {"name": "b", "table": "b", "rows": [0, 16], "cols": [0, 3]},
    ]
    fused, cached = both(TABLES)
    sharded = one_rank_sharded(ShardingType.TABLE_WISE)
    for module in (EmbeddingBagCollection(TABLES, seed=3), fused, cached, sharded):
        assert isinstance(module, HeldTables), type(module).__name__
        assert module.shard_layout() == whole, type(module).__name__
    for module in (EmbeddingBagCollection(TABLES, seed=3), fused):
        assert module.cache_stats() == module.counted_cache_stats() == module.cached_rows() == {}
    assert cached.counted_cache_stats() == cached.cache_stats()
    assert set(cached.cache_stats()) == {"a", "b"}
    assert set(sharded.cache_stats()) == set(sharded.cached_rows()) == {"a"}
    out = sharded(SparseFeatures.from_lists(bags(0, TABLES))).values
    out.backward(torch.ones_like(out))
    assert sharded.counted_cache_stats() == sharded.cache_stats()
    assert sharded.cache_stats()["a"].lookups > 0
