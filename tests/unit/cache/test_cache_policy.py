"""Cache policies: hand-made id streams with known contents, and the size rules."""

import pytest
import torch

from tetrarec.cache import (
    CachedEmbeddingBagCollection,
    CachePolicy,
    CacheSpec,
    hot_rows,
    plan_admission,
    slot_bytes,
)
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sparse import SparseFeatures
from tetrarec.types import OptimizerKind

SGD = SparseOptimizerSpec(kind="sgd", lr=0.1)
TABLE = TableConfig(name="t", num_embeddings=10, dim=2, precision="int8")


def run_stream(policy, stream, slots=2):
    """Train on one-bag batches ``stream``; return the cached rows after each batch."""
    module = CachedEmbeddingBagCollection(
        [TABLE], SGD, CacheSpec(policy=policy, fraction=slots / 10), seed=0
    )
    contents = []
    for ids in stream:
        module(SparseFeatures.from_lists({"t": [ids]})).values.sum().backward()
        rows = module._caches[0].slot_rows
        contents.append(sorted(int(r) for r in rows.tolist() if r >= 0))
    return module, contents


def test_lru_evicts_the_least_recently_used():
    """Batches {1},{2},{1},{3}: row 2 (used at batch 2) leaves, not row 1 (batch 3).

    Catches: evicting the most recent or the oldest-admitted row instead (FIFO).
    """
    _, contents = run_stream("lru", [[1], [2], [1], [3]])
    assert contents == [[1], [1, 2], [1, 2], [1, 3]]


def test_lfu_evicts_the_least_frequent_and_admits_only_hotter_rows():
    """{1},{1},{2},{3},{3},{3}: row 3 enters only once it is looked up more than row 2.

    Catches: LFU admitting every miss (LRU-like), evicting the most frequent row, or
    forgetting a row's count when it is not cached.
    """
    module, contents = run_stream("lfu", [[1], [1], [2], [3], [3], [3]])
    assert contents == [[1], [1], [1, 2], [1, 2], [1, 3], [1, 3]]
    stats = module.cache_stats()["t"]
    assert (stats.hits, stats.misses, stats.evictions) == (2, 4, 1)


def test_lru_admits_the_hottest_misses_when_they_do_not_all_fit():
    """One batch of 4 misses for 2 slots: the two most repeated ids are admitted.

    Catches: admitting misses in id order regardless of their count in the batch.
    """
    _, contents = run_stream("lru", [[4, 7, 7, 2, 9, 9, 9]])
    assert contents == [[7, 9]]


def test_victims_are_never_rows_of_the_current_batch():
    """A batch whose hits fill the cache admits nothing.

    Catches: evicting a row the batch reads (its backward would update a stale slot).
    """
    _, contents = run_stream("lru", [[1, 2], [1, 2, 3]])
    assert contents == [[1, 2], [1, 2]]


def test_plan_admission_orders_victims_by_last_use_then_row():
    """Pure rule: free slots first, then the idle slot used longest ago.

    Catches: free slots skipped, or busy slots taken as victims.
    """
    plan = plan_admission(
        CachePolicy.LRU,
        miss_rows=torch.tensor([3, 4, 8]),
        miss_counts=torch.tensor([1, 1, 1]),
        slot_rows=torch.tensor([5, -1, 7, 9]),
        busy=torch.tensor([False, False, False, True]),
        last_used=torch.tensor([2, 0, 1, 0]),
        miss_freq=torch.empty(0, dtype=torch.int64),
        slot_freq=torch.empty(0, dtype=torch.int32),
    )
    assert plan.slots.tolist() == [1, 2, 0]
    assert plan.rows.tolist() == [3, 4, 8]
    assert plan.victims.tolist() == [2, 0]


def test_hot_rows_breaks_ties_by_row():
    """Catches: an unstable top-k, which would make the static cache run-dependent."""
    counts = torch.tensor([3, 5, 5, 0, 3, 1])
    assert hot_rows(counts, 3).tolist() == [0, 1, 2]


def test_byte_budget_fits_and_is_shared_by_fraction():
    """``bytes`` gives every table the same fraction and never more bytes in all.

    Catches: a budget overshoot by rounding, or one table taking the whole budget.
    """
    tables = [
        TableConfig(name="a", num_embeddings=1000, dim=8),
        TableConfig(name="b", num_embeddings=300, dim=16),
    ]
    kind = OptimizerKind.ROWWISE_ADAGRAD
    budget = 5000
    cap = CacheSpec(bytes=budget).capacities(tables, kind)
    used = sum(cap[t.name] * slot_bytes(t.dim, kind) for t in tables)
    assert used <= budget
    assert cap["a"] == 1000 * budget // (1000 * 36 + 300 * 68)
    assert cap["b"] > 0
    assert CacheSpec(fraction=0.1).capacities(tables, kind) == {"a": 100, "b": 30}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of fraction"),
        ({"fraction": 0.1, "bytes": 10}, "exactly one of fraction"),
        ({"fraction": 1.5}, r"cache.fraction must be in \[0, 1\]"),
        ({"bytes": -1}, "cache.bytes must be >= 0"),
        ({"fraction": 0.1, "policy": "mru"}, "unknown cache policy 'mru'; valid: lru, lfu, static"),
    ],
)
def test_cache_spec_errors_name_the_field(kwargs, message):
    """Catches: silently accepted sizes, or messages that do not say what is valid."""
    with pytest.raises(ValueError, match=message):
        CacheSpec(**kwargs)


def test_placement_and_static_errors():
    """Catches: a device placement accepted on CPU, typos in table names, static without
    counts."""
    spec = CacheSpec(fraction=0.5)
    with pytest.raises(ValueError, match="placement 'device' keeps its rows in device memory"):
        CachedEmbeddingBagCollection([TABLE], SGD, spec, placements={"t": "device"})
    with pytest.raises(ValueError, match="unknown placement 'disk'; valid: device, host"):
        CachedEmbeddingBagCollection([TABLE], SGD, spec, placements={"t": "disk"})
    with pytest.raises(ValueError, match=r"placements name unknown tables \['u'\]"):
        CachedEmbeddingBagCollection([TABLE], SGD, spec, placements={"u": "host"})
    with pytest.raises(ValueError, match="needs static_counts for table 't'"):
        CachedEmbeddingBagCollection([TABLE], SGD, CacheSpec(policy="static", fraction=0.5))
