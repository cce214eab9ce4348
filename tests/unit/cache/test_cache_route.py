"""The cached collection's public split (``prepare``, ``pooled_lookup``, ``apply_gradients``).

Data-parallel replicas use it to run the policy step on the global batch and pool only
their own samples; these tests check the split in one process, and through a one-rank
data-parallel sharded collection.
"""

from dataclasses import replace

import pytest
import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec
from tetrarec.comm import Communicator
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
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
    TableConfig(name="a", num_embeddings=24, dim=4, feature_names=("f0", "f1"), precision="int8"),
    TableConfig(name="b", num_embeddings=16, dim=3, precision="int8"),
]
ROWWISE = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2)


def bags(seed: int, batch: int = 6) -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in TABLES:
        for f in t.feature_names:
            lens = torch.randint(0, 4, (batch,), generator=gen).tolist()
            out[f] = [
                torch.randint(0, t.num_embeddings, (n,), generator=gen).tolist() for n in lens
            ]
    return out


def halves(b: dict[str, list[list[int]]], weights=None) -> list[SparseFeatures]:
    n = len(next(iter(b.values())))
    return [
        SparseFeatures.from_lists(
            {k: v[lo:hi] for k, v in b.items()},
            weights=None if weights is None else {k: v[lo:hi] for k, v in weights.items()},
        )
        for lo, hi in ((0, n // 2), (n // 2, n))
    ]


def cached(staged: bool = False) -> CachedEmbeddingBagCollection:
    return CachedEmbeddingBagCollection(
        TABLES, ROWWISE, CacheSpec(fraction=0.25), seed=5, force_staged_copies=staged
    )


# The device cache's code path (test_cache_staged.py), forced on the CPU, too.
STAGED = pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])


@STAGED
def test_policy_step_on_the_whole_batch_then_pooling_halves_equals_forward(staged):
    """What a data-parallel replica does, in one process: the policy step on the whole
    batch, each half pooled through the resulting slot map, the whole batch's update.
    Bugs caught: ``prepare(admit=False)`` changing the cache (counters, slots), a route
    of a sub-batch that maps ids to other slots than the whole batch's, or an update
    through the split path that differs from ``forward``/``backward`` (rows, state,
    counters, dirty flags: the evictions of later steps write them back)."""
    plain, split = cached(), cached(staged)
    for step in range(4):
        b = bags(step)
        whole = SparseFeatures.from_lists(b)
        grad = torch.randn(6, 11, generator=torch.Generator().manual_seed(step))
        want = plain(whole).values
        want.backward(grad)
        every = split.prepare(whole, admit=True)
        before = split.cache_stats()
        got = torch.cat([split.pooled_lookup(split.prepare(h, admit=False)) for h in halves(b)])
        assert split.cache_stats() == before  # reading routes count nothing
        assert torch.equal(got, want.detach()), step
        split.apply_gradients(grad, every)
    assert split.cache_stats() == plain.cache_stats()
    assert all(s.evictions > 0 for s in plain.cache_stats().values())
    for name, w in plain.table_weights().items():
        assert torch.equal(split.table_weights()[name], w), name
    for name, state in plain.optimizer_state().items():
        for key, value in state.items():
            assert torch.equal(split.optimizer_state()[name][key], value), (name, key)


def test_prepare_refuses_features_in_another_order():
    """``prepare`` indexes ids by the collection's feature order; a batch keyed otherwise
    would pool rows of one table through another's slot map. Bug caught: a caller
    (a sharding group) handing its own key order without an error."""
    module = cached()
    sf = SparseFeatures.from_lists({"b": [[1]], "f0": [[2]], "f1": [[3]]})
    with pytest.raises(ValueError, match=r"must be keyed \('f0', 'f1', 'b'\)"):
        module.prepare(sf, admit=True)


def one_rank_data_parallel() -> ShardedEmbeddingBagCollection:
    base = plan_by_type(TABLES, ShardingType.DATA_PARALLEL, world_size=1)
    where = TablePlacement(
        placement=Placement.CACHED, cache_fraction=0.25, precision=Precision.INT8
    )
    plan = replace(base, tables=tuple(replace(tp, placement=where) for tp in base.tables))
    options = LookupOptions(optimizer=ROWWISE, seed=5, cache=CacheSpec(fraction=0.25))
    return ShardedEmbeddingBagCollection(TABLES, plan, ShardingEnv(Communicator.single()), options)


def test_data_parallel_backward_after_a_later_forward_that_moved_its_rows_raises():
    """A cached data-parallel table keeps the global route's check: two training
    forwards, then the first one's backward, must raise rather than update the slots
    that now hold other rows. Bug caught: the replica's backward using a route built
    without admission (no rows to check) or rebuilt at backward time."""
    module = one_rank_data_parallel()
    first = module(SparseFeatures.from_lists(bags(0))).values
    module(SparseFeatures.from_lists(bags(1)))  # admits and evicts other rows
    with pytest.raises(RuntimeError, match="before the next training forward"):
        first.backward(torch.ones_like(first))


def test_data_parallel_evaluation_reads_the_cache_without_changing_it():
    """No grad, or ``eval()`` mode: the replicas only read (as one process does). Bug
    caught: an evaluation batch admitting rows or counting lookups (counters and slots
    drift from the one-process run that evaluates the same way)."""
    module = one_rank_data_parallel()
    out = module(SparseFeatures.from_lists(bags(0))).values
    out.backward(torch.ones_like(out))
    before = module.cache_stats()
    with torch.no_grad():
        module(SparseFeatures.from_lists(bags(1)))
    assert module.cache_stats() == before
    module.eval()
    module(SparseFeatures.from_lists(bags(2)))
    assert module.cache_stats() == before
    assert before["a"].misses > 0


def test_each_shard_takes_its_rows_counts_for_the_static_policy():
    """``LookupOptions.static_counts`` holds global tables' counts; a row block pins by
    its own rows' counts (local row ``i`` is global row ``start + i``). Bug caught: a
    block given its table's first rows' counts (it would pin rows by other rows'
    heat), or a whole table's counts cut."""
    from tetrarec.sharding.group import LocalShard, _shard_counts

    t = TABLES[1]
    counts = {"b": torch.arange(16), "a": torch.arange(24) * 2}
    blocks = [
        LocalShard(name="b@r0", table=t, rows=(0, 8), cols=(0, 3), feature_names=("b",)),
        LocalShard(name="b@r8", table=t, rows=(8, 16), cols=(0, 3), feature_names=("b",)),
        LocalShard(name="a", table=TABLES[0], rows=(0, 24), cols=(0, 4), feature_names=("f0",)),
    ]
    got = _shard_counts(blocks, counts)
    assert torch.equal(got["b@r8"], torch.arange(8, 16))
    assert torch.equal(got["b@r0"], torch.arange(8))
    assert torch.equal(got["a"], counts["a"])
    assert _shard_counts(blocks, None) is None


FP32_TABLES = [
    TableConfig(name="a", num_embeddings=24, dim=4, feature_names=("f0", "f1")),
    TableConfig(name="b", num_embeddings=16, dim=3, pooling="mean"),
]


@STAGED
def test_row_gradient_shares_and_row_state_follow_the_row_into_its_slot(staged):
    """What cached column blocks of a row-wise optimizer exchange: each touched row's
    squared-gradient sum, read from the part that holds the row, equals the uncached
    collection's (FP32 rows, weight decay: the row's value counts), and a delta to the
    row state lands where the row's state lives. Bugs caught: slot ids reported as rows,
    the mean bags' gradient not divided by their length, a row's share missing or
    counted twice, a delta written to the backing state of a cached row (lost at the
    next write-back) or to a slot of an uncached one."""
    from tetrarec.kernels import FusedEmbeddingBagCollection

    spec = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2, weight_decay=0.05)
    cached = CachedEmbeddingBagCollection(
        FP32_TABLES, spec, CacheSpec(fraction=0.25), seed=5, force_staged_copies=staged
    )
    plain = FusedEmbeddingBagCollection(FP32_TABLES, spec, seed=5)
    for step in range(2):  # fill the caches (and train some rows)
        for module in (cached, plain):
            out = module(SparseFeatures.from_lists(bags(step))).values
            out.backward(torch.ones_like(out))
    sf = SparseFeatures.from_lists(bags(2))
    grad = torch.randn(6, 11, generator=torch.Generator().manual_seed(2))
    prepared = cached.prepare(sf, admit=True)
    for i in range(2):
        rows, share = cached.row_gradient_shares(i, grad, prepared, 0.05)
        want_rows, want = plain.row_gradient_shares(i, grad, plain.prepare(sf, admit=False), 0.05)
        assert torch.equal(rows, want_rows), i
        assert torch.equal(share, want), i
    c = cached._caches[0]
    held = c.slot_rows[c.slot_rows >= 0]
    rows = torch.cat([held[:2], torch.tensor([r for r in range(24) if r not in held][:2])])
    before = cached.optimizer_state()["a"]["sum"].clone()
    cached.add_to_row_state_(0, "sum", rows, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    after = cached.optimizer_state()["a"]["sum"]  # copies the cached rows' state back
    expect = before.clone()
    expect[rows] += torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(after, expect)
    with pytest.raises(ValueError, match="'momentum' is not a per-row optimizer state"):
        cached.add_to_row_state_(0, "momentum", rows, torch.ones(4))
