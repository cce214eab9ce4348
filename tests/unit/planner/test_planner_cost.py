"""The cost model's formulas on a case computed by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tetrarec.cache.policy import CachePolicy
from tetrarec.cache.slot_map import SlotMap
from tetrarec.models.config import DLRMConfig
from tetrarec.planner import (
    AccessStats,
    PlannerInputs,
    RankResources,
    TableSpec,
    Tier,
    Topology,
    dense_cost,
    load_stats,
    state_bytes_per_row,
)
from tetrarec.planner.cost import (
    Option,
    group_seconds,
    latency_collectives,
    link_seconds_per_byte,
    option_groups,
    route_seconds,
    shard_cost,
    shared_compute,
    uniform_cost,
)
from tetrarec.types import OptimizerKind, Precision, ShardingType

TOPO = Topology(
    name="tiny",
    nodes=1,
    ranks_per_node=2,
    collective_latency_s=1e-5,
    intra_node_bandwidth=1e9,
    inter_node_bandwidth=1e9,
    rank=RankResources(
        host_memory=1e6, host_bandwidth=1e9, ssd=1e7, ssd_bandwidth=1e8, matmul_flops=1e9
    ),
)
TABLE = TableSpec(
    name="t",
    rows=1000,
    dim=4,
    features=("f",),
    stats=(AccessStats(mean_pooling=2.0, hot_1pct=0.3, hot_5pct=0.5),),
)
INPUTS = PlannerInputs(tables=(TABLE,), batch_size=8, topology=TOPO)


def _u(ids: float, rows: int = 1000, h1: float = 0.3, h5: float = 0.5) -> float:
    """Distinct rows by hand: the hottest 1%, the next 4% and the rest, uniform inside."""
    parts = ((0.01 * rows, h1), (0.04 * rows, h5 - h1), (0.95 * rows, 1 - h5))
    return sum(k * (1 - math.exp(-ids * h / k)) for k, h in parts)


def _opt(sharding: ShardingType = ShardingType.TABLE_WISE, **kw: object) -> Option:
    kw.setdefault("blocks", 1)
    return Option(sharding=sharding, tier=Tier.HOST, precision=Precision.FP32, **kw)  # type: ignore[arg-type]


def test_state_bytes_follow_the_kernels_layout() -> None:
    """Catches an optimizer-state size that forgets a moment or the step count."""
    assert state_bytes_per_row(OptimizerKind.ROWWISE_ADAGRAD, 64) == 4
    assert state_bytes_per_row(OptimizerKind.ADAGRAD, 64) == 256
    assert state_bytes_per_row(OptimizerKind.ADAM, 64) == (2 * 64 + 1) * 4
    assert state_bytes_per_row(OptimizerKind.SGD, 64) == 0


def test_table_wise_shard_by_hand() -> None:
    """Catches a wrong term in the lookup, traffic or storage formulas."""
    c = shard_cost(INPUTS, TABLE, _opt(), 1000, 4)
    # ids = B P = 16, of them _u(16) distinct; a row 16 B, its state 4 B
    assert c.lookup_s == pytest.approx(_u(16) * 56 / 1e9)
    assert c.bytes_out == 8 * 4 * 4  # B c E
    assert c.bytes_in == 16 * 8 + 128  # ids + output gradients
    assert (c.weights, c.state, c.buffers) == (16000, 4000, 16 * 8 + 2 * 128)
    assert c.memory == (0.0, 16000 + 4000 + 384, 0.0)
    u = uniform_cost(INPUTS, TABLE, _opt())
    # local batch 4: ids 4*2*8 = 64 out; 4*4*4 = 64 pooled in, its gradients out
    assert (u.bytes_in, u.bytes_out, u.buffers) == (64, 128, 64 + 128)
    assert link_seconds_per_byte(TOPO) == pytest.approx(0.5 / 1e9)


def test_row_wise_and_cached_shards_by_hand() -> None:
    """Catches RW shards charged for every id, or a cache whose hit rate is ignored; and
    a cache counted at the stored row size (it was: 50 x 16 bytes here, while the run
    holds FP32 slots, their optimizer state and the slot maps, 7x more for INT8 rows:
    plans that could not run were accepted)."""
    rw = shard_cost(INPUTS, TABLE, _opt(ShardingType.ROW_WISE), 500, 4)
    assert rw.lookup_s == pytest.approx(_u(16) / 2 * 56 / 1e9)  # half the distinct rows
    assert rw.bytes_out == 8 * 4 * 4  # partial sums of all samples
    cached = Option(
        sharding=ShardingType.TABLE_WISE,
        blocks=1,
        tier=Tier.SSD,
        cache_tier=Tier.HOST,
        cache_fraction=0.05,
        precision=Precision.FP32,
    )
    c = shard_cost(INPUTS, TABLE, cached, 1000, 4)
    assert c.lookup_s == pytest.approx(_u(16) * 56 * (0.5 / 1e9 + 0.5 / 1e8))
    # 50 slots of an FP32 row (16 B) and its row-wise state (4 B); SlotMap: 13 B per
    # slot, 4 B per row of the shard
    slots = 50 * (16 + 4)
    maps = SlotMap(50, 1000, CachePolicy.LRU).metadata_bytes()
    assert maps == 50 * 13 + 1000 * 4
    assert c.cache == slots + maps
    assert c.memory == (0.0, slots + maps + 384, 20000)


def test_dense_cost_by_hand() -> None:
    """Catches a dense FLOP formula that drops a layer or the backward factor."""
    dlrm = DLRMConfig(num_dense=2, bottom_mlp=(3, 4), top_mlp=(5, 1))
    flops, params = dense_cost(dlrm, 1)
    # bottom 2*2*3 + 2*3*4 = 36; dot 2 * 2^2 * 4 = 32; top in 4 + 1: 2*5*5 + 2*5*1 = 60
    assert flops == 3 * (36 + 32 + 60)
    assert params == (2 * 3 + 3 + 3 * 4 + 4) + (5 * 5 + 5 + 5 * 1 + 1)


def test_stats_loader_reads_the_shared_format_and_names_bad_features() -> None:
    """Catches a loader that ignores the statistics or accepts impossible shares."""
    stats = load_stats(
        {
            "rows_sampled": 10,
            "features": {
                "C1": {"table": "C1", "mean_pooling": 3.0, "hot_1pct": 0.4, "hot_5pct": 0.6}
            },
        }
    )
    assert stats["C1"] == AccessStats(mean_pooling=3.0, hot_1pct=0.4, hot_5pct=0.6)
    with pytest.raises(ValueError, match="C2"):
        load_stats({"features": {"C2": {"hot_1pct": 0.9, "hot_5pct": 0.1}}})


def test_data_parallel_prices_the_global_update_and_the_gathers() -> None:
    """Catches a DP table priced as a table-sized all-reduce (what the runtime never
    sends) or as updating only the rank's own ids (every replica applies the global
    batch's update)."""
    dp = Option(sharding=ShardingType.DATA_PARALLEL, blocks=2, tier=Tier.HOST,
                precision=Precision.FP32)  # fmt: skip
    c = shard_cost(INPUTS, TABLE, dp, 1000, 4)
    # forward: b P = 8 ids read (16 B); backward: B P = 16 ids read + written (2*16 + 2*4)
    assert c.lookup_s == pytest.approx((_u(8) * 16 + _u(16) * 40) / 1e9)
    assert (c.bytes_in, c.bytes_out) == (0.0, 0.0)
    u = uniform_cost(INPUTS, TABLE, dp)
    # each rank gathers the other's b (P I + d E) = 4 (2*8 + 4*4) = 128 bytes
    assert (u.bytes_in, u.bytes_out, u.seconds) == (128.0, 128.0, 0.0)
    assert u.buffers == 2 * 128


def test_column_blocks_of_a_rowwise_optimizer_pay_the_state_exchange() -> None:
    """Catches a column-wise table whose row-wise optimizer state exchange is left out
    of the lookup time or of the collectives counted for latency."""
    cw = Option(sharding=ShardingType.COLUMN_WISE, blocks=2, tier=Tier.HOST,
                precision=Precision.FP32)  # fmt: skip
    c = shard_cost(INPUTS, TABLE, cw, 1000, 2)
    # ids B P = 16; a 2-column block row 8 B, its state 4 B: (3*8 + 2*4 + 8) per row
    assert c.lookup_s == pytest.approx(_u(16) * 40 / 1e9)
    assert option_groups(TABLE, cw) == {"block", "split"}
    assert latency_collectives(option_groups(TABLE, cw)) == 4 + 1 + 1
    sgd = TableSpec(name="s", rows=10, dim=4, features=("s",), optimizer=OptimizerKind.SGD)
    assert option_groups(sgd, cw) == {"block"}


def test_distinct_rows_follow_the_skew() -> None:
    """Catches repeated ids priced as distinct rows (a pooled, skewed table over-priced
    several times) and a count above the ids or the rows."""
    uniform = TableSpec(name="u", rows=10**6, dim=4, features=("u",))  # default stats
    assert uniform.distinct(1000) == pytest.approx(1000, rel=1e-3)
    assert uniform.distinct(10**8) == pytest.approx(10**6, rel=1e-3)
    assert TABLE.distinct(16) == pytest.approx(_u(16))
    skew = AccessStats(mean_pooling=1.0, hot_1pct=0.9, hot_5pct=0.95)
    hot = TableSpec(name="h", rows=10**6, dim=4, features=("h",), stats=(skew,))
    assert hot.distinct(10**5) < 0.5 * uniform.distinct(10**5)
    assert TABLE.distinct(0) == 0.0


def test_per_id_work_is_charged_at_the_ranks_rate() -> None:
    """Catches ``lookup_ids_per_s`` ignored or charged once instead of per pass."""
    fast = replace(TOPO, rank=replace(TOPO.rank, lookup_ids_per_s=1e6))
    inputs = replace(INPUTS, topology=fast)
    base = shard_cost(INPUTS, TABLE, _opt(), 1000, 4).lookup_s
    # forward and backward each handle the B P = 16 ids
    assert shard_cost(inputs, TABLE, _opt(), 1000, 4).lookup_s == pytest.approx(base + 32 / 1e6)


def test_ranks_sharing_cores_share_the_nodes_compute() -> None:
    """Catches an oversubscribed node priced as if each rank had its own core: a rank
    whose node-mates wait gets a whole core (4 ranks on 2 cores: twice its busy rate),
    and the node never computes faster than its cores."""
    shared = replace(TOPO, ranks_per_node=4, cores_per_node=2)
    assert shared.cores_shared
    assert not TOPO.cores_shared
    assert not replace(TOPO, cores_per_node=2).cores_shared  # 2 ranks on 2 cores
    # balanced: every rank busy, as calibrated
    assert shared_compute(shared, [1.0, 1.0, 1.0, 1.0]) == [1.0] * 4
    # piled on rank 0: it runs alone on a core (4 * 2 / 4 = 2), the node is done then
    assert shared_compute(shared, [4.0, 0.0, 0.0, 0.0]) == [2.0] * 4
    # the cores bound: sum / R
    assert shared_compute(shared, [3.0, 3.0, 3.0, 1.0]) == [2.5] * 4
    two_nodes = replace(shared, nodes=2)
    got = shared_compute(two_nodes, [4.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert got == [2.0] * 4 + [1.0] * 4
    assert shared_compute(TOPO, [3.0, 1.0]) == [3.0, 1.0]


def test_routing_is_charged_per_group_in_its_units() -> None:
    """Catches a group's routing rates applied to another group, the units swapped (ids
    for values), the shards (``k``) ignored where each id or value is handled ``k``
    times, or the routing left out of what every rank pays."""
    rates = {
        "block_route_s_per_id": 1.0,
        "block_route_s_per_value": 10.0,
        "row_route_s_per_id": 100.0,
        "row_route_s_per_value": 1000.0,
        "replicated_route_s_per_id": 1e4,
        "replicated_route_s_per_value": 1e5,
    }
    topo = replace(TOPO, rank=replace(TOPO.rank, **rates))
    inputs = replace(INPUTS, topology=topo)
    b, p, d = 4, 2, 4  # local batch 8 / 2, pooling 2, dim 4
    tw = route_seconds(inputs, TABLE, _opt())
    assert tw == pytest.approx(b * p * 1.0 + b * d * 10.0)
    cw = route_seconds(inputs, TABLE, _opt(ShardingType.COLUMN_WISE, blocks=2))
    assert cw == pytest.approx(2 * b * p * 1.0 + b * d * 10.0)  # each id to 2 blocks
    rw = route_seconds(inputs, TABLE, _opt(ShardingType.ROW_WISE, blocks=2))
    assert rw == pytest.approx(b * p * 100.0 + 2 * b * d * 1000.0)  # 2 partial sums
    dp = route_seconds(inputs, TABLE, _opt(ShardingType.DATA_PARALLEL, blocks=2))
    assert dp == pytest.approx(2 * b * p * 1e4 + 2 * b * d * 1e5)  # the global batch
    assert route_seconds(INPUTS, TABLE, _opt()) == 0.0  # not calibrated: not charged
    assert uniform_cost(inputs, TABLE, _opt(ShardingType.ROW_WISE, blocks=2)).seconds == rw
    assert topo.rank.route_rates("row") == (100.0, 1000.0)


def test_column_split_tables_pay_the_split_groups_routing_on_top() -> None:
    """Catches the split group's rates (the row-gradient shares of column blocks under a
    row-wise optimizer) left out, charged per block instead of per id sent to a block,
    charged to a table with a single block, or to an optimizer without row-wise state."""
    rates = {"block_route_s_per_id": 1.0, "split_route_s_per_id": 50.0,
             "split_route_s_per_value": 7.0}  # fmt: skip
    topo = replace(TOPO, rank=replace(TOPO.rank, **rates))
    inputs = replace(INPUTS, topology=topo)
    b, p, d = 4, 2, 4
    cw = route_seconds(inputs, TABLE, _opt(ShardingType.COLUMN_WISE, blocks=2))
    assert cw == pytest.approx(2 * b * p * 1.0 + 2 * b * p * 50.0 + b * d * 7.0)
    one = route_seconds(inputs, TABLE, _opt(ShardingType.COLUMN_WISE, blocks=1))
    assert one == pytest.approx(b * p * 1.0)
    sgd = replace(TABLE, optimizer=OptimizerKind.SGD)
    assert route_seconds(inputs, sgd, _opt(ShardingType.COLUMN_WISE, blocks=2)) == pytest.approx(
        2 * b * p * 1.0
    )
    fixed = replace(topo, rank=replace(topo.rank, split_route_s_per_step=0.25))
    assert group_seconds(fixed, {"block", "split"}) - group_seconds(fixed, {"block"}) == (
        pytest.approx(fixed.collective_latency_s + 0.25)
    )


def test_loopback_copies_share_the_cores_with_compute() -> None:
    """Catches the intra-node bytes of a rank whose node-mates wait priced at the busy
    rate where ranks share cores (4 ranks on 2 cores: the rank that receives every
    table's ids copies them on a whole core), or shared where each rank has its own."""
    from tetrarec.embedding import TableConfig
    from tetrarec.planner import predict
    from tetrarec.sharding import Shard, ShardingPlan, TablePlan

    fast = replace(TOPO.rank, host_bandwidth=1e18, matmul_flops=1e18, host_memory=1e9)
    shared = replace(TOPO, ranks_per_node=4, cores_per_node=2, collective_latency_s=0.0, rank=fast)
    names = [f"t{i}" for i in range(4)]
    specs = tuple(
        TableSpec(name=n, rows=1000, dim=4, features=(n,), stats=(AccessStats(mean_pooling=2.0),))
        for n in names
    )
    inputs = PlannerInputs(tables=specs, batch_size=64, topology=shared)
    one_rank = ShardingPlan(
        world_size=4,
        local_world_size=4,
        tables=tuple(
            TablePlan(table=n, sharding=ShardingType.TABLE_WISE,
                      shards=(Shard(rank=0, rows=(0, 1000), cols=(0, 4)),))
            for n in names
        ),
    )  # fmt: skip
    one_rank.validate([TableConfig(name=n, num_embeddings=1000, dim=4) for n in names])
    got = predict(inputs, one_rank)
    intra = (3 / 4) / shared.intra_node_bandwidth
    # rank 0 receives every rank's ids (16 ids x 8 B per table) and its own outputs'
    # gradients; the others send theirs: per-rank bytes as the cost model counts them
    alone = replace(inputs, topology=replace(shared, cores_per_node=0))
    moved = [r.comm_s / intra for r in predict(alone, one_rank).ranks]
    want = max(max(moved) * intra * 2 / 4, sum(moved) * intra / 4)
    assert got.step_s == pytest.approx(want, rel=1e-6)
    assert got.step_s < predict(alone, one_rank).step_s  # shared: cheaper than busy rate


def test_groups_in_use_pay_their_fixed_cost_once_per_step() -> None:
    """Catches a group's per-step cost charged per table, for groups not in use, or the
    collectives' latency dropped beside it."""
    topo = replace(TOPO, rank=replace(TOPO.rank, row_route_s_per_step=0.5))
    lat = TOPO.collective_latency_s
    assert group_seconds(topo, {"block"}) == pytest.approx(5 * lat)  # 4 + the dense one
    assert group_seconds(topo, {"block", "row"}) == pytest.approx(9 * lat + 0.5)
    assert group_seconds(topo, {"row", "split"}) == pytest.approx(6 * lat + 0.5)
    assert group_seconds(TOPO, {"row"}) == pytest.approx(5 * lat)
