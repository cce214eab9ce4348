"""What a cached collection's bytes are: ``memory()`` against a hand count, and the packed
slot map (one int32 per row for the slot and LFU's count) keeping the policy's counts."""

from collections import Counter

import pytest
import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec
from tetrarec.cache.slot_map import COUNT_MAX
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sparse import SparseFeatures

ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.1)
# INT8 rows: D codes + FP16 scale + FP16 bias, padded to 4 bytes: D=16 -> 20 B,
# D=6 -> 10 B + 2 B of padding = 12 B
TABLES = [
    TableConfig(name="a", num_embeddings=1000, dim=16, precision="int8"),
    TableConfig(name="b", num_embeddings=300, dim=6, precision="int8"),
]


def _collection(policy, tables=TABLES, fraction=0.05):
    return CachedEmbeddingBagCollection(
        tables, ADAGRAD, CacheSpec(policy=policy, fraction=fraction), seed=0
    )


@pytest.mark.parametrize(("policy", "per_slot"), [("lfu", 9), ("lru", 13)])
def test_memory_is_the_hand_count_of_its_parts(policy, per_slot):
    """Two INT8 tables (1000 x 16, 300 x 6), 5% caches (50 and 15 slots), row-wise Adagrad.

    Per row: the stored row (20 B; 12 B with its padding) and 4 B of slot map (LFU's
    count shares it); per slot: the FP32 row, its 4 B of state, the row id (int32), the
    dirty flag and the policy's key (LFU count int32, LRU clock int64).

    Catches: the slot map or LFU's count widened back to int64 or kept apart per row
    (2.9x the metadata of the bench's INT8 + 5% run), an LRU clock kept under LFU, a
    per-slot map sized by rows, cache rows counted twice or in the stored precision,
    the scale, bias or padding of the INT8 rows left out.
    """
    m = _collection(policy).memory()
    assert m.backing_ram == 1000 * 20 + 300 * 12
    assert m.cache_rows == 50 * 16 * 4 + 15 * 6 * 4
    assert m.weight_bytes == 23_600 + 3_560
    assert m.backing_state_ram == 1300 * 4
    assert m.cache_state == 65 * 4
    assert m.metadata == 1300 * 4 + 65 * per_slot
    assert m.backing_ssd == m.backing_device == 0


def _train(module, stream):
    for bags in stream:
        module(SparseFeatures.from_lists({"a": bags})).values.sum().backward()


def test_lfu_counts_survive_admission_and_eviction():
    """Random Zipf-like batches through a 2% LFU cache: every row's count, read back the
    way a checkpoint saves it, equals a plain count of the ids; the slot each row maps to
    holds that row.

    Catches: a count lost when it moves from the row's entry to its slot at admission or
    back at eviction, a cached row's count left under its slot marker, a row mapped to a
    slot that holds another row.
    """
    table = TableConfig(name="a", num_embeddings=400, dim=4, precision="int8")
    module = _collection("lfu", [table], fraction=0.02)
    gen = torch.Generator().manual_seed(0)
    want = Counter()
    stream = []
    for _ in range(30):
        ids = (torch.rand(40, generator=gen) ** 3 * 400).long().tolist()
        want.update(ids)
        stream.append([ids[i : i + 4] for i in range(0, 40, 4)])
    _train(module, stream)
    c = module._caches[0]
    assert module.cache_stats()["a"].evictions > 0  # counts moved both ways
    saved = c.saved()
    assert saved["freq"].dtype == torch.int64  # the checkpoint layout of before
    assert saved["freq"].tolist() == [want[r] for r in range(400)]
    occupied = c.occupied()
    assert torch.equal(c.slots_of(c.rows_in(occupied)), occupied)
    uncached = torch.ones(400, dtype=torch.bool)
    uncached[c.rows_in(occupied)] = False
    assert bool((c.slots_of(torch.arange(400))[uncached] == -1).all())


def test_lfu_count_saturates_instead_of_wrapping_into_a_slot():
    """A row at the largest count looked up again keeps that count and stays uncached.

    Catches: an int32 count wrapping negative, which the packed map reads as "cached in
    slot ~count" (a wrong slot for every lookup of the row from then on).
    """
    table = TableConfig(name="a", num_embeddings=100, dim=4, precision="int8")
    module = _collection("lfu", [table], fraction=0.01)  # one slot
    _train(module, [[[1]]])  # row 1 takes the slot
    c = module._caches[0]
    c.row_map[7] = COUNT_MAX - 1
    c.slot_freq[0] = COUNT_MAX  # row 1 as hot: row 7 cannot replace it
    _train(module, [[[7, 7, 7]]])
    assert int(c.row_map[7]) == COUNT_MAX
    assert c.slots_of(torch.tensor([7])).tolist() == [-1]
    assert c.saved()["freq"][7] == COUNT_MAX
