"""The sharding groups' routing: timed points and the fit of the cost model's rates.

Part of ``bench_calibrate``: ``route_seconds_per_point`` times, on every rank at once, a
sharded lookup's training step per sharding group (``ROUTE_GROUPS``) at a few
(pooling, dim) points (``ROUTE_POINTS``) on tables small enough to stay in the CPU's
caches, so what grows with ids and pooled values is the group's host-side routing;
``fit_routing`` turns those steps into the topology's ``rank.<group>_route_s_per_id``,
``_per_value`` and ``_per_step`` (``tetrarec.planner.cost.route_seconds``).

The ``split`` group (the row-wise state shares of column-split tables) is timed apart:
its cost grows with the distinct rows a step touches (the shares kernel's per-row
sums, the exchanged shares, the state adds), which a cached tiny table hides (31 ns
per id at 256 rows against 77 ns at 64k rows, measured at 2 ranks). Its points run
``SPLIT_ROWS``-row tables, each twice: with row-wise Adagrad and with SGD
(``SPLIT_BASE``, which shares nothing), and the fit takes the difference, so the
tables' own lookup costs, whatever their size, cancel.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import torch

#: The sharding groups whose routing is calibrated, each by one of its types.
ROUTE_GROUPS = (
    ("block", "table_wise"),
    ("row", "row_wise"),
    ("replicated", "data_parallel"),
    # column-wise, one block per rank: on top of the block group's routing (fitted
    # first), the blocks' row-wise optimizer state shares (cost.route_seconds, "split")
    ("split", "column_wise"),
)
#: (pooling, dim) of the routing points: a base, 16x the ids, 8x the pooled values.
ROUTE_POINTS = ((2, 32), (32, 32), (2, 256))
ROUTE_BATCH = 2048  # global batch of the routing points
ROUTE_ROWS = 256  # rows of each routing table: the kernels' rows stay in the CPU's caches
#: Rows of each split point's table: its uniform ids are nearly all distinct rows.
SPLIT_ROWS = 1 << 16
#: The split points' baseline: the same column-wise tables trained with SGD.
SPLIT_BASE = "split-base"


def route_seconds_per_point(ctx: Any, batch: int, iters: int) -> dict[str, float]:
    """Training steps of a sharded lookup per sharding group (``ROUTE_GROUPS``) at each
    ``ROUTE_POINTS`` (pooling, dim): one table of ``ROUTE_ROWS`` rows per rank, whose
    rows stay in the CPU's caches, so what grows with the ids and the pooled values is
    the group's routing around the kernels (``fit_routing``). ``batch`` is global.

    The differences between points are a few milliseconds, so every point's module is
    built first and the points take turns, each step after a barrier, each round
    starting at the next point (as ``bench plans`` times plans): a burst of other work
    falls on all alike. Each point's figure is this rank's median.
    """
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.kernels import FusedEmbeddingBagCollection
    from tetrarec.sharding import ShardingEnv, plan_by_type, shard_collection
    from tetrarec.sparse import SparseFeatures
    from tetrarec.types import OptimizerKind, ShardingType

    w = ctx.world_size
    local = max(1, batch // w)
    gen = torch.Generator().manual_seed(ctx.rank)
    steps = {}
    for group, sharding, rows, kind in _point_kinds():
        spec = SparseOptimizerSpec(kind=OptimizerKind(kind), lr=0.01)
        for pooling, dim in ROUTE_POINTS:
            tables = [TableConfig(name=f"r{r}", num_embeddings=rows, dim=dim) for r in range(w)]
            module = FusedEmbeddingBagCollection(tables, spec, seed=0, device="meta")
            splan = plan_by_type(tables, ShardingType(sharding), world_size=w)
            sharded = shard_collection(module, splan, ShardingEnv(ctx.comm))
            n = w * local * pooling
            feats = SparseFeatures.from_lengths(
                tuple(t.name for t in tables),
                torch.randint(0, rows, (n,), generator=gen),
                torch.full((w * local,), pooling, dtype=torch.long),
            ).with_value_counts()

            def step(sharded: Any = sharded, feats: SparseFeatures = feats) -> None:
                sharded(feats).values.sum().backward()

            steps[route_key(group, pooling, dim)] = step
    keys = list(steps)
    for key in keys:
        for _ in range(2):
            steps[key]()
    times: dict[str, list[float]] = {key: [] for key in keys}
    for i in range(max(iters, 5)):
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            ctx.comm.barrier(label="calib")
            t0 = time.perf_counter()
            steps[key]()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in times.items()}


def _point_kinds() -> list[tuple[str, str, int, str]]:
    """(key group, sharding type, table rows, optimizer) of each series of points: every
    ``ROUTE_GROUPS`` group with row-wise Adagrad, and the split group's SGD baseline."""
    out = []
    for group, sharding in ROUTE_GROUPS:
        rows = SPLIT_ROWS if group == "split" else ROUTE_ROWS
        out.append((group, sharding, rows, "rowwise_adagrad"))
        if group == "split":
            out.append((SPLIT_BASE, sharding, rows, "sgd"))
    return out


def route_key(group: str, pooling: int, dim: int) -> str:
    """The ``rank_rates`` key of a routing point."""
    return f"route {group} p{pooling} d{dim}"


def fit_routing(rates: dict[str, float], topology: Any, batch: int) -> dict[str, float]:
    """The topology's ``<group>_route_s_per_id`` / ``_per_value`` from the routing points.

    Each point's step (``rates``, seconds: the slowest rank's) less what the cost model
    predicts for it on ``topology`` without routing is the routing's (plus a fixed part);
    the slopes over the points that add ids and pooled values are the rates, in the
    units of ``tetrarec.planner.cost.route_seconds`` (clamped at 0); what is left at the
    base point, beyond the block group's, is the group's ``_route_s_per_step``.

    The split group's residual is a difference of differences: its row-wise Adagrad
    points less their SGD baselines (``SPLIT_BASE``), measured, less the same difference
    as the model predicts it without split rates (the optimizers' state bytes). Its
    fixed part is then its own, not beyond the block group's.
    """
    from tetrarec.embedding import TableConfig
    from tetrarec.planner import AccessStats, PlannerInputs, TableSpec, predict
    from tetrarec.planner.cost import Option, route_seconds
    from tetrarec.sharding import plan_by_type
    from tetrarec.types import OptimizerKind, ShardingType

    w = topology.world_size
    out: dict[str, float] = {}
    intercept: dict[str, float] = {}
    for group, sharding in ROUTE_GROUPS:
        kind = ShardingType(sharding)
        # the split points run column-wise tables: their block routing is charged at
        # the block group's rates, fitted first
        fitted = {k: v for k, v in out.items() if k.startswith("block_")}
        with_block = replace(topology, rank=replace(topology.rank, **fitted))
        split = group == "split"
        rows = SPLIT_ROWS if split else ROUTE_ROWS
        residual, units = [], []
        for pooling, dim in ROUTE_POINTS:

            def specs(
                optimizer: OptimizerKind, dim: int = dim, pooling: int = pooling, rows: int = rows
            ) -> Any:
                return tuple(
                    TableSpec(
                        name=f"r{r}",
                        rows=rows,
                        dim=dim,
                        features=(f"r{r}",),
                        optimizer=optimizer,
                        stats=(AccessStats(mean_pooling=pooling),),
                    )
                    for r in range(w)
                )

            tables = specs(OptimizerKind.ROWWISE_ADAGRAD)
            inputs = PlannerInputs(tables=tables, batch_size=batch, topology=with_block)
            configs = [TableConfig(name=t.name, num_embeddings=t.rows, dim=t.dim) for t in tables]
            splan = plan_by_type(configs, kind, world_size=w)
            predicted = predict(inputs, splan).step_s
            measured = rates[route_key(group, pooling, dim)]
            if split:
                base = replace(inputs, tables=specs(OptimizerKind.SGD))
                predicted -= predict(base, splan).step_s
                measured -= rates[route_key(SPLIT_BASE, pooling, dim)]
            residual.append(measured - predicted)
            # the points' ids and values in route_seconds' units: price 1 s per id, then
            # 1 s per value, on a topology with only that rate
            option = Option(
                sharding=kind,
                blocks={"block": 1, "split": len(splan.tables[0].shards)}.get(group, w),
                tier=topology.fast_tier,
                precision=tables[0].precision,
            )
            per = []
            for field in (f"{group}_route_s_per_id", f"{group}_route_s_per_value"):
                one = replace(topology, rank=replace(topology.rank, **{field: 1.0}))
                probe = replace(inputs, topology=one)
                per.append(sum(route_seconds(probe, t, option) for t in tables))
            units.append(per)
        base, more_ids, more_values = range(3)
        d_ids = units[more_ids][0] - units[base][0]
        d_values = units[more_values][1] - units[base][1]
        per_value = (residual[more_values] - residual[base]) / d_values
        # the ids point keeps the values: what is left over is the ids'
        per_id = (residual[more_ids] - residual[base]) / d_ids
        per_id, per_value = max(per_id, 0.0), max(per_value, 0.0)
        out[f"{group}_route_s_per_id"] = per_id
        out[f"{group}_route_s_per_value"] = per_value
        intercept[group] = residual[base] - units[base][0] * per_id - units[base][1] * per_value
    # What is left at the base point is the group's fixed cost per step; the block
    # group's is in collective_latency_s already (_stage_seconds measures it), so the
    # others' is what they cost beyond it.
    for group, _ in ROUTE_GROUPS:
        if group == "block":
            extra = 0.0
        elif group == "split":  # a difference from its own baseline already
            extra = intercept[group]
        else:
            extra = intercept[group] - intercept["block"]
        out[f"{group}_route_s_per_step"] = max(extra, 0.0)
    return out
