"""Each rank caches its own shards: a sharded cached table equals the one-process one.

The reference is the one-process ``CachedEmbeddingBagCollection`` (same seed, cache
fraction and policy). Table-wise shards and column blocks see every id of their table,
so their caches make the one-process cache's decisions and the runs are bitwise equal,
evictions included. Row blocks cache their own rows: with every row cached the results
equal the reference up to the order in which the blocks' partial sums are added.
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
    case("row_wise/int8/all-cached", ("row_wise",), "int8", ROWWISE, fraction=1.0, exact=False),
    case("mixed/fp16/sgd", ("row_wise", "table_wise"), "fp16", SGD, fraction=1.0, exact=False),
]


@pytest.mark.timeout(600)
def test_sharded_cached_tables_equal_the_one_process_cached_table():
    """Catches a shard cache built on local instead of global rows (other initial rows
    or rounding draws), per-shard capacities that differ from the plan's fraction, a
    cached shard whose optimizer does not follow the sharded collection's learning rate,
    and evicted rows written back wrong."""
    results = run_ranks(sharded_cases_worker, world_size=2, args=(CASES,), timeout_s=540)
    bad = []
    for i, c in enumerate(CASES):
        per_rank = [r[i] for r in results]
        bad.extend(compare(c, per_rank, reference_run(c), rtol=1e-5, atol=1e-6))
    assert not bad, "\n".join(bad)
