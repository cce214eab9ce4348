"""The search: candidates per table, greedy placement, local improvement.

1. **Candidates** (``candidates``): per table, every sharding type the world allows
   (TW; RW when the table has at least ``W`` rows; CW in 2, 4, 8 or 16 column blocks of
   at least 16 columns that divide the dim; DP for tables of at most ``DP_MAX_BYTES``;
   TWRW and TWCW on several nodes), in every tier the topology has (device, host, SSD)
   and cached (rows in a tier, the hottest 1% or 5% again in the next faster one), at
   every precision the table allows; DP replicas only in the fast tier, or in the next
   one with a cache in the fast tier.
2. **Greedy placement**: tables largest first (weights + state at their preferred
   precision; ties by name). For each candidate, the ranks it would go to are those
   that keep the step fastest (TW and CW blocks: the ranks with the lowest resulting
   time that have room; RW and DP: all ranks; TWRW and TWCW: the best node); its score
   is ``max(slowest rank, mean rank + W_later / W)`` after placing it, where
   ``W_later`` is the least work the tables not yet placed will add (each whole in the
   fast tier, TW or RW, whichever is cheaper): a candidate that keeps every rank under
   that bound costs nothing, so the one adding the least total time wins the tie (LPT
   with a look-ahead); further ties go to candidate order. A lower precision than the
   preferred one is taken only where it buys a faster tier (device, cached host, host,
   cached SSD, SSD), where the preferred one does not fit, or where the preferred one
   would leave less room (all tiers, all ranks) than ``LOOKAHEAD_MARGINS`` times what
   the tables not yet placed need at their lowest precision. Communication buffers must
   sit in the fast tier: every table's least requester buffers are reserved there from
   the start, and room for ``FAST_BUFFER_MARGIN`` times the average shard buffers of
   the tables still to place (plus the largest) is kept free while it can be.
3. **Local improvement**: while it lowers the slowest rank's time, move a table-wise
   table off the slowest rank to the rank where the new slowest time is lowest.

Everything is deterministic: tables and candidates are visited in sorted orders, ties
go to the lowest rank, no dict or set order or hash decides anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tetrarec.planner.cost import (
    SHORT,
    Option,
    ShardCost,
    Uniform,
    dense_seconds,
    group_seconds,
    link_parts,
    link_seconds_per_byte,
    option_groups,
    shard_cost,
    shared_compute,
    uniform_cost,
)
from tetrarec.planner.inputs import PlannerInputs, TableSpec
from tetrarec.planner.topology import TIER_ORDER, Tier, Topology
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlacement, TablePlan
from tetrarec.sharding.strategy import split_evenly
from tetrarec.types import Placement, Precision, ShardingType

__all__ = [
    "DP_MAX_BYTES",
    "PlannerError",
    "Shortfall",
    "TableChoice",
    "candidates",
    "fit_precisions",
    "search",
]

#: Largest table (weights + state) replicated on every rank.
DP_MAX_BYTES = 16 * 2**20
#: Fast-tier room kept for the shards' buffers: this many times their average share.
FAST_BUFFER_MARGIN = 2.0
#: Share of device + host memory the tables may fill before precisions are lowered.
FAST_FILL = 0.8
#: A precision is kept only if the room left after it is this many times what the
#: tables not yet placed need at their lowest precision (one value per greedy pass).
LOOKAHEAD_MARGINS = (1.1, 1.5, 3.0)
_CACHE_FRACTIONS = (0.01, 0.05)
_CW_BLOCKS = (2, 4, 8, 16)
_MIN_BLOCK = 16


@dataclass(frozen=True, kw_only=True)
class Shortfall:
    """Why a table (or one of its candidates) does not fit: the tier, what it needs.

    ``need`` is what it needs in ``tier`` on a rank, ``shortfall`` by how many bytes
    the best rank misses it.
    """

    table: str
    tier: Tier
    need: float
    shortfall: float
    buffers: bool = False  # the lookups' buffers (every rank's), not its rows, miss room

    def describe(self) -> str:
        """One line."""
        if self.buffers:
            return (
                f"table {self.table!r}: a rank's {self.tier.value} memory is "
                f"{self.shortfall:,.0f} bytes short of the lookups' buffers (this table's: "
                f"{self.need:,.0f} bytes on every rank)"
            )
        return (
            f"table {self.table!r} needs {self.need:,.0f} bytes of {self.tier.value} on a rank "
            f"at best and is {self.shortfall:,.0f} bytes short"
        )


class PlannerError(ValueError):
    """Nothing fits: names the tables, the tier, the shortfall and what would help.

    Args:
        shortfalls: the tables that fit nowhere.
        hint: what would make them fit.
    """

    def __init__(self, shortfalls: Sequence[Shortfall], hint: str) -> None:
        self.shortfalls = tuple(shortfalls)
        self.hint = hint
        shown = "; ".join(s.describe() for s in self.shortfalls[:3])
        more = f" (and {len(self.shortfalls) - 3} more)" if len(self.shortfalls) > 3 else ""
        super().__init__(
            f"no plan fits {len(self.shortfalls)} table(s): {shown}{more}. To fit: {hint}"
        )


@dataclass(frozen=True, kw_only=True)
class TableChoice:
    """Where a table went and why.

    Args:
        table: its name.
        option: the chosen candidate.
        shards: its shards (ranks, rows, columns).
        reason: one line.
        candidates: how many candidates fit when it was placed.
    """

    table: str
    option: Option
    shards: tuple[Shard, ...]
    reason: str
    candidates: int

    def table_plan(self) -> TablePlan:
        """The ``TablePlan`` of the ``ShardingPlan`` (with the placement chosen)."""
        return TablePlan(
            table=self.table,
            sharding=self.option.sharding,
            shards=self.shards,
            placement=table_placement(self.option),
        )


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


def candidates(inputs: PlannerInputs, table: TableSpec) -> list[Option]:
    """The candidates of ``table`` (module docstring), in a fixed order."""
    topo = inputs.topology
    w, local = topo.world_size, topo.ranks_per_node
    kinds: list[tuple[ShardingType, int]] = [(ShardingType.TABLE_WISE, 1)]
    if w > 1:
        if table.rows >= w:
            kinds.append((ShardingType.ROW_WISE, w))
        kinds += [
            (ShardingType.COLUMN_WISE, k)
            for k in _CW_BLOCKS
            if k <= w and table.dim % k == 0 and table.dim // k >= _MIN_BLOCK
        ]
        if table.rows * (table.row_bytes(table.precision) + table.state_bytes()) <= DP_MAX_BYTES:
            kinds.append((ShardingType.DATA_PARALLEL, w))
    if topo.nodes > 1 and local > 1:
        if table.rows >= local:
            kinds.append((ShardingType.TABLE_ROW_WISE, local))
        if table.dim % local == 0 and table.dim // local >= _MIN_BLOCK:
            kinds.append((ShardingType.TABLE_COLUMN_WISE, local))
    tiers = topo.tiers
    places: list[tuple[Tier, Tier | None, float]] = [(t, None, 0.0) for t in tiers]
    for slow, fast in zip(tiers[1:], tiers[:-1]):
        places += [(slow, fast, f) for f in _CACHE_FRACTIONS]
    precisions = table.precisions
    if table.placement is not None:  # the config fixes the tier: only the sharding is free
        tier, cache, fraction, precision = option_of(table.placement, table, topo)
        places, precisions = [(tier, cache, fraction)], (precision,)
    return [
        Option(sharding=s, blocks=k, tier=t, cache_tier=c, cache_fraction=f, precision=p)
        for p in precisions
        for s, k in kinds
        for t, c, f in places
        # a replica's rows sit in the fast tier, or in the next one with its hottest
        # rows cached in the fast tier (each replica caches its own copy)
        if not (s is ShardingType.DATA_PARALLEL and topo.fast_tier not in (t, c))
    ]


def _pieces(inputs: PlannerInputs, table: TableSpec, option: Option) -> list[tuple[int, int]]:
    """(rows, cols) of each shard of ``option``."""
    s, k = option.sharding, option.blocks
    if s in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        return [(hi - lo, table.dim) for lo, hi in split_evenly(table.rows, k)]
    if s in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        return [(table.rows, table.dim // k)] * k
    return [(table.rows, table.dim)] * k


class _Ranks:
    """Per-rank running totals of the search (private, mutable)."""

    def __init__(self, inputs: PlannerInputs) -> None:
        topo = inputs.topology
        w = topo.world_size
        self.inputs = inputs
        self.w = w
        self.lookup = np.zeros(w)
        self.cin = np.zeros(w)
        self.cout = np.zeros(w)
        # rows 0-2: the tiers; row 3: rows (weights, state, cache) in the fast tier
        # and buffers beyond their reservation, against a budget that leaves room for
        # every table's buffers
        self.mem = np.zeros((4, w))
        self.fast = TIER_ORDER.index(topo.fast_tier)
        self.u_in = self.u_out = self.u_buf = self.u_sec = 0.0
        self.groups: set[str] = set()
        # Every table's requester buffers (at their least, TW) are reserved in the fast
        # tier from the start, so that the big tables placed first cannot leave the
        # later ones no room for them.
        # The shards' own buffers are kept room for by ``keep_free``.
        self.reserved = {t.name: _least_buffers(inputs, t) for t in inputs.tables}
        self.mem[self.fast] += sum(self.reserved.values())
        caps = [topo.rank.capacity(t) for t in TIER_ORDER]
        held = [_holder_buffers(inputs, t) for t in inputs.tables]
        buffers = sum(self.reserved.values()) + sum(held) / w
        budget = caps[self.fast] - FAST_BUFFER_MARGIN * buffers - max(held)
        self.full = np.array([*caps, max(budget, 0.0)])[:, None]
        self.cap = self.full.copy()
        self.spb = link_seconds_per_byte(topo)
        self.intra = link_parts(topo)[0]  # shared cores: copies by the node's cores
        compute, allreduce = dense_seconds(inputs)
        self.dense = compute + allreduce
        self.dense_compute = compute
        self.topo = topo

    def keep_free(self, later: float) -> None:
        """Leave ``later`` bytes of the fast tier free on every rank.

        For the buffers of the shards of the tables not yet placed, which go where those
        tables land.
        """
        self.cap[self.fast] = max(float(self.full[self.fast, 0]) - later, 0.0)

    def fixed(self, groups: set[str]) -> float:
        return self.u_sec + self.dense + group_seconds(self.topo, groups)

    def times(self) -> np.ndarray:
        moved = np.maximum(self.cin + self.u_in, self.cout + self.u_out)
        times = self.lookup + moved * self.spb + self.fixed(self.groups)
        if self.topo.cores_shared:  # the nodes' compute is processor-shared (cost.py)
            busy = self.lookup + self.dense_compute + moved * self.intra
            done = np.asarray(shared_compute(self.topo, busy.tolist()))
            times = times - busy + done
        return times

    def add(self, ranks: Sequence[int], cost: ShardCost, sign: float = 1.0) -> None:
        for r in ranks:
            self.lookup[r] += sign * cost.lookup_s
            self.cin[r] += sign * cost.bytes_in
            self.cout[r] += sign * cost.bytes_out
            self.mem[:3, r] += sign * np.asarray(cost.memory)
            self.mem[3, r] += sign * cost.fast_rows

    def add_uniform(self, u: Uniform, groups: frozenset[str], table: str) -> None:
        self.u_in += u.bytes_in
        self.u_out += u.bytes_out
        self.u_buf += u.buffers
        self.u_sec += u.seconds
        extra = u.buffers - self.reserved.pop(table)
        self.mem[self.fast] += extra
        self.mem[3] += max(extra, 0.0)
        self.groups |= groups


@dataclass
class _Eval:
    score: tuple[float, float, int]
    ranks: tuple[int, ...]
    cost: ShardCost
    uniform: Uniform


def _evaluate(
    st: _Ranks, table: TableSpec, option: Option, order: int, later: float = 0.0
) -> _Eval | Shortfall:
    """The best ranks for ``option`` and the score, or why it does not fit."""
    inputs = st.inputs
    pieces = _pieces(inputs, table, option)
    rows = max(p[0] for p in pieces)
    cost = shard_cost(inputs, table, option, rows, pieces[0][1])
    u = uniform_cost(inputs, table, option)
    need = np.asarray([*cost.memory, cost.fast_rows])[:, None]
    ubuf = np.zeros((4, 1))
    ubuf[st.fast] = u.buffers - st.reserved[table.name]  # beyond its reservation
    ubuf[3] = max(float(ubuf[st.fast, 0]), 0.0)
    free = st.cap - st.mem - ubuf  # (3, W) after the uniform part
    if (free < 0).any():
        tier = TIER_ORDER[st.fast]
        short = float(-free[st.fast].min())
        return Shortfall(
            table=table.name, tier=tier, need=float(u.buffers), shortfall=short, buffers=True
        )
    fits: np.ndarray = np.asarray((free >= need).all(axis=0))
    groups = st.groups | option_groups(table, option)
    fixed = st.u_sec + u.seconds + st.dense + group_seconds(st.topo, groups)
    base_in, base_out = st.cin + st.u_in + u.bytes_in, st.cout + st.u_out + u.bytes_out
    t_u = st.lookup + np.maximum(base_in, base_out) * st.spb + fixed
    t_p = (
        st.lookup
        + cost.lookup_s
        + np.maximum(base_in + cost.bytes_in, base_out + cost.bytes_out) * st.spb
        + fixed
    )
    s, k = option.sharding, option.blocks
    local = inputs.topology.ranks_per_node
    chosen: tuple[int, ...]
    if s in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
        ok = np.flatnonzero(fits)
        if len(ok) < k:
            return _short(table, option, need, free, k, st.fast)
        best = ok[np.argsort(t_p[ok], kind="stable")[:k]]
        chosen = tuple(sorted(int(r) for r in best))
    elif s in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL):
        if not fits.all():
            return _short(table, option, need, free, st.w, st.fast)
        chosen = tuple(range(st.w))
    else:  # one node
        best_node, best_max = -1, math.inf
        for n in range(inputs.topology.nodes):
            rs = slice(n * local, (n + 1) * local)
            if fits[rs].all():
                m = float(t_p[rs].max())
                if m < best_max:
                    best_node, best_max = n, m
        if best_node < 0:
            return _short(table, option, need, free, local, st.fast)
        chosen = tuple(range(best_node * local, (best_node + 1) * local))
    idx = list(chosen)
    after = t_u.copy()
    after[idx] = t_p[idx]
    added = float(after.sum() - st.times().sum())
    score = max(float(after.max()), float(after.mean()) + later / st.w)
    return _Eval(score=(score, added, order), ranks=chosen, cost=cost, uniform=u)


def _short(
    table: TableSpec, option: Option, need: np.ndarray, free: np.ndarray, k: int, fast: int
) -> Shortfall:
    """The tier that blocks ``option`` and its shortfall on the k-th best rank."""
    worst: Shortfall | None = None
    for i, tier in enumerate((*TIER_ORDER, TIER_ORDER[fast])):
        if need[i, 0] <= 0:
            continue
        room = np.sort(free[i])[::-1]
        gap = float(need[i, 0] - room[min(k, len(room)) - 1])
        if gap > 0 and (worst is None or gap > worst.shortfall):
            worst = Shortfall(table=table.name, tier=tier, need=float(need[i, 0]), shortfall=gap)
    if worst is None:
        worst = Shortfall(table=table.name, tier=option.tier, need=float(need.sum()), shortfall=0)
    return worst


def _table_bytes(table: TableSpec) -> int:
    return table.rows * (table.row_bytes(table.precision) + table.state_bytes())


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _reason(
    inputs: PlannerInputs, table: TableSpec, best: _Eval, option: Option, tw_fast: object, n: int
) -> str:
    """One line: why this candidate."""
    fast = inputs.topology.fast_tier
    head = f"{SHORT[option.sharding]}"
    if isinstance(tw_fast, Shortfall):
        cap = inputs.topology.rank.capacity(fast)
        why = (
            f"{head}: {_gb(_table_bytes(table))} does not fit one rank's free {fast.value} "
            f"memory (of {_gb(cap)} per rank, with what is placed before it)"
        )
    else:
        why = f"{head}: fastest of {n} fitting candidates"
    if option.precision is not table.precision:
        why += f"; {option.precision.value} rows instead of {table.precision.value}"
    if table.placement is not None:
        why += f"; rows in {option.placement()}, as model.placement says"
    elif option.tier is not fast or option.cache_tier is not None:
        why += f"; rows in {option.placement()}"
    return why + f" (step bound after it: {best.score[0] * 1e3:.3g} ms)"


def search(inputs: PlannerInputs) -> tuple[ShardingPlan, tuple[TableChoice, ...]]:
    """Plan ``inputs`` (module docstring).

    When the greedy pass leaves some table nowhere to go, it runs again keeping more
    room for the tables after each one (``LOOKAHEAD_MARGINS``), which lowers precisions
    earlier; the error of the last pass is raised.

    Returns:
        The plan (validated against the tables) and each table's choice, in table order.

    Raises:
        PlannerError: when some tables fit nowhere.
    """
    error: PlannerError | None = None
    narrowed = fit_precisions(inputs)
    for margin in LOOKAHEAD_MARGINS:
        try:
            return _search(narrowed, margin)
        except PlannerError as e:
            error = e
            if all(len(t.precisions) == 1 for t in inputs.tables):
                break  # no precision to lower: another pass would place the same
    assert error is not None
    raise error


def fit_precisions(inputs: PlannerInputs) -> PlannerInputs:
    """Lower the precision of the largest tables until all fit the tiers above SSD.

    When the tables' weights and state at their preferred precisions exceed
    ``FAST_FILL`` of the device and host memory of all ranks, the largest tables are
    lowered one allowed precision at a time (largest first, then again) until they fit
    or none can go lower; each table then keeps only the precisions from its new one
    down. Keeping rows off the SSD is worth more than their precision (its bandwidth is
    tens of times lower); a table is never lowered when the model fits as configured.
    """
    topo = inputs.topology
    above_ssd = [t for t in topo.tiers if t is not Tier.SSD]
    if not above_ssd or Tier.SSD not in topo.tiers:
        return inputs
    room = FAST_FILL * topo.world_size * sum(topo.rank.capacity(t) for t in above_ssd)

    def size(t: TableSpec, level: int) -> float:
        return float(t.rows * (t.row_bytes(t.precisions[level]) + t.state_bytes()))

    level = {t.name: 0 for t in inputs.tables}
    total = sum(size(t, 0) for t in inputs.tables)
    order = sorted(inputs.tables, key=lambda t: (-size(t, 0), t.name))
    changed = True
    while total > room and changed:
        changed = False
        for t in order:
            if level[t.name] + 1 < len(t.precisions):
                total -= size(t, level[t.name]) - size(t, level[t.name] + 1)
                level[t.name] += 1
                changed = True
                if total <= room:
                    break
    tables = tuple(replace(t, precisions=t.precisions[level[t.name] :]) for t in inputs.tables)
    return replace(inputs, tables=tables)


def _search(inputs: PlannerInputs, margin: float) -> tuple[ShardingPlan, tuple[TableChoice, ...]]:
    """One greedy pass and the local improvement."""
    topo = inputs.topology
    st = _Ranks(inputs)
    order = sorted(inputs.tables, key=lambda t: (-_table_bytes(t), t.name))
    later = sum(_least_work(inputs, t) for t in order)
    least = {t.name: _least_bytes(t) for t in order}
    still = sum(least.values())  # bytes the tables not yet placed need at least
    held = [_holder_buffers(inputs, t) for t in order]
    after_sum = np.cumsum([0.0, *held[::-1]])[::-1][1:]  # held of the tables after i
    w = topo.world_size
    chosen: dict[str, tuple[Option, _Eval, str, int]] = {}
    failures: list[Shortfall] = []
    top_held = max(held)
    for index, table in enumerate(order):
        opts = candidates(inputs, table)
        later -= _least_work(inputs, table)
        still -= least[table.name]
        # Room is kept in the fast tier for the buffers of the tables after this one;
        # when that leaves this one nowhere, it may use that room (a preference, not a
        # limit: the last tables can always take what is left).
        for keep in (FAST_BUFFER_MARGIN * after_sum[index] / w + top_held, 0.0):
            st.keep_free(keep)
            found = _best_options(st, inputs, table, opts, later, still, margin)
            best_by_precision, options_of, closest, fitting, tw_fast = found
            pick = _pick_precision(best_by_precision, options_of)
            if pick is not None:
                break
        if pick is None:
            failures.append(
                closest or Shortfall(table=table.name, tier=topo.fast_tier, need=0, shortfall=0)
            )
            continue
        won, won_opt = best_by_precision[pick], options_of[pick]
        assert won is not None
        assert won_opt is not None
        st.add(won.ranks, won.cost)
        st.add_uniform(won.uniform, option_groups(table, won_opt), table.name)
        why = _reason(inputs, table, won, won_opt, tw_fast, fitting)
        chosen[table.name] = (won_opt, won, why, fitting)
    if failures:
        raise PlannerError(failures, _hint(inputs, failures))
    st.keep_free(0.0)
    for _ in range(8):  # moves, then swaps, until neither helps
        before = float(st.times().max())
        _improve(st, inputs, chosen)
        _swap(st, chosen)
        if float(st.times().max()) >= before - 1e-12:
            break
    choices = tuple(_choice(inputs, t, *chosen[t.name]) for t in inputs.tables)
    plan = ShardingPlan(
        world_size=topo.world_size,
        local_world_size=topo.ranks_per_node,
        tables=tuple(c.table_plan() for c in choices),
    )
    plan.validate(inputs.table_configs())
    return plan, choices


def _least_buffers(inputs: PlannerInputs, table: TableSpec) -> float:
    """The requester buffers ``table`` needs on every rank at least (as TW)."""
    topo = inputs.topology
    opt = Option(
        sharding=ShardingType.TABLE_WISE, blocks=1, tier=topo.fast_tier, precision=table.precision
    )
    return uniform_cost(inputs, table, opt).buffers


def _holder_buffers(inputs: PlannerInputs, table: TableSpec) -> float:
    """The buffers of ``table``'s shards on their ranks at least (as one TW shard)."""
    topo = inputs.topology
    opt = Option(
        sharding=ShardingType.TABLE_WISE, blocks=1, tier=topo.fast_tier, precision=table.precision
    )
    return shard_cost(inputs, table, opt, table.rows, table.dim).buffers


def _best_options(
    st: _Ranks,
    inputs: PlannerInputs,
    table: TableSpec,
    opts: Sequence[Option],
    later: float,
    still: float,
    margin: float,
) -> tuple[list[_Eval | None], list[Option | None], Shortfall | None, int, object]:
    """Per precision, the best fitting candidate of ``table``, and what the reason needs.

    Returns:
        The best per precision (``None``: none fits, or it would leave the later tables
        too little room), their options, the closest miss, how many candidates fit, and
        the evaluation of TW in the fast tier.
    """
    topo = inputs.topology
    room = float((st.cap[:3] - st.mem[:3]).sum())
    best_by_precision: list[_Eval | None] = []
    options_of: list[Option | None] = []
    closest: Shortfall | None = None
    fitting = 0
    tw_fast: object = None
    for precision in table.precisions:
        best: _Eval | None = None
        best_opt: Option | None = None
        for i, opt in enumerate(opts):
            if opt.precision is not precision:
                continue
            ev = _evaluate(st, table, opt, i, max(later, 0.0))
            if (
                tw_fast is None
                and opt.sharding is ShardingType.TABLE_WISE
                and opt.tier is topo.fast_tier
                and opt.cache_tier is None
            ):
                tw_fast = ev
            if isinstance(ev, Shortfall):
                if closest is None or ev.shortfall < closest.shortfall:
                    closest = ev
                continue
            fitting += 1
            if best is None or ev.score < best.score:
                best, best_opt = ev, opt
        if best is not None and precision is not table.precisions[-1]:
            added = sum(best.cost.memory) * len(best.ranks) + best.uniform.buffers * st.w
            if room - added < margin * still:
                best = best_opt = None  # the tables after it would not fit: go lower
        best_by_precision.append(best)
        options_of.append(best_opt)
    return best_by_precision, options_of, closest, fitting, tw_fast


def _least_bytes(table: TableSpec) -> float:
    """Weights and state of ``table`` at its lowest allowed precision."""
    low = min(table.row_bytes(p) for p in table.precisions)
    return float(table.rows * (low + table.state_bytes()))


def _least_work(inputs: PlannerInputs, table: TableSpec) -> float:
    """Seconds a table adds over all ranks at least.

    Whole, in the fast tier, as the cheapest of TW and RW: an estimate of the work the
    tables not yet placed will add.
    """
    topo = inputs.topology
    spb = link_seconds_per_byte(topo)
    best = math.inf
    for sharding, k in ((ShardingType.TABLE_WISE, 1), (ShardingType.ROW_WISE, topo.world_size)):
        opt = Option(
            sharding=sharding, blocks=k, tier=topo.fast_tier, precision=table.precisions[-1]
        )
        c = shard_cost(inputs, table, opt, math.ceil(table.rows / k), table.dim)
        u = uniform_cost(inputs, table, opt)
        work = k * (c.lookup_s + max(c.bytes_in, c.bytes_out) * spb)
        work += topo.world_size * (max(u.bytes_in, u.bytes_out) * spb + u.seconds)
        best = min(best, work)
    return best


def _pick_precision(bests: Sequence[_Eval | None], options: Sequence[Option | None]) -> int | None:
    """The most preferred precision whose best candidate sits in the fastest place.

    A lower precision is taken only where it buys a faster tier (device before a
    cached host before host before a cached SSD before SSD), never for speed alone.
    """
    places = [
        _speed_rank(o) if b is not None and o is not None else math.inf
        for b, o in zip(bests, options)
    ]
    fastest = min(places, default=math.inf)
    if fastest == math.inf:
        return None
    return places.index(fastest)


def _speed_rank(option: Option) -> int:
    """0 for rows in the fastest tier; each slower tier +2; a cache -1."""
    return 2 * TIER_ORDER.index(option.tier) - (option.cache_tier is not None)


def _improve(
    st: _Ranks, inputs: PlannerInputs, chosen: dict[str, tuple[Option, _Eval, str, int]]
) -> None:
    """Move table-wise tables off the slowest rank while that lowers the slowest time."""
    for _ in range(2 * len(chosen)):
        times = st.times()
        worst = int(np.argmax(times))
        current = float(times[worst])
        best_move: tuple[float, str, int] | None = None
        for name in sorted(chosen):
            opt, ev, _, _ = chosen[name]
            if opt.sharding is not ShardingType.TABLE_WISE or ev.ranks != (worst,):
                continue
            st.add((worst,), ev.cost, -1.0)
            free = st.cap - st.mem
            need = np.asarray([*ev.cost.memory, ev.cost.fast_rows])[:, None]
            fits = (free >= need).all(axis=0)
            base = st.times()  # without the table
            c = ev.cost
            moved = (
                st.lookup
                + c.lookup_s
                + np.maximum(st.cin + st.u_in + c.bytes_in, st.cout + st.u_out + c.bytes_out)
                * st.spb
                + st.fixed(st.groups)
            )
            top = np.sort(base)[::-1]
            for r in (int(x) for x in np.flatnonzero(fits)):
                if r == worst:
                    continue
                others = float(top[1] if base[r] == top[0] else top[0])
                new = max(others, float(moved[r]))
                if new < current - 1e-12 and (best_move is None or new < best_move[0]):
                    best_move = (new, name, r)
            st.add((worst,), ev.cost)
        if best_move is None:
            return
        _, name, r = best_move
        opt, ev, reason, n = chosen[name]
        st.add((worst,), ev.cost, -1.0)
        st.add((r,), ev.cost)
        ev.ranks = (r,)
        chosen[name] = (opt, ev, reason + f"; moved from rank {worst} to balance", n)


#: Ranks (least loaded first) whose table-wise tables the slowest rank's may swap with.
SWAP_PARTNERS = 4
#: Swap rounds at most (each one strictly lowers the slowest rank's time).
SWAP_ROUNDS = 256


def _swap(st: _Ranks, chosen: dict[str, tuple[Option, _Eval, str, int]]) -> None:
    """Swap table-wise tables between the slowest rank and a less loaded one.

    A swap is taken while it lowers the slowest time and every memory limit holds.
    Moves alone stop when no single table fits the gap between two ranks; a swap moves
    only the difference of two tables' costs (the classic 2-exchange after LPT).
    """
    on: dict[int, list[str]] = {}
    for name in sorted(chosen):
        opt, ev, _, _ = chosen[name]
        if opt.sharding is ShardingType.TABLE_WISE:
            on.setdefault(ev.ranks[0], []).append(name)
    for _ in range(SWAP_ROUNDS):
        times = st.times()
        worst = int(np.argmax(times))
        current = float(times[worst])
        partners = [int(r) for r in np.argsort(times, kind="stable")[:SWAP_PARTNERS]]
        best: tuple[float, str, str, int] | None = None
        for a in on.get(worst, []):
            ca = chosen[a][1].cost
            for r in partners:
                if r == worst:
                    continue
                for b in on.get(r, []):
                    cb = chosen[b][1].cost
                    if (
                        cb.lookup_s >= ca.lookup_s
                        and cb.bytes_in >= ca.bytes_in
                        and cb.bytes_out >= ca.bytes_out
                    ):
                        continue  # b costs at least what a does: the slowest cannot gain
                    st.add((worst,), ca, -1.0)
                    st.add((r,), cb, -1.0)
                    st.add((worst,), cb)
                    st.add((r,), ca)
                    fits = bool((st.mem <= st.cap + 1e-6).all())
                    new = float(st.times().max())
                    st.add((worst,), cb, -1.0)
                    st.add((r,), ca, -1.0)
                    st.add((worst,), ca)
                    st.add((r,), cb)
                    if fits and new < current - 1e-12 and (best is None or new < best[0]):
                        best = (new, a, b, r)
        if best is None:
            return
        _, a, b, r = best
        ca, cb = chosen[a][1].cost, chosen[b][1].cost
        st.add((worst,), ca, -1.0)
        st.add((r,), cb, -1.0)
        st.add((worst,), cb)
        st.add((r,), ca)
        for name, src, dst in ((a, worst, r), (b, r, worst)):
            opt, ev, reason, n = chosen[name]
            ev.ranks = (dst,)
            chosen[name] = (opt, ev, reason + f"; swapped from rank {src} to rank {dst}", n)
        on[worst] = sorted([*(x for x in on[worst] if x != a), b])
        on[r] = sorted([*(x for x in on[r] if x != b), a])


def _choice(
    inputs: PlannerInputs, table: TableSpec, opt: Option, ev: _Eval, reason: str, n: int
) -> TableChoice:
    """The shards of a placed table."""
    s = opt.sharding
    ranks = ev.ranks
    if s in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        shards = tuple(
            Shard(rank=r, rows=rows, cols=(0, table.dim))
            for r, rows in zip(ranks, split_evenly(table.rows, len(ranks)))
        )
    elif s in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        width = table.dim // opt.blocks
        shards = tuple(
            Shard(rank=r, rows=(0, table.rows), cols=(i * width, (i + 1) * width))
            for i, r in enumerate(ranks)
        )
    else:
        shards = tuple(Shard(rank=r, rows=(0, table.rows), cols=(0, table.dim)) for r in ranks)
    return TableChoice(table=table.name, option=opt, shards=shards, reason=reason, candidates=n)


def _hint(inputs: PlannerInputs, failures: Sequence[Shortfall]) -> str:
    """What would make the model fit."""
    topo = inputs.topology
    total = sum(_table_bytes(t) for t in inputs.tables)
    # a shard lives in one tier of a rank: count ranks by the largest tier
    largest = max((topo.rank.capacity(t) for t in topo.tiers), default=0.0)
    ranks = math.ceil(total / largest) if largest else 0
    lower = sorted({p.value for t in inputs.tables for p in t.precisions})
    parts = []
    buffers = [f for f in failures if f.buffers]
    if buffers:
        parts.append(
            f"a smaller data.batch_size ({inputs.batch_size} now: the lookups' buffers in "
            f"{buffers[0].tier.value} memory grow with it) or more {buffers[0].tier.value} "
            "memory per rank"
        )
    if ranks > topo.world_size:
        parts.append(
            f"more ranks (the tables' weights and state, {_gb(total)}, need at least {ranks} "
            f"ranks of {_gb(largest)} in one tier; this world has {topo.world_size})"
        )
    elif len(buffers) < len(failures):
        parts.append(
            f"more ranks, to cut the largest tables into smaller shards (the tables' "
            f"{_gb(total)} would fit this world's {topo.world_size} ranks in total, but not "
            "in the pieces a rank's tiers can hold)"
        )
    bits = {Precision.FP32: 32, Precision.FP16: 16, Precision.BF16: 16, Precision.INT8: 8}
    lowest = min(bits.get(p, 4) for t in inputs.tables for p in t.precisions)
    below = [
        p.value for p in (Precision.FP16, Precision.INT8, Precision.INT4) if bits.get(p, 4) < lowest
    ]
    if below:  # none below INT4
        parts.append(
            f"a lower row precision (allowed now: {', '.join(lower)}; e.g. model.precision = "
            f"{' or '.join(repr(p) for p in below)})"
        )
    if Tier.SSD not in topo.tiers:
        parts.append("the SSD tier (set [rank] ssd and ssd_bandwidth in the topology)")
    return "; ".join(parts)
