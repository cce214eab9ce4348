"""The search: plans that validate, respect memory, repeat exactly, and explain failure."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tetrarec.planner import (
    AccessStats,
    PlannerError,
    PlannerInputs,
    RankResources,
    TableSpec,
    Tier,
    Topology,
    candidates,
    fit_precisions,
    plan,
    predict,
)
from tetrarec.sharding import ShardingPlan, plan_by_type
from tetrarec.sharding.plan import Shard, TablePlan
from tetrarec.types import Precision, ShardingType


def _topology(nodes: int = 1, local: int = 4, **rank: float) -> Topology:
    resources = {
        "device_memory": 2e6,
        "host_memory": 8e6,
        "ssd": 0.0,
        "device_bandwidth": 1e12,
        "host_bandwidth": 1e10,
        "ssd_bandwidth": 0.0,
        "matmul_flops": 1e12,
    }
    resources.update(rank)
    return Topology(
        name="test",
        nodes=nodes,
        ranks_per_node=local,
        collective_latency_s=1e-5,
        intra_node_bandwidth=1e11,
        inter_node_bandwidth=1e10,
        rank=RankResources(**resources),
    )


def _tables(n: int = 12) -> tuple[TableSpec, ...]:
    sizes = [100, 3000, 20_000, 500, 8000, 60_000, 1000, 12_000, 250, 40_000, 5000, 700]
    return tuple(
        TableSpec(
            name=f"T{i}",
            rows=sizes[i % len(sizes)] * (1 + i // len(sizes)),
            dim=(16, 32, 64)[i % 3],
            features=(f"F{i}",),
            stats=(AccessStats(mean_pooling=1.0 + i % 5, hot_1pct=0.2, hot_5pct=0.4),),
        )
        for i in range(n)
    )


def _inputs(**kw: object) -> PlannerInputs:
    values: dict[str, object] = {"tables": _tables(), "batch_size": 256, "topology": _topology()}
    values.update(kw)
    return PlannerInputs(**values)  # type: ignore[arg-type]


def test_every_table_is_placed_once_and_the_plan_validates() -> None:
    """Catches a table dropped, placed twice, or shards that break their type's rules."""
    inputs = _inputs(topology=_topology(nodes=2, local=4))
    sharding_plan, report = plan(inputs)
    assert [t.table for t in sharding_plan.tables] == [t.name for t in inputs.tables]
    sharding_plan.validate(inputs.table_configs())
    assert [t.table for t in report.tables] == [t.name for t in inputs.tables]
    assert all(t.reason for t in report.tables)


def test_memory_limits_hold_on_every_rank_and_tier() -> None:
    """Catches a search that overfills a tier (tight device memory forces host rows)."""
    inputs = _inputs(topology=_topology(device_memory=1.5e6, host_memory=9e6))
    _, report = plan(inputs)
    tiers = {t.tier for t in report.tables}
    assert any("host" in t for t in tiers), tiers  # the device alone cannot hold them
    for r in report.ranks:
        for tier, used in r.memory.items():
            assert used <= r.capacity[tier], (r.rank, tier, used)


def test_the_same_inputs_give_the_same_plan() -> None:
    """Catches set or dict order, or hash randomness, deciding a placement."""
    a_plan, a_report = plan(_inputs(topology=_topology(nodes=2, local=2)))
    b_plan, b_report = plan(_inputs(topology=_topology(nodes=2, local=2)))
    assert a_plan.to_json() == b_plan.to_json()
    assert json.dumps(replace(a_report, plan_seconds=0).to_dict()) == json.dumps(
        replace(b_report, plan_seconds=0).to_dict()
    )


def test_an_infeasible_model_names_table_tier_and_shortfall() -> None:
    """Catches a failure that hides which table did not fit, where, and by how much."""
    huge = TableSpec(name="huge", rows=10_000_000, dim=64, features=("h",))
    with pytest.raises(PlannerError) as info:
        plan(_inputs(tables=(*_tables(4), huge)))
    err = info.value
    assert [s.table for s in err.shortfalls] == ["huge"]
    assert err.shortfalls[0].shortfall > 0
    assert err.shortfalls[0].tier in (Tier.DEVICE, Tier.HOST)
    message = str(err)
    assert "'huge'" in message
    assert "bytes short" in message
    assert "more ranks" in message
    assert "lower row precision" in message
    assert "SSD" in message


def test_the_infeasible_hint_agrees_with_its_own_figures() -> None:
    """Bugs caught: "more ranks ... need at least 2 ranks; this world has 2" (the ranks
    counted against every tier of a rank summed, though a shard lives in one), and a
    table "needing" fewer bytes than it is short, when what misses room is the lookups'
    buffers (they grow with the batch), not the table."""
    # 3.78 MB of rows and state on 2 ranks of 1 MB device + 1 MB host: 4 MB in all, but
    # no tier of a rank holds a half of the table
    big = (TableSpec(name="B", rows=105_000, dim=8, features=("b",)),)
    topology = _topology(local=2, device_memory=1e6, host_memory=1e6)
    with pytest.raises(PlannerError) as info:
        plan(_inputs(tables=big, topology=topology, batch_size=8))
    message = str(info.value)
    assert "more ranks (the tables' weights and state, 3.78 MB, need at least 4 ranks" in message
    assert "this world has 2)" in message
    # buffers: tiny tables, a fast tier too small for a batch of 4096 ids' buffers
    small = (TableSpec(name="S", rows=10, dim=8, features=("s",)),)
    with pytest.raises(PlannerError) as info:
        plan(_inputs(tables=small, topology=_topology(local=2, device_memory=1e3, host_memory=1e3)))
    err = info.value
    assert err.shortfalls[0].buffers
    assert "a rank's device memory is" in str(err)
    assert "bytes short of the lookups' buffers" in str(err)
    assert "a smaller data.batch_size (256 now" in str(err)
    assert "more ranks" not in str(err)  # the tables are 10 rows: ranks would not help


def test_a_table_too_big_for_one_rank_is_split_and_says_why() -> None:
    """Catches a reason that does not explain a split, or a split that was not needed."""
    big = TableSpec(name="big", rows=40_000, dim=64, features=("b",))  # 10 MB + state
    inputs = _inputs(
        tables=(big, *_tables(3)), topology=_topology(device_memory=4e6, host_memory=4e6)
    )
    sharding_plan, report = plan(inputs)
    chosen = sharding_plan.table("big")
    assert chosen.sharding in (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
    reason = report.tables[0].reason
    assert "does not fit one rank's free device memory" in reason, reason


def test_lower_precision_only_where_it_is_needed() -> None:
    """Catches a planner that lowers every table's precision, or none when it must."""
    allowed = (Precision.FP32, Precision.FP16, Precision.INT8)
    tables = tuple(replace(t, precisions=allowed) for t in _tables())
    _, roomy = plan(_inputs(tables=tables, topology=_topology(device_memory=1e9, host_memory=0)))
    assert {t.precision for t in roomy.tables} == {"fp32"}
    tight = _topology(device_memory=5e6, host_memory=0)  # fp32 needs 27.6 MB
    _, report = plan(_inputs(tables=tables, topology=tight))
    assert {t.precision for t in report.tables} - {"fp32"}, "nothing was lowered"
    for r in report.ranks:
        assert r.memory["device"] <= r.capacity["device"]


def test_report_sums_match_the_plan() -> None:
    """Catches a report whose per-rank bytes are not those of the plan's shards."""
    inputs = _inputs(topology=_topology(nodes=2, local=2))
    sharding_plan, report = plan(inputs)
    by_name = {t.name: t for t in inputs.tables}
    chosen = {t.table: Precision.parse(t.precision) for t in report.tables}
    weights = [0] * inputs.topology.world_size
    state = [0] * inputs.topology.world_size
    for tp in sharding_plan:
        t = by_name[tp.table]
        for s in tp.shards:
            weights[s.rank] += s.num_rows * t.row_bytes(chosen[tp.table], s.dim)
            state[s.rank] += s.num_rows * t.state_bytes(s.dim)
    assert [r.weights for r in report.ranks] == weights
    assert [r.state for r in report.ranks] == state
    for r in report.ranks:
        assert sum(r.memory.values()) == pytest.approx(r.weights + r.state + r.cache + r.buffers)
    assert report.step_s == max(r.step_s for r in report.ranks)
    mean = sum(r.step_s for r in report.ranks) / len(report.ranks)
    assert report.imbalance == pytest.approx(report.step_s / mean)
    assert report.total_params == sum(t.rows * t.dim for t in inputs.tables)


def test_precisions_are_lowered_largest_first_only_to_keep_rows_off_the_ssd() -> None:
    """Catches lowering when everything fits above the SSD, or lowering small tables
    while the large ones stay at full precision."""
    allowed = (Precision.FP32, Precision.FP16, Precision.INT8)
    tables = tuple(replace(t, precisions=allowed) for t in _tables())
    roomy = _inputs(tables=tables, topology=_topology(ssd=1e9, ssd_bandwidth=1e8))
    assert fit_precisions(roomy) == roomy
    # 27.6 MB at FP32; 4 x 5 MB above the SSD, of which 80% may be filled
    tight = _inputs(
        tables=tables,
        topology=_topology(device_memory=1e6, host_memory=4e6, ssd=1e9, ssd_bandwidth=1e8),
    )
    narrowed = {t.name: t.precisions[0] for t in fit_precisions(tight).tables}
    assert narrowed["T5"] is not Precision.FP32  # the largest
    assert narrowed["T0"] is Precision.FP32  # the smallest
    sharding_plan, report = plan(tight)
    for r in report.ranks:
        assert all(r.memory[t] <= r.capacity[t] for t in r.memory)
    # the plan carries each table's tier and precision (what the runtime reads)
    fp32_only = replace(tight, tables=_tables())  # no lower precision: some rows on SSD
    for inputs in (tight, fp32_only):
        sharding_plan, report = plan(inputs)
        for t in report.tables:
            where = sharding_plan.table(t.table).placement
            assert where is not None
            assert where.precision.value == t.precision
            tier = t.tier.split("+")[0]
            want = "ssd" if tier == "ssd" else ("cached" if "+" in t.tier else tier)
            assert where.placement.value == want, (t.tier, where)
        again = predict(inputs, sharding_plan)  # priced where the placements put the rows
        assert [r.step_s for r in again.ranks] == pytest.approx([r.step_s for r in report.ranks])
    assert any(t.tier.startswith("ssd") for t in report.tables)


def test_candidates_follow_the_world_and_the_tiers() -> None:
    """Catches node-local types offered on one node, DP offered for big tables, CW
    blocks that do not divide the dim, tiers the topology does not have, or a DP
    replica offered outside the fast tier without a cache there (or never cached)."""
    small = TableSpec(name="s", rows=100, dim=64, features=("s",))
    big = TableSpec(name="b", rows=10_000_000, dim=48, features=("b",))
    one_node = _inputs(topology=_topology(nodes=1, local=4))
    two_nodes = _inputs(topology=_topology(nodes=2, local=4))
    kinds = {o.sharding for o in candidates(one_node, small)}
    assert ShardingType.TABLE_ROW_WISE not in kinds
    assert ShardingType.DATA_PARALLEL in kinds
    dp = {(o.tier, o.cache_tier) for o in candidates(one_node, small)
          if o.sharding is ShardingType.DATA_PARALLEL}  # fmt: skip
    assert dp == {(Tier.DEVICE, None), (Tier.HOST, Tier.DEVICE)}
    kinds2 = {o.sharding for o in candidates(two_nodes, small)}
    assert {ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE} <= kinds2
    big_opts = candidates(two_nodes, big)
    assert ShardingType.DATA_PARALLEL not in {o.sharding for o in big_opts}
    assert all(48 % o.blocks == 0 for o in big_opts if o.sharding is ShardingType.COLUMN_WISE)
    assert {o.tier for o in big_opts} == {Tier.DEVICE, Tier.HOST}  # no SSD in this topology
    cached = [o for o in big_opts if o.cache_tier is not None]
    assert cached
    assert all((o.tier, o.cache_tier) == (Tier.HOST, Tier.DEVICE) for o in cached)


def test_predict_prices_any_plan_as_the_planner_prices_its_own() -> None:
    """Catches ``predict`` pricing a plan differently from the search (a wrong block
    count, tier or precision), and a hand plan that piles every table on one rank
    predicted as balanced."""
    topo = _topology(device_memory=0.0, host_memory=1e9)  # one tier: predict's fast tier
    inputs = _inputs(topology=topo)
    sharding_plan, report = plan(inputs)
    again = predict(inputs, sharding_plan)
    assert [r.step_s for r in again.ranks] == pytest.approx([r.step_s for r in report.ranks])
    assert [r.memory for r in again.ranks] == [r.memory for r in report.ranks]
    tables = inputs.table_configs()
    one = ShardingPlan(
        world_size=4,
        local_world_size=4,
        tables=tuple(
            TablePlan(
                table=t.name,
                sharding=ShardingType.TABLE_WISE,
                shards=(Shard(rank=0, rows=(0, t.num_embeddings), cols=(0, t.dim)),),
            )
            for t in tables
        ),
    )
    piled = predict(inputs, one)
    assert piled.ranks[0].lookup_s > 0
    assert all(r.lookup_s == 0 for r in piled.ranks[1:])
    assert piled.step_s > report.step_s
    with pytest.raises(ValueError, match="plan is for 2 ranks"):
        predict(inputs, plan_by_type(tables, ShardingType.TABLE_WISE, world_size=2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_single_move_or_swap_of_table_wise_tables_lowers_the_step(seed: int) -> None:
    """Catches a local improvement that stops early: after the search, neither moving one
    table-wise table off the slowest rank nor swapping it with a table of another rank
    may lower the predicted step (all ranks are swap partners at W = 4)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tables = tuple(
        TableSpec(
            name=f"T{i}",
            rows=int(rng.integers(1_000, 50_000)),
            dim=32,
            features=(f"F{i}",),
            stats=(AccessStats(mean_pooling=float(rng.integers(1, 20))),),
        )
        for i in range(14)
    )
    topo = _topology(device_memory=0.0, host_memory=1e9)
    inputs = _inputs(tables=tables, topology=topo)
    sharding_plan, report = plan(inputs)
    best = report.step_s
    worst = max(report.ranks, key=lambda r: r.step_s).rank
    tw = [tp for tp in sharding_plan if tp.sharding is ShardingType.TABLE_WISE]

    def moved(changes: dict[str, int]) -> float:
        tabs = tuple(
            replace(tp, shards=(replace(tp.shards[0], rank=changes[tp.table]),))
            if tp.table in changes
            else tp
            for tp in sharding_plan
        )
        return predict(inputs, replace(sharding_plan, tables=tabs)).step_s

    for a in (tp for tp in tw if tp.shards[0].rank == worst):
        for r in range(4):
            if r != worst:
                assert moved({a.table: r}) >= best - 1e-12, ("move", a.table, r)
        for b in (tp for tp in tw if tp.shards[0].rank != worst):
            swap = {a.table: b.shards[0].rank, b.table: worst}
            assert moved(swap) >= best - 1e-12, ("swap", a.table, b.table)


def test_a_placement_the_config_fixes_is_planned_so() -> None:
    """``model.placement = "ssd"`` / ``"cached"`` tables: the planner chooses only their
    sharding, and the report counts their rows where the run will keep them. The bug:
    the planner placed them in the fast tier, so its memory and time described a plan
    that never ran (the run moved them to the SSD afterwards)."""
    from tetrarec.config import RunConfig
    from tetrarec.planner import inputs_from_config
    from tetrarec.types import Placement

    config = RunConfig().with_overrides(
        [
            "model.num_sparse=4",
            "model.num_embeddings=[1000, 300, 50, 7]",
            "model.placement=[ssd, host, cached, host]",
            "model.precision=int8",
            "model.cache.fraction=0.05",
        ]
    )
    topology = _topology(local=2, device_memory=1e9, host_memory=1e9, ssd=1e9, ssd_bandwidth=1e9)
    inputs = inputs_from_config(config, topology)
    fixed = {t.name: t.placement for t in inputs.tables}
    assert fixed["C1"].placement is Placement.SSD
    assert fixed["C3"].placement is Placement.CACHED
    assert fixed["C2"] is None
    for table in inputs.tables:
        options = candidates(inputs, table)
        if table.placement is not None:
            assert {o.placement() for o in options} == {options[0].placement()}
    sharding_plan, report = plan(inputs)
    placed = {tp.table: tp.placement for tp in sharding_plan.tables}
    assert placed["C1"] == fixed["C1"]
    assert placed["C3"].placement is Placement.CACHED
    assert placed["C3"].cache_fraction == 0.05
    assert "as model.placement says" in next(t.reason for t in report.tables if t.table == "C1")
    assert sum(r.memory["ssd"] for r in report.ranks) > 0


@pytest.mark.parametrize("size", ["model.cache.fraction=0.1", "model.cache.bytes=4000"])
def test_a_cached_table_on_a_machine_without_a_device_is_planned_cached(size: str) -> None:
    """On a CPU topology (host and SSD tiers) a ``cached`` table was planned as ``host``
    with no cache: the report, its memory and the plan file (``placement: host``,
    fraction 0) described another run than the one that then cached the table. With a
    byte budget the fraction was 0 everywhere. Now the plan says ``cached`` at the
    config's size, the cache counted in host memory."""
    from tetrarec.config import RunConfig
    from tetrarec.planner import inputs_from_config
    from tetrarec.types import Placement

    config = RunConfig().with_overrides(
        ["model.num_sparse=2", "model.num_embeddings=[1000, 50]",
         "model.placement=[cached, host]", "model.precision=int8", size]
    )  # fmt: skip
    topology = _topology(local=2, device_memory=0.0, host_memory=1e9, ssd=1e9, ssd_bandwidth=1e9)
    assert Tier.DEVICE not in topology.tiers
    inputs = inputs_from_config(config, topology)
    sharding_plan, report = plan(inputs)
    placed = {tp.table: tp.placement for tp in sharding_plan.tables}
    assert placed["C1"].placement is Placement.CACHED
    # bytes: 4000 B of 260 B slots (FP32 row of dim 64 + its row-wise sum) -> 15 slots
    assert placed["C1"].cache_fraction == (0.1 if "fraction" in size else 15.5 / 1000)
    c1 = next(t for t in report.tables if t.table == "C1")
    assert "host+host cache" in c1.reason
    assert sum(r.cache for r in report.ranks) > 0


@pytest.mark.parametrize(
    ("precision", "suggested"),
    [("fp32", "'fp16' or 'int8' or 'int4'"), ("int8", "'int4'"), ("int4", None)],
)
def test_the_infeasible_hint_suggests_only_precisions_below_the_current(
    precision: str, suggested: str | None
) -> None:
    """An INT8 model that did not fit was told to try "a lower row precision (allowed
    now: int8; e.g. model.precision = 'fp16' or 'int8')": neither is lower."""
    huge = TableSpec(
        name="huge", rows=10_000_000, dim=64, features=("h",), precision=Precision(precision)
    )
    with pytest.raises(PlannerError) as info:
        plan(_inputs(tables=(huge,)))
    message = str(info.value)
    if suggested is None:
        assert "lower row precision" not in message
    else:
        assert f"e.g. model.precision = {suggested})" in message
