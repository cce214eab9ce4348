"""Each rank caches its own shards: a sharded cached table equals the one-process one.

The reference is the one-process ``CachedEmbeddingBagCollection`` (same seed, cache
fraction and policy). Table-wise shards and column blocks see every id of their table,
so their caches make the one-process cache's decisions and the runs are bitwise equal,
evictions included. Data-parallel replicas run the policy step on the gathered global
batch, so every replica's cache decides and counts as the one process's, bitwise too.
Column blocks of a row-wise optimizer share their rows' squared-gradient sums (summed in
rank order), so they equal the reference within a tolerance. Row blocks cache their own
rows: with every row cached the results equal the reference up to the order in which
the blocks' partial sums are added.

One spawn of 2 ranks runs every case (``results``); the tests check their shares.
"""

from __future__ import annotations

import pytest

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.testing import run_ranks
from tetrarec.testing.equivalence import (
    EquivalenceCase,
    compare,
    reference_run,
    sharded_cases_worker,
)

pytestmark = pytest.mark.distributed

SGD = SparseOptimizerSpec(kind="sgd", lr=0.1)
ADAGRAD = SparseOptimizerSpec(kind="adagrad", lr=0.1)
ROWWISE = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.1)
ROW_ADAM = SparseOptimizerSpec(kind="rowwise_adam", lr=0.05, weight_decay=0.01)


def tables(precision: str, b_pooling: str = "mean") -> tuple[TableConfig, ...]:
    # 40+ rows, a quarter cached: the ~20 ids a step draws evict rows every step
    return (
        TableConfig(name="a", num_embeddings=48, dim=8, feature_names=("a0", "a1"),
                    precision=precision),
        TableConfig(name="b", num_embeddings=40, dim=8, pooling=b_pooling, precision=precision),
    )  # fmt: skip


def case(name: str, types: tuple[str, ...], precision: str, opt: SparseOptimizerSpec,
         placement: str = "cached", fraction: float = 0.25, exact: bool = True,
         weighted: bool = False) -> EquivalenceCase:  # fmt: skip
    return EquivalenceCase(
        name=name,
        tables=tables(precision, "sum" if weighted else "mean"),
        types=types,
        optimizer=opt,
        steps=4,
        placement=placement,
        cache_fraction=fraction,
        exact=exact,
        weighted=weighted,
        weight_grad=weighted,
    )


CASES = [
    case("table_wise/int8/rowwise_adagrad", ("table_wise",), "int8", ROWWISE),
    case("table_wise/int8/sgd/weighted", ("table_wise",), "int8", SGD, weighted=True),
    case("table_wise/fp16/adagrad/ssd", ("table_wise",), "fp16", ADAGRAD, placement="ssd"),
    case("column_wise/fp16/adagrad", ("column_wise",), "fp16", ADAGRAD),
    # row-wise state shared across cached column blocks: shares summed in rank order
    case(
        "column_wise/fp16/rowwise_adagrad/weighted",
        ("column_wise",),
        "fp16",
        ROWWISE,
        exact=False,
        weighted=True,
    ),
    case(
        "table_column_wise/fp32/rowwise_adam/ssd",
        ("table_column_wise",),
        "fp32",
        ROW_ADAM,
        placement="ssd",
        exact=False,
    ),
    case("row_wise/int8/all-cached", ("row_wise",), "int8", ROWWISE, fraction=1.0, exact=False),
    # table-row-wise on one node of 2 ranks: each rank caches its row block
    case(
        "table_row_wise/fp16/adagrad/all-cached",
        ("table_row_wise",),
        "fp16",
        ADAGRAD,
        fraction=1.0,
        exact=False,
    ),
    case("mixed/fp16/sgd", ("row_wise", "table_wise"), "fp16", SGD, fraction=1.0, exact=False),
]


# Data-parallel replicas: INT8 rows behind LRU caches of a quarter of the rows (every
# step evicts and writes back), weighted bags, an SSD backing, and a cached replicated
# table next to a cached table-wise one in one plan.
DP_CASES = [
    case("data_parallel/int8/sgd/weighted", ("data_parallel",), "int8", SGD, weighted=True),
    case("data_parallel/int8/rowwise_adagrad", ("data_parallel",), "int8", ROWWISE),
    case("data_parallel/fp16/adagrad/ssd", ("data_parallel",), "fp16", ADAGRAD, placement="ssd"),
    case("mixed/int8/rowwise_adagrad/data_parallel+table_wise", ("data_parallel", "table_wise"),
         "int8", ROWWISE),
]  # fmt: skip


@pytest.fixture(scope="module")
def results():
    """Every case's per-rank results, from one spawn of 2 ranks."""
    every = [*CASES, *DP_CASES]
    out = run_ranks(sharded_cases_worker, world_size=2, args=(every,), timeout_s=540)
    return {c.name: [r[i] for r in out] for i, c in enumerate(every)}


def _mismatches(cases, results) -> list[str]:
    bad = []
    for c in cases:
        bad.extend(compare(c, results[c.name], reference_run(c), rtol=1e-5, atol=1e-6))
    return bad


@pytest.mark.timeout(600)
def test_sharded_cached_tables_equal_the_one_process_cached_table(results):
    """Catches a shard cache built on local instead of global rows (other initial rows
    or rounding draws), per-shard capacities that differ from the plan's fraction, a
    cached shard whose optimizer does not follow the sharded collection's learning rate,
    evicted rows written back wrong, and (column blocks of row-wise optimizers) a cached
    row's gradient share read from its slot index instead of its row, or the other
    blocks' share added to the backing state of a row that lives in its slot (or not
    added to an uncached row's); column blocks' counters must equal one process's."""
    bad = _mismatches(CASES, results)
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(600)
def test_cached_data_parallel_replicas_equal_the_one_process_cached_table(results):
    """Rows, optimizer state, pooled outputs, per-id weight gradients and every replica's
    cache counters bitwise equal to one process on the global batch, over 4 steps with
    evictions and write-backs. Bugs caught: a replica whose policy step sees only its
    own samples (other admissions and counters, replicas that drift apart), pooling
    through a slot map other than the global batch's, a backward that applies the
    global gradients through this rank's route (rows of other ranks' ids never
    updated), cached rows not marked dirty (evictions would drop their updates), and
    the per-id weight gradient taken from another rank's share of the global batch."""
    for c in DP_CASES:
        ref = reference_run(c)["cache_stats"]
        assert all(s.evictions > 0 and s.write_backs > 0 for s in ref.values()), (c.name, ref)
        for rank, res in enumerate(results[c.name]):
            for table in ("a", "b") if c.types == ("data_parallel",) else ("a",):
                assert res["cache_stats"][table] == ref[table], (c.name, rank, table)
    bad = _mismatches(DP_CASES, results)
    assert not bad, "\n".join(bad)
