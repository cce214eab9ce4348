"""A sharding type added from outside the library: declared, registered, planned, trained.

The toy type ``highest_rank`` (a whole table; ``plan_by_type`` puts it on the highest
rank) is declared and registered by this module, touching no other file: it reuses the
block group (``GROUPS["block"]``) that runs table-wise tables, and its cost terms are
those of a whole table, not offered by default (the planner tries it only for tables
whose ``TableSpec.shardings`` names it). Spawned ranks import this module to find the
worker, which registers the toy there too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tetrarec.config import RunConfig, config_to_dict
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.planner import (
    PlannerInputs,
    RankResources,
    TableSpec,
    Topology,
    candidates,
    plan,
    predict,
)
from tetrarec.sharding import ShardingPlan, plan_by_type
from tetrarec.sharding.plan import Shard, TablePlan
from tetrarec.sharding.strategy import (
    GROUPS,
    STRATEGIES,
    CandidateContext,
    CostTerms,
    PlacementContext,
    Split,
    register,
)
from tetrarec.testing import RankContext, run_ranks
from tetrarec.testing.equivalence import (
    EquivalenceCase,
    compare,
    reference_run,
    sharded_cases_worker,
)
from tetrarec.types import OptimizerKind, ShardingType

TOY = ShardingType.declare("highest_rank")


class HighestRank:
    """The toy strategy: each table whole, on the highest rank when placed by type."""

    sharding_type = TOY
    group = "block"  # runs with table-wise and column-wise tables
    cost = CostTerms(label="HR", order=100, split=Split.WHOLE, offered=False)

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """The whole table on the highest rank."""
        rows, cols = (0, table.num_embeddings), (0, table.dim)
        return (Shard(rank=ctx.world_size - 1, rows=rows, cols=cols),)

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """One shard holding the whole table (on any rank: the planner picks it)."""
        full = ((0, table.num_embeddings), (0, table.dim))
        if len(plan.shards) != 1 or (plan.shards[0].rows, plan.shards[0].cols) != full:
            raise ValueError(f"table {table.name!r}: a highest_rank table is one whole shard")

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """One whole shard."""
        return (1,)


register(HighestRank())


def toy_cases_worker(ctx: RankContext, cases: list[EquivalenceCase]) -> list[Any]:
    """``sharded_cases_worker``, from this module, so that a spawned rank registers the toy."""
    assert TOY in STRATEGIES
    return sharded_cases_worker(ctx, cases)


def _tables() -> tuple[TableConfig, ...]:
    return (
        TableConfig(name="a", num_embeddings=11, dim=8, feature_names=("a0", "a1")),
        TableConfig(name="b", num_embeddings=7, dim=6),
        TableConfig(name="c", num_embeddings=5, dim=4),
    )


def _topology(world: int) -> Topology:
    return Topology(
        name="toy",
        nodes=1,
        ranks_per_node=world,
        collective_latency_s=1e-5,
        intra_node_bandwidth=1e10,
        inter_node_bandwidth=1e10,
        rank=RankResources(
            device_memory=0.0,
            host_memory=1e9,
            ssd=0.0,
            device_bandwidth=0.0,
            host_bandwidth=1e10,
            ssd_bandwidth=0.0,
            matmul_flops=1e10,
        ),
    )


def _inputs(shardings: dict[str, tuple[ShardingType, ...]], world: int = 2) -> PlannerInputs:
    specs = tuple(
        TableSpec(
            name=t.name,
            rows=t.num_embeddings,
            dim=t.dim,
            features=t.feature_names,
            shardings=shardings.get(t.name, ()),
        )
        for t in _tables()
    )
    return PlannerInputs(tables=specs, batch_size=12, topology=_topology(world))


def _planned() -> ShardingPlan:
    """The planner's plan: ``a`` and ``b`` must be toy tables, ``c`` table-wise."""
    toy_only: dict[str, tuple[ShardingType, ...]] = {
        "a": (TOY,),
        "b": (TOY,),
        "c": (ShardingType.TABLE_WISE,),
    }
    sharding_plan, _ = plan(_inputs(toy_only))
    return sharding_plan


def test_the_toy_type_round_trips_through_config_and_plan_file(tmp_path: Path) -> None:
    """Bugs caught: a closed set of sharding types (the config or a plan file refuses a
    declared type), or a declared type that loads as a new object (so ``STRATEGIES``
    lookups and ``is`` comparisons miss it)."""
    assert ShardingType.parse("Highest_Rank") is TOY
    config = RunConfig().with_overrides(["model.num_sparse=2", "sharding.type=highest_rank"])
    assert config.sharding.type is TOY
    assert config_to_dict(config.sharding)["type"] == "highest_rank"
    sharding_plan = plan_by_type(_tables(), TOY, world_size=3)
    path = tmp_path / "plan.json"
    sharding_plan.save(path)
    assert '"sharding": "highest_rank"' in path.read_text()
    loaded = ShardingPlan.load(path)
    assert loaded == sharding_plan
    assert all(tp.sharding is TOY for tp in loaded)
    loaded.validate(_tables())


def test_plan_by_type_puts_toy_tables_on_the_highest_rank() -> None:
    """Bug caught: ``plan_by_type`` dispatching on built-in types instead of calling the
    registered strategy's ``place`` (the toy tables would land on the least-loaded rank)."""
    sharding_plan = plan_by_type(_tables(), [TOY, ShardingType.TABLE_WISE, TOY], world_size=3)
    assert [tp.ranks() for tp in sharding_plan] == [(2,), (0,), (2,)]


def test_the_planner_plans_the_toy_type_only_where_a_table_asks_for_it() -> None:
    """Bugs caught: the planner enumerating a fixed list of types (the toy is never
    tried, or a KeyError in a group or label map), or a registered type that is not
    offered leaking into every table's candidates (changing every plan)."""
    inputs = _inputs({"a": (TOY,)}, world=2)
    by_name = {t.name: t for t in inputs.tables}
    assert {o.sharding for o in candidates(inputs, by_name["a"])} == {TOY}
    assert all(o.sharding is not TOY for o in candidates(inputs, by_name["b"]))
    sharding_plan, report = plan(inputs)
    assert sharding_plan.table("a").sharding is TOY
    assert all(sharding_plan.table(n).sharding is not TOY for n in ("b", "c"))
    assert report.tables[0].label.startswith("HR ")
    # The report of a hand-made plan prices the toy too (predict reads its cost terms).
    by_type = plan_by_type(_tables(), TOY, world_size=2)
    assert [t.label.split()[0] for t in predict(inputs, by_type).tables] == ["HR"] * 3
    assert "block" in GROUPS  # the toy runs in a group that exists


def test_a_table_constrained_to_an_unregistered_type_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bug caught: a constraint naming a type without a strategy failing deep in the
    search with a bare KeyError instead of naming the table and the type."""
    placed = plan_by_type(_tables(), TOY, world_size=2)  # while the toy is registered
    monkeypatch.delitem(STRATEGIES, TOY)
    with pytest.raises(ValueError, match=r"table 'a'.*highest_rank"):
        plan(_inputs({"a": (TOY,)}))
    # plan_by_type and a plan's checks (loading a plan file) say the same
    with pytest.raises(ValueError, match=r"table 'a'.*no sharding strategy.*highest_rank"):
        plan_by_type(_tables(), TOY, world_size=2)
    with pytest.raises(ValueError, match=r"table 'a'.*no sharding strategy.*highest_rank"):
        placed.validate(_tables())


ROWWISE_ADAGRAD = SparseOptimizerSpec(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1, weight_decay=0.01)
ADAM = SparseOptimizerSpec(
    kind=OptimizerKind.ADAM, lr=0.05, beta1=0.8, beta2=0.95, weight_decay=0.01
)


def _cases() -> list[EquivalenceCase]:
    planned = _planned().to_dict()
    out = []
    for opt_name, opt in (("rowwise_adagrad", ROWWISE_ADAGRAD), ("adam", ADAM)):
        out.append(
            EquivalenceCase(
                name=f"plan_by_type/{opt_name}",
                tables=_tables(),
                types=("highest_rank", "table_wise", "highest_rank"),
                optimizer=opt,
                steps=3,
                exact=True,
            )
        )
        out.append(
            EquivalenceCase(
                name=f"planner/{opt_name}",
                tables=_tables(),
                plan=planned,
                optimizer=opt,
                steps=3,
                weighted=True,
                weight_grad=True,
                exact=True,
            )
        )
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_toy_tables_train_on_two_ranks_exactly_as_in_one_process() -> None:
    """Bugs caught: a new type's tables not reaching a group on the ranks (a type that is
    only known in the parent process, or a group chosen by a fixed type list), its ids
    routed to the wrong rank, or its updates lost: 3 steps and an evaluation pass of
    whole tables are pure data movement, so outputs, rows and optimizer state must be
    bitwise those of one process, for the planner's plan and ``plan_by_type``'s."""
    planned = _planned()
    assert [tp.sharding for tp in planned] == [TOY, TOY, ShardingType.TABLE_WISE]
    cases = _cases()
    results = run_ranks(toy_cases_worker, world_size=2, args=(cases,), timeout_s=240)
    bad = []
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        bad.extend(compare(case, per_rank, reference_run(case), rtol=0.0, atol=0.0))
    assert not bad, "\n".join(bad)
