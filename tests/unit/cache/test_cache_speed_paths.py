"""The cache's fast paths against the plain ones they replace, bit for bit.

``ops.store_rows`` / ``ops.load_rows`` (write-back and admission: compiled against the
portable ``reference`` functions, which are the old gather + encode + scatter) and the
policy's one-pass victim order (against a plain Python sort by ``(key, row)``).
"""

import pytest
import torch

from tetrarec.cache import CachePolicy, plan_admission
from tetrarec.cache.policy import _first_by_key_then_row
from tetrarec.kernels import reference
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.kernels.quant import row_width
from tetrarec.types import Precision

PRECISIONS = ["fp32", "fp16", "bf16", "int8", "int4"]
DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.uint8,
    "int4": torch.uint8,
}


def _compiled():
    ext = compiled_cpu_kernels()
    if ext is None or not hasattr(ext, "store_rows"):
        pytest.skip("the compiled CPU kernel did not build on this machine")
    return ext


def _awkward_rows(n, dim, seed):
    """FP32 rows with the cases a vector codec gets wrong: constant rows (scale 0), a
    minimum or maximum that is a zero of either sign, FP16 subnormals, wide ranges."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * torch.logspace(-6, 3, n).unsqueeze(1)
    x[0] = 0.75  # constant row
    x[1] = torch.rand(dim, generator=gen)
    x[1, dim // 2] = -0.0  # min is a zero, -0 after +0 below
    x[1, 0] = 0.0
    x[2] = -torch.rand(dim, generator=gen)
    x[2, -1] = 0.0  # max is a zero
    x[2, 0] = -0.0
    x[3] = torch.randn(dim, generator=gen) * 1e-6  # FP16 subnormal range
    return x


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dim", [64, 13, 3])
@pytest.mark.parametrize("stochastic", [1, 0])
def test_compiled_store_rows_equals_the_portable_encode(precision, dim, stochastic):
    """Random slots into random rows, every precision, dims with and without an 8-lane tail.

    Catches: a lane hash or column that draws other bits than ``rounding_noise``, a row key
    taken from the slot instead of the destination row, a fused multiply-add, a min or max
    whose zero has the other sign, a clamp that differs at 0 or the top level, a tail row
    element encoded by another rule.
    """
    ext = _compiled()
    p = Precision(precision)
    n_src, n_dst, n = 40, 100, 30
    src = _awkward_rows(n_src, dim, seed=dim)
    gen = torch.Generator().manual_seed(5)
    src_index = torch.randperm(n_src, generator=gen)[:n]
    dst_index = torch.randperm(n_dst, generator=gen)[:n]
    width = row_width(p, dim)
    start = torch.randint(0, 255, (n_dst, width), generator=gen, dtype=torch.uint8)
    if precision not in ("int8", "int4"):
        start = torch.randn(n_dst, width, generator=gen).to(DTYPES[precision])
    flags = [stochastic, 2**62 + 12345, 77, 3 * 2**58 + 9, 128]
    want, got = start.clone(), start.clone()
    reference.store_rows(src, src_index, want, dst_index, precision, flags)
    ext.store_rows(src, src_index, got, dst_index, precision, flags)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dim", [64, 13])
def test_compiled_load_rows_equals_the_portable_decode(precision, dim):
    """Catches: a fused multiply-add in the decode, codes read from the wrong byte or
    nibble, a row read from the slot index instead of the row index."""
    ext = _compiled()
    p = Precision(precision)
    rows = torch.empty(50, row_width(p, dim), dtype=DTYPES[precision])
    reference.store_rows(
        _awkward_rows(50, dim, seed=1), torch.arange(50), rows, torch.arange(50), precision,
        [1, 3, 4, 0, 0],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    src_index, dst_index = torch.randperm(50, generator=gen)[:20], torch.randperm(20)
    want = torch.full((20, dim), float("nan"))
    got = want.clone()
    reference.load_rows(rows, src_index, want, dst_index, precision)
    ext.load_rows(rows, src_index, got, dst_index, precision)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_compiled_row_copies_check_indices_and_write_nothing_on_error():
    """Catches: an index outside a buffer read or written (memory corruption) instead of
    a RuntimeError, or a store half done before the error."""
    ext = _compiled()
    src, dst = torch.randn(4, 8), torch.zeros(6, row_width(Precision.INT8, 8), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"destination row 6 is outside 0\.\.5"):
        ext.store_rows(src, torch.tensor([0, 1]), dst, torch.tensor([0, 6]), "int8", [1] * 5)
    assert not dst.any()
    with pytest.raises(RuntimeError, match="source row -1"):
        ext.load_rows(dst, torch.tensor([-1]), src, torch.tensor([0]), "int8")
    with pytest.raises(RuntimeError, match=r"12 wide"):
        ext.store_rows(src, torch.tensor([0]), torch.zeros(6, 5, dtype=torch.uint8),
                       torch.tensor([0]), "int8", [1] * 5)  # fmt: skip


@pytest.mark.parametrize(("n", "k"), [(200, 3), (200, 150), (7, 7)])
@pytest.mark.parametrize("huge", [False, True])
def test_victim_order_is_key_then_row(n, k, huge):
    """Few victims (partial top-k), most of them (sort), and keys too large for the fused
    int64 key (the two stable sorts): all the order of a Python sort by (key, row).

    Catches: ties broken by position or slot instead of row, an unsorted top-k, an
    overflowing fused key.
    """
    gen = torch.Generator().manual_seed(n + k)
    key = torch.randint(0, 5, (n,), generator=gen)  # many ties
    if huge:
        key = key + 2**61
    rows = torch.randperm(10 * n, generator=gen)[:n]
    got = _first_by_key_then_row(key, rows, k).tolist()
    want = sorted(range(n), key=lambda j: (int(key[j]), int(rows[j])))[:k]
    assert got == want


@pytest.mark.parametrize("policy", [CachePolicy.LRU, CachePolicy.LFU])
def test_plan_admission_matches_the_plain_rule_on_random_caches(policy):
    """Random full and part-full caches: rows, slots and victims as the module docstring's
    rule computes them with Python sorts.

    Catches: free slots not taken first in ascending order, busy slots evicted, the LFU
    prefix condition applied to the wrong pairs, victims in another order.
    """
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        rows, cap = 60, 12
        perm = torch.randperm(rows, generator=gen)
        slot_rows = perm[:cap].clone()
        slot_rows[torch.rand(cap, generator=gen) < 0.2] = -1
        busy = (torch.rand(cap, generator=gen) < 0.3) & (slot_rows >= 0)
        last_used = torch.randint(0, 4, (cap,), generator=gen)
        freq = torch.randint(0, 6, (rows,), generator=gen)
        miss_rows = torch.sort(perm[cap : cap + int(torch.randint(1, 20, (), generator=gen))])[0]
        miss_counts = torch.randint(1, 4, (miss_rows.numel(),), generator=gen)
        plan = plan_admission(
            policy, miss_rows=miss_rows, miss_counts=miss_counts, slot_rows=slot_rows,
            busy=busy, last_used=last_used, miss_freq=freq[miss_rows],
            slot_freq=freq[slot_rows.clamp_min(0)].int(),
        )  # fmt: skip
        want = _plain_plan(policy, miss_rows, miss_counts, slot_rows, busy, last_used, freq)
        assert plan.rows.tolist() == want[0], seed
        assert plan.slots.tolist() == want[1], seed
        assert plan.victims.tolist() == want[2], seed


def _plain_plan(policy, miss_rows, miss_counts, slot_rows, busy, last_used, freq):
    """(rows, slots, victims) by the policy module's rule, with Python sorts."""
    lru = policy is CachePolicy.LRU
    heat = dict(zip(miss_rows.tolist(), (miss_counts if lru else freq[miss_rows]).tolist()))
    misses = sorted(heat, key=lambda r: (-heat[r], r))
    cap = slot_rows.numel()
    free = [s for s in range(cap) if slot_rows[s] < 0]
    idle = [s for s in range(cap) if slot_rows[s] >= 0 and not busy[s]]
    if lru:
        idle.sort(key=lambda s: (int(last_used[s]), int(slot_rows[s])))
    else:
        idle.sort(key=lambda s: (int(freq[slot_rows[s]]), int(slot_rows[s])))
    first, rest = misses[: len(free)], misses[len(free) :]
    pairs = list(zip(rest, idle))
    if not lru:
        pairs = [(m, v) for m, v in pairs if freq[m] > freq[slot_rows[v]]]
    victims = [v for _, v in pairs]
    return first + [m for m, _ in pairs], free[: len(first)] + victims, victims


def test_both_id_dedup_paths_train_alike():
    """Checked ids are deduplicated with an int32 sort, unchecked ones with
    ``torch.unique``: the same rows, counts and so the same training, bit for bit.

    Catches: counts misaligned with their rows, or rows in another order, on either path.
    """
    from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.sparse import SparseFeatures

    tables = [TableConfig(name="t", num_embeddings=40, dim=4, precision="int8")]
    spec = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.1)
    modules = [
        CachedEmbeddingBagCollection(
            tables, spec, CacheSpec(policy=policy, fraction=0.2), check_bounds=check, seed=3
        )
        for policy in ("lru", "lfu")
        for check in (True, False)
    ]
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        bags = [(torch.rand(6, generator=gen) ** 3 * 40).long().tolist() for _ in range(8)]
        for m in modules:
            m(SparseFeatures.from_lists({"t": bags})).values.sum().backward()
    for checked, unchecked in (modules[0:2], modules[2:4]):
        a, b = checked.state_dict(), unchecked.state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert checked.cache_stats() == unchecked.cache_stats()
        assert checked.cache_stats()["t"].evictions > 0
