"""The cost model: bytes per tier and seconds per step of each rank, as pure functions.

Symbols: ``B`` global batch, ``W`` ranks, ``L`` ranks per node, ``b = B / W`` local
batch, ``P`` ids per sample of a table (its features' mean pooling, summed), ``d`` its
dim, ``c`` the columns of a shard, ``n`` the rows of a shard, ``N`` the table's rows,
``rb(c)`` stored bytes of a row of ``c`` columns at the chosen precision, ``sb(c)`` the
optimizer-state bytes of that row (FP32 values, step counts included), ``I = 8`` bytes
per id, ``E = 4`` bytes per pooled value (FP32).

The formulas never name a sharding type: they read its strategy's cost terms
(``tetrarec.sharding.strategy.CostTerms``: how it splits a table, over which ranks,
whether it is replicated) and its group. Below, TW, RW, CW, DP, TWRW and TWCW say what
the built-in types' terms give.

**Ids a shard looks up per step** (``ids``): whole tables and column blocks (TW, CW,
TWCW) ``B P`` (every id of the table's features), row blocks (RW, TWRW) ``B P n / N``
(their share of the rows). A replica (DP) pools its own samples' ``b P`` ids forward and
applies the global batch's update backward (``B P`` ids: every replica makes the
one-process update).

**Storage of a shard** (in its tier ``t``; a cached placement keeps the hottest
``f`` (1% or 5%, or the config's fraction) of its rows again in the next faster tier,
or in the same host memory on a machine without a device)::

    weights = n rb(c)      state = n sb(c)
    cache = ceil(f n) (4 c + sb(c))                 (FP32 slots and their state)
          + ceil(f n) S + n R                       (host: the slot maps, SlotMap)
    buffers = ids I + 2 out          (fast tier: received ids, outputs and their gradients)

plus, on every rank for every sharded (non-DP) table, the requester's buffers
``b P I + 2 k b c_k E`` (its ids, and the pooled outputs and gradients of its samples from
the ``k`` shards that answer: ``k = 1`` for TW, the blocks for CW, ``W`` for RW, ``L``
for TWRW, each of width ``c_k``).

**Lookup time of a shard**: forward reads each distinct looked-up row once, backward
reads and writes it and its optimizer state (the fused update); every id also costs the
kernel's per-id work (sorting, summing gradients) at ``lookup_ids_per_s``::

    lookup_s = (u_fwd rb(c) + u_bwd (2 rb(c) + 2 sb(c))) spb_tier
             + (ids_fwd + ids_bwd) / lookup_ids_per_s
             + (u_bwd rb(c) spb_tier + ids_bwd / lookup_ids_per_s)
                   (only CW/TWCW blocks with a row-wise optimizer: the blocks'
                    row-gradient shares, computed once more)

``ids_fwd = ids_bwd = ids`` except DP (``b P`` and ``B P``); ``u = distinct(ids)`` rows
(``TableSpec.distinct``: repeats of a hot row within a step hit the CPU's caches, not
memory), a row-wise shard's share of them for RW/TWRW. Without ``lookup_ids_per_s`` the
per-id terms are 0.
    spb_tier = 1 / bw_t                                 (rows in tier t)
             = h / bw_fast + (1 - h) / bw_t             (cached: hit rate h = hot_f)

**Communication**: each rank's inbound and outbound bytes per step, the time being
``max(in, out) x spb_link + latency``, with one direction per link (full duplex)::

    spb_link = ((L - 1) / W) / intra_bw + ((W - L) / W) / inter_bw
    (the 1/W of the traffic a rank sends itself is free; W = 1: spb_link = 0)

A shard's holder receives ``ids I`` (input dist) plus ``out`` (gradients of its outputs,
backward) and sends ``out`` (its pooled outputs, forward), with ``out = B c E`` (TW, CW,
TWCW blocks; RW and TWRW send partial sums of all ``B`` samples: ``B d E``). Every rank,
as a requester, sends ``b P I + k b c_k E`` and receives ``k b c_k E`` per sharded table.
A DP table all-gathers, in backward, every rank's ids and pooled-output gradients
(never a table-sized gradient): each rank sends its ``b (P I + d E)`` bytes to the
``W - 1`` others and receives theirs. Latency: per sharding group in use 4 collectives
(the block group for TW/CW/TWCW, the row group for RW/TWRW: id counts, ids, outputs,
output gradients), one more (the ``split`` group) for the row-wise optimizer state shares
of column-split CW/TWCW tables, 3 for the replicated group (sizes, ids, gradients), and 1 for
the dense gradient.

**Routing** (host-side work of a sharding group beyond the kernels and the link:
bucketizing and regrouping ids, copying and summing pooled values; calibrated per group
as ``rank.<group>_route_s_per_id`` and ``_per_value``): every rank, per table, for its
``b P`` ids and ``b d`` pooled values with ``k`` shards (``option.blocks``)::

    route_s = ids s_id + values s_value      (+ rank.<group>_route_s_per_step once per
                                               step for each group in use)
    block (TW, CW, TWCW): ids = b P k    values = b d        (each id goes to k blocks)
    row (RW, TWRW):       ids = b P      values = b d k      (k partial sums per value)
    replicated (DP):      ids = b P k    values = b d k      (the global batch's ids and
                                                               output gradients, k = W)
    split (CW, TWCW with k > 1 blocks and a row-wise optimizer, on top of block's):
                          ids = b P k    values = b d        (each block's row-gradient
                                                               shares: computed, exchanged,
                                                               added to the row state)

**Dense part** (the same on every rank)::

    dense_s = b flops_per_sample / matmul_flops + 2 (W - 1) / W params E spb_ring
    spb_ring = 1 / inter_bw if nodes > 1 else 1 / intra_bw        (0 when W = 1)

**Step time** of a rank = lookup + communication + dense; the plan's step time is the
slowest rank's.

**Shared cores** (``Topology.cores_shared``: ``R`` ranks of a node on ``C < R`` CPU
cores, one thread each). The rates are measured with every rank busy, each getting
``C / R`` of a core; a rank whose node-mates wait in a collective gets a whole core. The
node's compute (lookup + dense compute, ``c_r`` in busy-rate seconds) is then
processor-shared, and every rank of the node has its compute done at::

    T_node = max(max_r c_r C / R, sum_r c_r / R)

(one rank never runs faster than one core; all of them never faster than ``C``
cores); a rank's step is ``T_node`` + its communication + the dense all-reduce. Its
intra-node bytes (``max(in, out)`` times ``spb_link``'s intra-node part) are memory
copies by the same cores (loopback), so they join ``c_r``: a rank that receives every
table's ids while its node-mates wait copies them on a whole core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tetrarec.planner.inputs import PlannerInputs, TableSpec
from tetrarec.planner.topology import TIER_ORDER, Tier, Topology
from tetrarec.sharding.strategy import STRATEGIES, CostTerms, ShardingStrategy, Split
from tetrarec.types import OptimizerKind, Precision, ShardingType

__all__ = [
    "ID_BYTES",
    "OUT_BYTES",
    "Option",
    "ShardCost",
    "Uniform",
    "dense_seconds",
    "group_seconds",
    "latency_collectives",
    "link_parts",
    "link_seconds_per_byte",
    "option_groups",
    "ring_seconds_per_byte",
    "route_seconds",
    "shard_cost",
    "shared_compute",
    "uniform_cost",
]

ID_BYTES = 8  # int64 ids
OUT_BYTES = 4  # FP32 pooled values and their gradients

#: ``split``: the column blocks of split tables sharing row-wise optimizer state.
COLLECTIVES_PER_GROUP = {"block": 4, "row": 4, "replicated": 3, "split": 1}
#: The groups with calibrated routing rates (``RankResources.route_rates``).
ROUTE_GROUPS = ("block", "row", "replicated", "split")
#: Optimizers whose per-row state the blocks of a column-split table share.
ROWWISE_KINDS = (OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ROWWISE_ADAM)

#: A cache slot holds an FP32 row: 4 bytes per column.
FP32_BYTES = 4
#: ``SlotMap``'s host bytes per slot (its row, int32; LRU's last use, int64; dirty, bool:
#: LFU's count in place of the last use takes 4 fewer) and per row of the table (its
#: slot or LFU's count, one int32), for every policy.
SLOT_MAP_BYTES_PER_SLOT = 13
SLOT_MAP_BYTES_PER_ROW = 4


@dataclass(frozen=True, kw_only=True)
class Option:
    """One way to store a table.

    Args:
        sharding: the sharding type.
        blocks: shards (TW 1; CW/TWCW column blocks; RW ``W``; TWRW ``L``; DP ``W``).
        tier: where the rows live.
        cache_tier: the faster tier holding the hottest rows again (``None``: no cache).
        cache_fraction: the share of rows cached (0.01 or 0.05; 0 without a cache).
        precision: the row precision.
    """

    sharding: ShardingType
    blocks: int
    tier: Tier
    cache_tier: Tier | None = None
    cache_fraction: float = 0.0
    precision: Precision

    def placement(self) -> str:
        """``"host"``, or ``"ssd+host cache 5%"``."""
        if self.cache_tier is None:
            return self.tier.value
        return f"{self.tier.value}+{self.cache_tier.value} cache {self.cache_fraction:.0%}"

    @property
    def strategy(self) -> ShardingStrategy:
        """The registered strategy of the sharding type."""
        return STRATEGIES[self.sharding]

    @property
    def terms(self) -> CostTerms:
        """The sharding type's cost terms."""
        return STRATEGIES[self.sharding].cost

    def label(self) -> str:
        """``"CW/4 host fp16"`` (column-split types show their block count)."""
        terms = self.terms
        kind = terms.label
        if terms.split is Split.COLUMNS:
            kind += f"/{self.blocks}"
        return f"{kind} {self.placement()} {self.precision.value}"


@dataclass(frozen=True, kw_only=True)
class ShardCost:
    """What one shard adds to the rank holding it.

    Args:
        lookup_s: lookup forward + backward seconds.
        bytes_in: inbound bytes per step.
        bytes_out: outbound bytes per step.
        memory: bytes per tier (``TIER_ORDER`` order): weights, state, cache, buffers.
        weights: stored row bytes.
        state: optimizer-state bytes.
        cache: cache bytes: FP32 slot rows and their state (in ``cache_tier``) plus
            the slot maps (host memory).
        buffers: communication buffers (in the fast tier).
        fast_rows: weights, state and cache bytes that sit in the fast tier.
    """

    lookup_s: float
    bytes_in: float
    bytes_out: float
    memory: tuple[float, float, float]
    weights: float
    state: float
    cache: float
    buffers: float
    fast_rows: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Uniform:
    """What a table's option adds to every rank (requester side, DP all-reduce).

    Args:
        bytes_in: inbound bytes per step per rank (all-to-all).
        bytes_out: outbound bytes per step per rank (all-to-all).
        buffers: fast-tier buffer bytes per rank.
        seconds: the table's host-side routing seconds per rank (``route_seconds``).
    """

    bytes_in: float
    bytes_out: float
    buffers: float
    seconds: float = 0.0


def link_seconds_per_byte(topo: Topology) -> float:
    """Seconds per byte of an all-to-all over the world (module docstring)."""
    return sum(link_parts(topo))


def link_parts(topo: Topology) -> tuple[float, float]:
    """``spb_link``'s (intra-node, inter-node) parts (module docstring)."""
    w, local = topo.world_size, topo.ranks_per_node
    intra = inter = 0.0
    if w > 1 and local > 1:
        intra = ((local - 1) / w) / topo.intra_node_bandwidth
    if w > local:
        inter = ((w - local) / w) / topo.inter_node_bandwidth
    return intra, inter


def ring_seconds_per_byte(topo: Topology) -> float:
    """Seconds per byte of a ring all-reduce's slowest link (module docstring)."""
    if topo.world_size == 1:
        return 0.0
    return 1.0 / (topo.inter_node_bandwidth if topo.nodes > 1 else topo.intra_node_bandwidth)


def tier_seconds_per_byte(topo: Topology, option: Option, table: TableSpec) -> float:
    """``spb_tier`` of the module docstring (cache hit rate from the table's skew)."""
    slow = 1.0 / topo.rank.bandwidth(option.tier)
    if option.cache_tier is None:
        return slow
    hit = table.hot(option.cache_fraction)
    return hit / topo.rank.bandwidth(option.cache_tier) + (1.0 - hit) * slow


def shard_ids(inputs: PlannerInputs, table: TableSpec, option: Option, rows: int) -> float:
    """Ids a shard of ``rows`` rows looks up per step (module docstring)."""
    ids = inputs.batch_size * table.pooling
    terms = option.terms
    if terms.split is Split.ROWS:
        return ids * rows / table.rows
    if terms.replicated:
        return ids / inputs.topology.world_size
    return ids


def shard_cost(
    inputs: PlannerInputs, table: TableSpec, option: Option, rows: int, cols: int
) -> ShardCost:
    """What a shard of ``rows`` x ``cols`` of ``table`` stored as ``option`` costs its rank.

    Formulas in the module docstring.
    """
    topo = inputs.topology
    rb = table.row_bytes(option.precision, cols)
    sb = table.state_bytes(cols)
    terms = option.terms
    ids = shard_ids(inputs, table, option, rows)
    ids_bwd = ids
    if terms.replicated:
        ids_bwd = inputs.batch_size * table.pooling  # the global batch's update
    u_fwd = _distinct(table, option, ids, rows)
    u_bwd = _distinct(table, option, ids_bwd, rows)
    moved = u_fwd * rb + u_bwd * (2 * rb + 2 * sb)
    per_id = ids + ids_bwd
    if _shares_row_state(table, option):
        moved += u_bwd * rb  # the row-gradient shares the blocks exchange
        per_id += ids_bwd
    rate = topo.rank.lookup_ids_per_s
    lookup_s = moved * tier_seconds_per_byte(topo, option, table) + (
        per_id / rate if rate > 0 else 0.0
    )
    if terms.replicated:
        out = 0.0
        buffers = 0.0
        ids_in = 0.0
    else:
        width = table.dim if terms.partial_sums else cols
        out = inputs.batch_size * width * OUT_BYTES
        ids_in = ids * ID_BYTES
        buffers = ids_in + 2 * out
    weights = float(rows * rb)
    state = float(rows * sb)
    memory = [0.0, 0.0, 0.0]
    memory[TIER_ORDER.index(option.tier)] += weights + state
    cache = 0.0
    if option.cache_tier is not None:
        slots = math.ceil(option.cache_fraction * rows)
        slot_rows = float(slots * (FP32_BYTES * cols + sb))
        maps = float(slots * SLOT_MAP_BYTES_PER_SLOT + rows * SLOT_MAP_BYTES_PER_ROW)
        memory[TIER_ORDER.index(option.cache_tier)] += slot_rows
        memory[TIER_ORDER.index(Tier.HOST)] += maps
        cache = slot_rows + maps
    fast = TIER_ORDER.index(topo.fast_tier)
    fast_rows = memory[fast]
    memory[fast] += buffers
    return ShardCost(
        lookup_s=lookup_s,
        bytes_in=ids_in + out,
        bytes_out=out,
        memory=(memory[0], memory[1], memory[2]),
        weights=weights,
        state=state,
        cache=cache,
        buffers=buffers,
        fast_rows=fast_rows,
    )


def _distinct(table: TableSpec, option: Option, ids: float, rows: int) -> float:
    """Distinct rows among a shard's ``ids`` (row blocks: its share of the table's)."""
    if option.terms.split is Split.ROWS:
        share = rows / table.rows
        return table.distinct(ids / share) * share if share > 0 else 0.0
    return table.distinct(ids)


def _shares_row_state(table: TableSpec, option: Option) -> bool:
    """Whether several blocks of ``table`` share a row-wise optimizer's per-row state."""
    return option.terms.shares_row_state and option.blocks > 1 and table.optimizer in ROWWISE_KINDS


def uniform_cost(inputs: PlannerInputs, table: TableSpec, option: Option) -> Uniform:
    """What ``table`` stored as ``option`` adds to every rank (module docstring)."""
    topo = inputs.topology
    w = topo.world_size
    local_batch = inputs.batch_size / w
    terms = option.terms
    if terms.replicated:
        mine = local_batch * (table.pooling * ID_BYTES + table.dim * OUT_BYTES)
        # buffers: every rank's ids and gradients, gathered
        return Uniform(
            bytes_in=(w - 1) * mine,
            bytes_out=(w - 1) * mine,
            buffers=w * mine,
            seconds=route_seconds(inputs, table, option),
        )
    if terms.partial_sums:
        answered = option.blocks * local_batch * table.dim * OUT_BYTES
    else:
        answered = local_batch * table.dim * OUT_BYTES  # the blocks' widths sum to d
    ids_out = local_batch * table.pooling * ID_BYTES
    return Uniform(
        bytes_in=answered,
        bytes_out=ids_out + answered,
        buffers=ids_out + 2 * answered,
        seconds=route_seconds(inputs, table, option),
    )


def route_seconds(inputs: PlannerInputs, table: TableSpec, option: Option) -> float:
    """Host-side routing seconds ``table`` stored as ``option`` costs every rank.

    Formula in the module docstring (0 without calibrated routing rates): the rates of
    each group the table takes part in (``option_groups``).
    """
    b = inputs.batch_size / inputs.topology.world_size
    k = option.blocks
    total = 0.0
    for group in sorted(option_groups(table, option)):
        per_id, per_value = inputs.topology.rank.route_rates(group)
        if per_id == 0 and per_value == 0:
            continue
        ids, values = b * table.pooling, b * table.dim
        if group in ("block", "split"):
            ids *= k
        elif group == "row":
            values *= k
        else:
            ids, values = ids * k, values * k
        total += ids * per_id + values * per_value
    return total


def option_groups(table: TableSpec, option: Option) -> frozenset[str]:
    """The collective groups a table stored as ``option`` takes part in (module docstring)."""
    group = option.strategy.group
    if _shares_row_state(table, option):
        return frozenset((group, "split"))
    return frozenset((group,))


def group_seconds(topo: Topology, groups: set[str] | frozenset[str]) -> float:
    """Fixed seconds per step of the sharding groups in use.

    ``collective_latency_s`` per collective (``latency_collectives``) plus each group's
    ``rank.<group>_route_s_per_step``.
    """
    fixed = sum(
        getattr(topo.rank, f"{g}_route_s_per_step", 0.0) for g in groups if g in ROUTE_GROUPS
    )
    return topo.collective_latency_s * latency_collectives(groups) + fixed


def latency_collectives(groups: set[str] | frozenset[str]) -> int:
    """Collective calls per step: ``COLLECTIVES_PER_GROUP`` of each group in use, +1 dense."""
    return sum(COLLECTIVES_PER_GROUP[g] for g in groups) + 1


def dense_seconds(inputs: PlannerInputs) -> tuple[float, float]:
    """(compute seconds, gradient all-reduce seconds) of the dense part, per rank."""
    topo = inputs.topology
    w = topo.world_size
    compute = inputs.batch_size / w * inputs.dense_flops_per_sample / topo.rank.matmul_flops
    allreduce = 2 * (w - 1) / w * inputs.dense_params * OUT_BYTES * ring_seconds_per_byte(topo)
    return compute, allreduce


def shared_compute(topo: Topology, compute: list[float]) -> list[float]:
    """Each rank's compute seconds with its node's cores shared (module docstring).

    ``compute``: per rank, lookup + dense compute at the calibrated (all-busy) rates.
    Without shared cores, ``compute`` unchanged.
    """
    if not topo.cores_shared:
        return list(compute)
    r, c = topo.ranks_per_node, topo.cores_per_node
    out = []
    for node in range(topo.nodes):
        mine = compute[node * r : (node + 1) * r]
        t = max(max(mine) * c / r, sum(mine) / r)
        out.extend([t] * len(mine))
    return out
