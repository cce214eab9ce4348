"""Sharded equals unsharded, for every sharding type, on gloo ranks.

Every case is spelled out below (no sampling). Per sharding type and world size, eight
cases: {sum, sum with per-id weights, mean pooling} x {row-wise Adagrad, Adam} on FP32
rows, one on FP16 rows with stochastic rounding, and one that trains one step in one
process and then shards the trained collection (``shard_collection``); 3 training steps
and an evaluation pass each. The tables have row counts not divisible by any world size
(11, 7, 5) and one table is looked up by two features. Per type, two more cases train a
DLRM's first-order tables (dim 1, FP32, zero-initialized, Adagrad), plain and weighted.
One more per type trains a global batch of 13 samples, which no world size divides
(ranks hold slices of different sizes). TW/RW/CW/DP and a mixed plan run
at world sizes 2 and 3; TWRW/TWCW (and a mixed hierarchical plan) at 4 = 2 nodes x 2
ranks. One spawn per world size runs all its cases.

Expectations (``TOLERANCE``):
- TW, CW (element-wise optimizers), DP, TWCW: only data moves, so outputs, rows and
  optimizer state are bitwise equal to one process;
- RW, TWRW: a bag's partial sums from several ranks are added in rank order, not in id
  order: outputs within 1e-6 relative; the rows' updates are bitwise equal (each row's
  gradient is summed in sample order on its one owner), compared within the same bound;
- CW/TWCW with row-wise optimizers: the shares of a row's squared gradient are added
  across column blocks: within 1e-5 relative.

Bugs these catch (each was tried): ids routed to the wrong rank or row block, a local
row offset off by one, a column block put in the wrong place, the gradient of one rank's
samples applied twice or not at all, mean pooling dividing by the piece's length instead
of the bag's, per-id weights dropped on the way, per-row state of a column-split table
kept per block.
"""

from __future__ import annotations

import pytest

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.models import first_order_optimizer, first_order_tables
from tetrarec.testing import run_ranks
from tetrarec.testing.equivalence import (
    EquivalenceCase,
    bad_id_worker,
    compare,
    reference_run,
    sharded_cases_worker,
)

pytestmark = pytest.mark.distributed

ROWWISE_ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.1, weight_decay=0.01)
ADAM = SparseOptimizerSpec(kind="adam", lr=0.05, beta1=0.8, beta2=0.95, weight_decay=0.01)


def tables(pooling: str = "sum", precision: str = "fp32") -> tuple[TableConfig, ...]:
    return (
        TableConfig(name="a", num_embeddings=11, dim=8, feature_names=("a0", "a1"),
                    pooling=pooling, precision=precision),
        TableConfig(name="b", num_embeddings=7, dim=6, pooling=pooling, precision=precision),
        TableConfig(name="c", num_embeddings=5, dim=4, pooling=pooling, precision=precision),
    )  # fmt: skip


MIXED = ("row_wise", "column_wise", "data_parallel")  # a -> RW, b -> CW, c -> DP
MIXED_4 = ("table_row_wise", "table_column_wise", "table_wise")

# (sharding types, exact with element-wise optimizers, exact with row-wise optimizers)
FLAT_TYPES = {
    "table_wise": (("table_wise",), True, True),
    "row_wise": (("row_wise",), False, False),
    "column_wise": (("column_wise",), True, False),
    "data_parallel": (("data_parallel",), True, True),
    "mixed": (MIXED, False, False),
}
NODE_TYPES = {
    "table_row_wise": (("table_row_wise",), False, False),
    "table_column_wise": (("table_column_wise",), True, False),
    "mixed_nodes": (MIXED_4, False, False),
}


def cases_for(types: dict[str, tuple[tuple[str, ...], bool, bool]]) -> list[EquivalenceCase]:
    out = []
    for name, (kinds, exact_elementwise, exact_rowwise) in types.items():
        for opt_name, opt, exact in (
            ("rowwise_adagrad", ROWWISE_ADAGRAD, exact_rowwise),
            ("adam", ADAM, exact_elementwise),
        ):
            for pooling, weighted in (("sum", False), ("sum", True), ("mean", False)):
                label = f"{pooling}{'-weighted' if weighted else ''}"
                out.append(
                    EquivalenceCase(
                        name=f"{name}/{opt_name}/{label}/fp32",
                        tables=tables(pooling),
                        types=kinds,
                        optimizer=opt,
                        weighted=weighted,
                        weight_grad=weighted,
                        steps=3,
                        exact=exact,
                    )
                )
        out.append(
            EquivalenceCase(
                name=f"{name}/adam/sum/fp32/sharded-after-1-step-in-one-process",
                tables=tables("sum"),
                types=kinds,
                optimizer=ADAM,
                steps=3,
                warm_start_steps=1,
                exact=exact_elementwise,
            )
        )
        out.append(
            EquivalenceCase(
                name=f"{name}/rowwise_adagrad/sum-weighted/fp32/uneven-batch",
                tables=tables("sum"),
                types=kinds,
                optimizer=ROWWISE_ADAGRAD,
                batch_size=13,  # no world size divides it: ranks hold 6/7, 4/4/5, 3/3/3/4
                weighted=True,
                weight_grad=True,
                steps=3,
                exact=exact_rowwise,
            )
        )
        out.append(
            EquivalenceCase(
                name=f"{name}/adam/sum/fp16",
                tables=tables("sum", "fp16"),
                types=kinds,
                optimizer=ADAM,
                steps=3,
                exact=exact_elementwise,
            )
        )
    return out


def first_order_cases(
    types: dict[str, tuple[tuple[str, ...], bool, bool]],
) -> list[EquivalenceCase]:
    """A DLRM's first-order term's tables (``first_order_tables``: dim 1, FP32, starting
    at 0, Adagrad with lazy L2) under each type: a dim-1 table cannot be split by
    columns, and its rows start equal, so a mix-up of rows shows only once they train."""
    fo = first_order_tables(tables("sum"))
    opt = first_order_optimizer(lr=0.1, weight_decay=0.01)
    return [
        EquivalenceCase(
            name=f"{name}/first_order/{label}",
            tables=fo,
            types=kinds,
            optimizer=opt,
            weighted=weighted,
            weight_grad=weighted,
            steps=3,
            exact=exact_elementwise,
        )
        for name, (kinds, exact_elementwise, _) in types.items()
        for label, weighted in (("sum", False), ("sum-weighted", True))
    ]


CASES_FLAT = cases_for(FLAT_TYPES) + first_order_cases(FLAT_TYPES)
CASES_NODES = cases_for(NODE_TYPES) + first_order_cases(NODE_TYPES)
RTOL, ATOL = 1e-5, 1e-6


def _check(cases: list[EquivalenceCase], results: list[list[dict]]) -> list[str]:
    bad = []
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        bad.extend(compare(case, per_rank, reference_run(case), rtol=RTOL, atol=ATOL))
    return bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_flat_types_and_a_mixed_plan_equal_one_process(world):
    results = run_ranks(sharded_cases_worker, world_size=world, args=(CASES_FLAT,), timeout_s=540)
    bad = _check(CASES_FLAT, results)
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(600)
def test_hierarchical_types_on_two_nodes_of_two_equal_one_process():
    results = run_ranks(
        sharded_cases_worker,
        world_size=4,
        local_world_size=2,
        args=(CASES_NODES,),
        timeout_s=540,
    )
    bad = _check(CASES_NODES, results)
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
def test_an_out_of_range_id_stops_every_rank_naming_feature_and_id():
    """Catches a bad id routed to a neighbouring feature's rows or a wrong row block
    (row-wise bucketizes every feature at once, clamping it), or an error on one rank
    only, which would hang the others."""
    kinds = ("row_wise", "table_wise", "column_wise", "data_parallel")
    cases = [(k, bad) for k in kinds for bad in (7, -1, 1000)]
    errors = run_ranks(bad_id_worker, world_size=2, args=(cases,), timeout_s=240)
    for rank, errs in enumerate(errors):
        for (kind, bad), err in zip(cases, errs):
            assert f"feature 'b': id {bad} is outside its table" in err, (kind, rank, err)
