"""The candidates of a table, and the shards a candidate cuts it into.

A candidate (``Option``) is a sharding type with a shard count, a memory tier (with or
without a cache in the next faster one) and a row precision. The sharding types and
their shard counts come from the registry (``tetrarec.sharding.strategy.STRATEGIES``):
each strategy says which counts it offers for a table in a world
(``candidate_blocks``) and how it cuts a table (``CostTerms.split``), so nothing here
names a type. With the built-in types: TW; RW when the table has at least ``W`` rows;
CW in 2, 4, 8 or 16 column blocks of at least 16 columns that divide the dim; DP for
tables of at most ``DP_MAX_BYTES``; TWRW and TWCW on several nodes.
"""

from __future__ import annotations

from tetrarec.planner.cost import Option
from tetrarec.planner.inputs import PlannerInputs, TableSpec
from tetrarec.planner.topology import Tier, Topology
from tetrarec.sharding.plan import Shard, TablePlacement
from tetrarec.sharding.strategy import (
    STRATEGIES,
    CandidateContext,
    ShardingStrategy,
    Split,
    split_evenly,
)
from tetrarec.types import Placement, Precision

__all__ = [
    "CACHE_FRACTIONS",
    "candidates",
    "option_of",
    "shard_sizes",
    "shards_on",
    "strategies_for",
    "table_bytes",
    "table_placement",
]

#: The shares of a table's rows a cached candidate keeps in the next faster tier.
CACHE_FRACTIONS = (0.01, 0.05)


def table_bytes(table: TableSpec) -> int:
    """Weights and optimizer state of ``table`` at its configured precision."""
    return table.rows * (table.row_bytes(table.precision) + table.state_bytes())


def table_placement(option: Option) -> TablePlacement:
    """The plan's ``TablePlacement`` of an option.

    Rows in device or host memory; host rows with a cache (in device memory, or in the
    same host memory on a machine without a device) are ``cached``; SSD rows (cached in
    host memory) ``ssd``.
    """
    if option.tier is Tier.SSD:
        kind = Placement.SSD
    elif option.cache_tier is not None:
        kind = Placement.CACHED
    else:
        kind = Placement.DEVICE if option.tier is Tier.DEVICE else Placement.HOST
    return TablePlacement(
        placement=kind, cache_fraction=option.cache_fraction, precision=option.precision
    )


def option_of(
    placement: TablePlacement | None, table: TableSpec, topology: Topology
) -> tuple[Tier, Tier | None, float, Precision]:
    """(tier, cache tier, cache fraction, precision) of a plan's placement.

    The inverse of ``table_placement``; ``None``: the fast tier at the table's precision.
    """
    if placement is None:
        return topology.fast_tier, None, 0.0, table.precision
    tiers = topology.tiers
    kind, f = placement.placement, placement.cache_fraction
    if kind is Placement.SSD:
        above = [t for t in tiers if t is not Tier.SSD]
        cache = above[-1] if above and f > 0 else None
        return Tier.SSD, cache, f if cache else 0.0, placement.precision
    if kind is Placement.CACHED and f > 0:
        # the slots sit in the device's memory, or, without one, in the same host memory
        cache_tier = Tier.DEVICE if Tier.DEVICE in tiers and Tier.HOST in tiers else Tier.HOST
        return Tier.HOST, cache_tier, f, placement.precision
    if kind is Placement.DEVICE:
        return Tier.DEVICE, None, 0.0, placement.precision
    return Tier.HOST, None, 0.0, placement.precision


def strategies_for(table: TableSpec) -> list[ShardingStrategy]:
    """The strategies the planner tries for ``table``, in candidate order.

    Those ``table.shardings`` names, else every registered one its cost terms offer;
    ordered by ``CostTerms.order`` (then by type name).

    Raises:
        ValueError: if ``table.shardings`` names a type no strategy is registered for.
    """
    if table.shardings:
        missing = [t.value for t in table.shardings if t not in STRATEGIES]
        if missing:
            known = ", ".join(t.value for t in STRATEGIES)
            raise ValueError(
                f"table {table.name!r}: no sharding strategy is registered for {missing} "
                f"(registered: {known})"
            )
        chosen = [STRATEGIES[t] for t in dict.fromkeys(table.shardings)]
    else:
        chosen = [s for s in STRATEGIES.values() if s.cost.offered]
    return sorted(chosen, key=lambda s: (s.cost.order, s.sharding_type.value))


def candidates(inputs: PlannerInputs, table: TableSpec) -> list[Option]:
    """The candidates of ``table`` (module docstring), in a fixed order.

    Every shard count each strategy offers (``strategies_for``), in every tier the
    topology has (device, host, SSD) and cached (rows in a tier, the hottest 1% or 5%
    again in the next faster one), at every precision the table allows; replicas only
    in the fast tier, or in the next one with a cache in the fast tier. A table whose
    config fixes its placement gets that tier and precision only.
    """
    topo = inputs.topology
    ctx = CandidateContext(
        rows=table.rows,
        dim=table.dim,
        table_bytes=table_bytes(table),
        world_size=topo.world_size,
        local_world_size=topo.ranks_per_node,
    )
    kinds = [(s, k) for s in strategies_for(table) for k in s.candidate_blocks(ctx)]
    tiers = topo.tiers
    places: list[tuple[Tier, Tier | None, float]] = [(t, None, 0.0) for t in tiers]
    for slow, fast in zip(tiers[1:], tiers[:-1]):
        places += [(slow, fast, f) for f in CACHE_FRACTIONS]
    precisions = table.precisions
    if table.placement is not None:  # the config fixes the tier: only the sharding is free
        tier, cache, fraction, precision = option_of(table.placement, table, topo)
        places, precisions = [(tier, cache, fraction)], (precision,)
    return [
        Option(sharding=s.sharding_type, blocks=k, tier=t, cache_tier=c, cache_fraction=f,
               precision=p)
        for p in precisions
        for s, k in kinds
        for t, c, f in places
        # a replica's rows sit in the fast tier, or in the next one with its hottest
        # rows cached in the fast tier (each replica caches its own copy)
        if not (s.cost.replicated and topo.fast_tier not in (t, c))
    ]  # fmt: skip


def shard_sizes(table: TableSpec, option: Option) -> list[tuple[int, int]]:
    """(rows, cols) of each shard of ``option``."""
    split, k = option.terms.split, option.blocks
    if split is Split.ROWS:
        return [(hi - lo, table.dim) for lo, hi in split_evenly(table.rows, k)]
    if split is Split.COLUMNS:
        return [(table.rows, table.dim // k)] * k
    return [(table.rows, table.dim)] * k


def shards_on(table: TableSpec, option: Option, ranks: tuple[int, ...]) -> tuple[Shard, ...]:
    """The shards of ``table`` stored as ``option`` on ``ranks`` (one shard each).

    Row blocks split the rows evenly in rank order; column blocks of equal width go to
    the ranks in order; whole shards (a table, or a replica each) hold everything.
    """
    split = option.terms.split
    if split is Split.ROWS:
        return tuple(
            Shard(rank=r, rows=rows, cols=(0, table.dim))
            for r, rows in zip(ranks, split_evenly(table.rows, len(ranks)))
        )
    if split is Split.COLUMNS:
        width = table.dim // option.blocks
        return tuple(
            Shard(rank=r, rows=(0, table.rows), cols=(i * width, (i + 1) * width))
            for i, r in enumerate(ranks)
        )
    return tuple(Shard(rank=r, rows=(0, table.rows), cols=(0, table.dim)) for r in ranks)
