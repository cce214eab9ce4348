"""Bitwise determinism across thread counts at sizes where the compiled kernel splits work.

The compiled kernel (csrc/tbe_cpu.cpp, tbe_cpu_backward.h) splits its work across threads
only above these sizes (with T threads):

    forward              parallel_for over F*B bags, grain 256          F*B > 256
    backward, keys       parallel_for over F*B bags, grain 2048         F*B > 2048
    backward, gather     parallel_for over F*B bags, grain 512, only    F*B > 512 and
                         when n >= 2*F*B (else grad_out is read direct)  n >= 2*F*B
    backward, radix sort min(T, n / 131072) chunks                      n >= 2 * 131072
    backward, update     min(T, n / 4096) row-aligned ranges            n >= 2 * 4096
    row-wise Adagrad     8 rows of one dim interleaved (else 1 by 1)    >= 8 unique rows

(n: ids of one row store in the batch). The cases below sit just above every threshold
for T = 2 and T = 4 (4 chunks of the radix sort need n >= 4 * 131072), with ids drawn
from a skewed distribution so that most rows repeat many times and the order in which a
row's duplicates are summed shows in its FP32 bits. Each case runs forward, backward and
a second step with 1, 2 and 4 threads and compares the outputs, the per-id weight
gradients, every stored row and every optimizer state bitwise.

Bugs these catch: a radix sort that is not stable across its chunks, update ranges that
split one row's duplicates between two threads, a per-thread partial sum merged in
thread order, a stochastic-rounding stream keyed by thread or chunk, the interleaved
row-wise Adagrad branch summing in another order than the one-row branch.
"""

import functools

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.sparse import SparseFeatures

RADIX_CHUNK_IDS = 131072  # tbe_cpu_backward.h: radix_sort_keys, n / 131072 chunks
UPDATE_RANGE_IDS = 4096  # tbe_cpu_backward.h: row_aligned_bounds, n / 4096 ranges
KEYS_GRAIN = 2048  # tbe_cpu_backward.h: sorted_keys, parallel_for grain
THREADS = (1, 2, 4)

SPECS = {
    "sgd": dict(kind="sgd", lr=0.1, weight_decay=0.01),
    "adagrad": dict(kind="adagrad", lr=0.1, eps=1e-3, initial_accumulator=0.01),
    "rowwise_adagrad": dict(kind="rowwise_adagrad", lr=0.1, eps=1e-3, weight_decay=0.01),
    "adam": dict(kind="adam", lr=0.05, eps=1e-4, beta1=0.8, beta2=0.95, weight_decay=0.01),
    "rowwise_adam": dict(kind="rowwise_adam", lr=0.05, eps=1e-4, beta1=0.8, beta2=0.95),
}


def _skewed_ids(n, rows, gen):
    """Ids in [0, rows) with a heavy head: row 0 alone gets about a fifth of the ids."""
    return (torch.rand(n, generator=gen) ** 4 * rows).long().clamp_(max=rows - 1)


def _features(feature_rows, batch, min_len, max_len, *, weighted, seed):
    gen = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for rows in feature_rows:
        lens = torch.randint(min_len, max_len + 1, (batch,), generator=gen)
        values.append(_skewed_ids(int(lens.sum()), rows, gen))
        lengths.append(lens)
    values, lengths = torch.cat(values), torch.cat(lengths)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    keys = tuple(f"f{i}" for i in range(len(feature_rows)))
    return SparseFeatures(keys, values, lengths, batch, weights)


# Gather path: many ids per bag. The fp32 store holds tables "a" (dim 4, 10_000 rows:
# two radix passes of 13 bits) and "m" (dim 8, mean pooling); its > 4 * 131072 ids split
# the radix sort in 4 chunks. "h" (fp16, dim 13: the compiled vector loop plus a tail)
# and "q" (int8) round stochastically.
GATHER_TABLES = [
    TableConfig(name="a", num_embeddings=10_000, dim=4, feature_names=("f0", "f1")),
    TableConfig(name="m", num_embeddings=3_000, dim=8, pooling="mean", feature_names=("f2",)),
    TableConfig(name="h", num_embeddings=2_000, dim=13, precision="fp16", feature_names=("f3",)),
    TableConfig(name="q", num_embeddings=1_000, dim=16, precision="int8", feature_names=("f4",)),
]
# Direct path: one id per bag (n < 2 * F * B: grad_out is read in place), many bags.
DIRECT_TABLES = [
    TableConfig(name="a", num_embeddings=5_000, dim=8, feature_names=("f0",)),
    TableConfig(name="h", num_embeddings=700, dim=13, precision="bf16", feature_names=("f1",)),
]
# Per-id weights (keys hold positions, not bags), sum pooling only.
WEIGHTED_TABLES = [
    TableConfig(name="a", num_embeddings=4_000, dim=8, feature_names=("f0", "f1")),
    TableConfig(name="q", num_embeddings=900, dim=6, precision="int4", feature_names=("f2",)),
]

CASES = {
    # (tables, batch, min bag length, max bag length, weighted)
    "gather": (GATHER_TABLES, 2048, 1, 255, False),
    "direct": (DIRECT_TABLES, 9000, 1, 1, False),
    "weighted": (WEIGHTED_TABLES, 1100, 2, 14, True),
}


@functools.cache  # the same batches for every optimizer and thread count
def _case_features(name, step):
    tables, batch, lo, hi, weighted = CASES[name]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    return _features(rows, batch, lo, hi, weighted=weighted, seed=10 * step + len(name))


def _run(name, spec, threads):
    """Two training steps with ``threads`` threads; every result and the final state."""
    tables = CASES[name][0]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ebc = FusedEmbeddingBagCollection(tables, spec, seed=3, stochastic_rounding=True)
        results = []
        for step in range(2):
            sf = _case_features(name, step)
            if sf.weights is not None:  # a fresh leaf: the cached batch stays untouched
                weights = sf.weights.clone().requires_grad_(True)
                sf = SparseFeatures(sf.keys, sf.values, sf.lengths, sf.batch_size, weights)
            out = ebc(sf).values
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            out.backward(grad)
            results.append(out.detach())
            if sf.weights is not None:
                results.append(sf.weights.grad)
        state = {k: v.clone() for k, v in ebc.state_dict().items()}
        for table, names in ebc.fused_optimizer.state_dict()["state"].items():
            state.update({f"state.{table}.{n}": v.clone() for n, v in names.items()})
    finally:
        torch.set_num_threads(previous)
    return results, state


def test_cases_sit_above_every_split_threshold():
    """If a case shrinks below a threshold, the thread test no longer tests a split."""
    sf = _case_features("gather", 0)
    fp32_ids = int(sf.lengths[: 3 * sf.batch_size].sum())  # f0, f1, f2: the fp32 store
    assert fp32_ids >= 4 * RADIX_CHUNK_IDS
    assert sf.values.numel() >= 2 * sf.lengths.numel()  # gather path
    direct = _case_features("direct", 0)
    assert direct.lengths.numel() > KEYS_GRAIN
    assert direct.batch_size >= 2 * UPDATE_RANGE_IDS  # fp32 store: one id per bag
    assert direct.values.numel() < 2 * direct.lengths.numel()  # direct reads
    weighted = _case_features("weighted", 0)
    assert int(weighted.lengths[: 2 * weighted.batch_size].sum()) >= 4 * UPDATE_RANGE_IDS
    assert weighted.lengths.numel() > KEYS_GRAIN


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(SPECS))
def test_compiled_kernel_is_bitwise_identical_across_thread_counts(name, case):
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    spec = SparseOptimizerSpec(**SPECS[name])
    runs = {n: _run(case, spec, n) for n in THREADS}
    base_results, base_state = runs[1]
    for n in THREADS[1:]:
        results, state = runs[n]
        for i, (x, y) in enumerate(zip(results, base_results)):
            assert torch.equal(x, y), f"{n} threads: result {i} differs from 1 thread"
        assert state.keys() == base_state.keys()
        for key, value in state.items():
            assert torch.equal(value, base_state[key]), f"{n} threads: {key} differs"
