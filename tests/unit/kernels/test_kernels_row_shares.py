"""``tetrarec::tbe_row_gradient_shares``: one table's touched rows and per-row sums of g'^2.

The op (``FusedEmbeddingBagCollection.row_gradient_shares_of_ids``) serves column-split tables
under row-wise optimizers (``sharding/block_group.py``): each column block reports, per
touched row, ``sum_d g'_d^2`` over its columns, ``g' = g + weight_decay * w``, and the
blocks exchange these shares. The tests check it

* against a naive oracle (a Python loop over ids in position order, then the squares
  added in column order) bitwise, on both kernel paths, for FP32/FP16/INT8 stores,
  sum and mean pooling, per-id weights, weight decay on and off, a table looked up by
  two features (duplicates within and across them), and every table of a store of
  three (the op must report the asked table's rows only; one table gets no ids);
* against the update itself: with row-wise Adagrad starting from a zero accumulator,
  the state after ``update_ids`` is exactly ``share / D`` (compiled kernel);
* across thread counts (1 and 2), bitwise, at sizes above every parallel split of the
  kernel, and against the portable reference there;
* for its errors (a table outside the store, an id outside its table).

``reference.row_gradient_shares`` adds the squares in column order like the kernel;
``(g' * g').sum(1)`` adds them in another order, within ``2 * D * 2^-24`` relative (all
terms are non-negative), which one test checks too.
"""

from __future__ import annotations

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection, ops, reference
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.sparse import SparseFeatures
from tetrarec.types import PoolingMode

B = 24
WD = 0.01
ROWWISE = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.1, eps=1e-3, initial_accumulator=0.0)


def _tables(precision: str, pooling: str) -> list[TableConfig]:
    """One store: "a" looked up by two features, "b" (dim 12: a vector loop plus a
    tail), "e" whose feature has only empty bags."""
    return [
        TableConfig(name="a", num_embeddings=40, dim=8, precision=precision, pooling=pooling,
                    feature_names=("a0", "a1")),
        TableConfig(name="b", num_embeddings=300, dim=12, precision=precision, pooling=pooling),
        TableConfig(name="e", num_embeddings=5, dim=4, precision=precision),
    ]  # fmt: skip


def _features(ebc: FusedEmbeddingBagCollection, weighted: bool, seed: int) -> SparseFeatures:
    """Skewed ids (hot rows repeat within and across bags and features), bags of 0-6."""
    gen = torch.Generator().manual_seed(seed)
    rows = {f: t.num_embeddings for t in ebc.tables for f in t.feature_names}
    values, lengths = [], []
    for f in ebc.feature_names:
        lens = torch.randint(0, 7, (B,), generator=gen) * (f != "e")
        values.append((torch.rand(int(lens.sum()), generator=gen) ** 3 * rows[f]).long())
        lengths.append(lens)
    vals = torch.cat(values)
    weights = torch.rand(vals.numel(), generator=gen) + 0.5 if weighted else None
    return SparseFeatures(ebc.feature_names, vals, torch.cat(lengths), B, weights)


def _oracle(ebc, i, sf, grad, wd):
    """Rows and shares of table ``i`` by a loop over its ids in position order."""
    t = ebc.tables[i]
    current = ebc.table_weights()[t.name]
    offsets = [0, *torch.cumsum(sf.lengths, 0).tolist()]
    summed: dict[int, torch.Tensor] = {}
    col = 0
    for k, (f, d) in enumerate(zip(ebc.feature_names, ebc.feature_dims)):
        if f in t.feature_names:
            for b in range(B):
                s0, s1 = offsets[k * B + b], offsets[k * B + b + 1]
                for j in range(s0, s1):
                    g = grad[b, col : col + d]
                    if t.pooling is PoolingMode.MEAN:
                        g = g / (s1 - s0)
                    if sf.weights is not None:
                        g = g * sf.weights[j]
                    row = int(sf.values[j])
                    summed[row] = summed.get(row, torch.zeros(d)) + g
        col += d
    rows = sorted(summed)
    shares = []
    for r in rows:
        g = summed[r] + wd * current[r] if wd else summed[r]
        sq = torch.zeros(())
        for d in range(t.dim):
            sq = sq + g[d] * g[d]
        shares.append(sq)
    empty = torch.zeros(0)
    return torch.tensor(rows, dtype=torch.int64), torch.stack(shares) if shares else empty


CASES = [
    (precision, pooling, weighted, wd)
    for precision in ("fp32", "fp16", "int8")
    for pooling, weighted in (("sum", False), ("mean", False), ("sum", True))
    for wd in (0.0, WD)
]


@pytest.mark.parametrize(("precision", "pooling", "weighted", "wd"), CASES)
def test_shares_equal_the_naive_sums_bitwise(kernel_path, precision, pooling, weighted, wd):
    """Catches: a wrong table or feature mask, duplicates summed out of position order,
    a missing mean division, per-id weight or weight decay, rows decoded wrongly for
    weight decay, squares summed in another order than the update's."""
    ebc = FusedEmbeddingBagCollection(_tables(precision, pooling), ROWWISE, seed=1)
    sf = _features(ebc, weighted, seed=2)
    grad = torch.randn(B, sum(ebc.feature_dims), generator=torch.Generator().manual_seed(3))
    for i, t in enumerate(ebc.tables):
        rows, share = ebc.row_gradient_shares_of_ids(
            i, grad, sf.values, sf.lengths, sf.weights, weight_decay=wd
        )
        want_rows, want_share = _oracle(ebc, i, sf, grad, wd)
        assert rows.dtype == torch.int64
        assert share.dtype == torch.float32
        assert torch.equal(rows, want_rows), f"table {t.name}: touched rows differ"
        assert torch.equal(share, want_share), f"table {t.name}: shares differ"
    assert rows.numel() == 0  # table "e": only empty bags


def test_shares_are_within_the_documented_bound_of_a_torch_sum(kernel_path):
    """Catches a share that is not a sum of squares of the summed gradient at all."""
    ebc = FusedEmbeddingBagCollection(_tables("fp32", "sum"), ROWWISE, seed=4)
    sf = _features(ebc, weighted=True, seed=5)
    grad = torch.randn(B, sum(ebc.feature_dims), generator=torch.Generator().manual_seed(6))
    for i, t in enumerate(ebc.tables[:2]):
        rows, share = ebc.row_gradient_shares_of_ids(i, grad, sf.values, sf.lengths, sf.weights, WD)
        got_rows, g, w = ebc.row_gradients(i, grad, sf.values, sf.lengths, sf.weights)
        g = g + WD * w
        assert torch.equal(rows, got_rows)
        torch.testing.assert_close(share, (g * g).sum(1), rtol=2 * t.dim * 2**-24, atol=0)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_share_is_what_the_rowwise_update_adds(kernel_path, precision):
    """From a zero accumulator, row-wise Adagrad's state after one update is share / D.

    Catches a share whose sum differs from the update's own (the compiled update sums
    8 rows interleaved; the shares must equal it bitwise), or one computed from the rows
    after the update instead of before it.
    """
    ebc = FusedEmbeddingBagCollection(
        _tables(precision, "sum"), SparseOptimizerSpec(
            kind="rowwise_adagrad", lr=0.1, eps=1e-3, weight_decay=WD, initial_accumulator=0.0
        ), seed=7,
    )  # fmt: skip
    sf = _features(ebc, weighted=False, seed=8)
    grad = torch.randn(B, sum(ebc.feature_dims), generator=torch.Generator().manual_seed(9))
    shares = [
        ebc.row_gradient_shares_of_ids(i, grad, sf.values, sf.lengths, None, WD) for i in (0, 1)
    ]
    ebc.update_ids(grad, sf.values, sf.lengths, None)
    state = ebc.optimizer_state()
    for (rows, share), t in zip(shares, ebc.tables):
        assert rows.numel() >= 8  # the interleaved 8-row branch runs
        added = state[t.name]["sum"][rows]
        if kernel_path == "compiled":
            assert torch.equal(added, share / t.dim), t.name
        else:  # the portable rule takes a torch mean: another order of the same sum
            torch.testing.assert_close(added, share / t.dim, rtol=2 * t.dim * 2**-24, atol=0)


# -- thread counts, above the kernel's parallel split thresholds ----------------------------

RADIX_CHUNK_IDS = 131072  # tbe_cpu_backward.h: radix_sort_keys, n / 131072 chunks
UPDATE_RANGE_IDS = 4096  # tbe_cpu_backward.h: row_aligned_bounds, n / 4096 ranges
KEYS_GRAIN = 2048  # tbe_cpu_backward.h: sorted_keys, parallel_for grain

BIG = {
    # name: (table "a"'s features, batch, min bag length, max bag length, weighted).
    # "gather": two features (global radix sort, 2 chunks), many ids per bag (the
    # gradient rows are gathered). "direct": one id per bag (per-feature sort, grad_out
    # read in place). "weighted": per-id weights (keys hold positions).
    "gather": (("a0", "a1"), 1024, 128, 255, False),
    "direct": (("a0",), 9000, 1, 1, False),
    "weighted": (("a0", "a1"), 1100, 2, 14, True),
}


def _big(name):
    names, batch, lo, hi, weighted = BIG[name]
    tables = [
        TableConfig(name="a", num_embeddings=10_000, dim=8, feature_names=names),
        TableConfig(name="b", num_embeddings=50, dim=16),  # in the store, not asked for
    ]
    ebc = FusedEmbeddingBagCollection(tables, ROWWISE, seed=11)
    gen = torch.Generator().manual_seed(12)
    lengths = torch.randint(lo, hi + 1, (len(ebc.feature_names) * batch,), generator=gen)
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 4 * 10_000).long()
    ids[-int(lengths[-batch:].sum()) :] %= 50  # feature "b": ids of table b
    psw = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    grad = torch.randn(batch, sum(ebc.feature_dims), generator=gen)
    return ebc, grad, ids, lengths, psw


def test_big_cases_sit_above_every_split_threshold():
    """If a case shrinks below a threshold, the thread test no longer tests a split."""
    _, grad, ids, lengths, _ = _big("gather")
    a_ids = int(lengths[: 2 * grad.shape[0]].sum())
    assert a_ids >= 2 * RADIX_CHUNK_IDS
    assert a_ids >= 2 * lengths.numel()
    _, grad, ids, lengths, _ = _big("direct")
    assert grad.shape[0] >= 2 * UPDATE_RANGE_IDS
    assert lengths.numel() > KEYS_GRAIN
    assert ids.numel() < 2 * lengths.numel()  # direct reads
    _, grad, ids, lengths, _ = _big("weighted")
    assert int(lengths[: 2 * grad.shape[0]].sum()) >= 2 * UPDATE_RANGE_IDS
    assert lengths.numel() > KEYS_GRAIN


@pytest.mark.parametrize("name", list(BIG))
def test_compiled_shares_equal_across_thread_counts_and_the_reference(name):
    """Catches a radix sort unstable across chunks, a row split between two threads,
    output slots counted per thread in the wrong order, or a mask missing in one path."""
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    ebc, grad, ids, lengths, psw = _big(name)
    store = ebc.storages()[0]
    meta = ebc._meta(0)
    runs = {}
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs[threads] = ops.tbe_row_gradient_shares(
                grad, store, meta, ids, lengths, psw, 0, WD, "fp32"
            )
    finally:
        torch.set_num_threads(previous)
    want = reference.row_gradient_shares(grad, store, meta, 0, ids, lengths, psw, WD, "fp32")
    for threads, (rows, share) in runs.items():
        assert torch.equal(rows, want[0]), f"{threads} threads: rows differ"
        assert torch.equal(share, want[1]), f"{threads} threads: shares differ"


# -- errors -------------------------------------------------------------------------------


def test_table_outside_the_store_is_an_error(kernel_path):
    ebc = FusedEmbeddingBagCollection(_tables("fp32", "sum"), ROWWISE, seed=1)
    sf = _features(ebc, weighted=False, seed=2)
    grad = torch.zeros(B, sum(ebc.feature_dims))
    args = (grad, ebc.storages()[0], ebc._meta(0), sf.values, sf.lengths, None)
    with pytest.raises((RuntimeError, IndexError)):
        ops.tbe_row_gradient_shares(*args, 3, 0.0, "fp32")


def test_id_outside_its_table_names_the_feature(kernel_path):
    """Catches an unchecked id (the kernel would read outside the table)."""
    ebc = FusedEmbeddingBagCollection(_tables("fp32", "sum"), ROWWISE, seed=1)
    sf = _features(ebc, weighted=False, seed=2)
    values = sf.values.clone()
    start = int(sf.lengths[: 2 * B].sum())  # first id of feature "b"
    values[start] = 300
    grad = torch.zeros(B, sum(ebc.feature_dims))
    with pytest.raises(ValueError, match="feature 'b': id 300 is outside its table 'b'"):
        ebc.row_gradient_shares_of_ids(1, grad, values, sf.lengths, None, 0.0)
    # table "a" never reads feature b's ids
    rows, _ = ebc.row_gradient_shares_of_ids(0, grad, values, sf.lengths, None, 0.0)
    assert rows.numel() > 0
