"""Greedy placement's state: each rank's running totals, and how one candidate scores.

``RankLoads`` holds what the tables placed so far cost each rank (lookup seconds, bytes
in and out, memory per tier) and what every rank pays for all of them (requester
buffers, routing, the sharding groups in use). ``evaluate_option`` finds the ranks a
candidate would go to, those that keep the step fastest (types whose cost terms span
the world: the ``k`` ranks with the lowest resulting time that have room, every rank
when ``k`` is the world size; types that span a node: the best node), and scores it
``max(slowest rank, mean rank + W_later / W)`` after placing it, where ``W_later`` is
the least work the tables not yet placed will add; or says why it does not fit
(``Shortfall``).

Communication buffers must sit in the fast tier: every table's least requester buffers
are reserved there from the start (``least_buffers``, priced as the baseline type), and
room for ``FAST_BUFFER_MARGIN`` times the average shard buffers of the tables still to
place (plus the largest, ``holder_buffers``) is kept free while it can be
(``RankLoads.keep_free``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tetrarec.planner.candidates import shard_sizes
from tetrarec.planner.cost import (
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
from tetrarec.planner.topology import TIER_ORDER, Tier
from tetrarec.sharding.strategy import Span, baseline

__all__ = [
    "FAST_BUFFER_MARGIN",
    "Evaluation",
    "RankLoads",
    "Shortfall",
    "evaluate_option",
    "holder_buffers",
    "least_buffers",
]

#: Fast-tier room kept for the shards' buffers: this many times their average share.
FAST_BUFFER_MARGIN = 2.0


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


class RankLoads:
    """Per-rank running totals of the search (mutable: the search's own working state).

    Args:
        inputs: what is planned; every table's least requester buffers are reserved in
            the fast tier from the start.
    """

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
        # Every table's requester buffers (at their least: the baseline) are reserved in the fast
        # tier from the start, so that the big tables placed first cannot leave the
        # later ones no room for them.
        # The shards' own buffers are kept room for by ``keep_free``.
        self.reserved = {t.name: least_buffers(inputs, t) for t in inputs.tables}
        self.mem[self.fast] += sum(self.reserved.values())
        caps = [topo.rank.capacity(t) for t in TIER_ORDER]
        held = [holder_buffers(inputs, t) for t in inputs.tables]
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
        """Seconds every rank pays: routing, dense part, the fixed cost of ``groups``."""
        return self.u_sec + self.dense + group_seconds(self.topo, groups)

    def times(self) -> np.ndarray:
        """Each rank's step seconds with what is placed so far."""
        moved = np.maximum(self.cin + self.u_in, self.cout + self.u_out)
        times = self.lookup + moved * self.spb + self.fixed(self.groups)
        if self.topo.cores_shared:  # the nodes' compute is processor-shared (cost.py)
            busy = self.lookup + self.dense_compute + moved * self.intra
            done = np.asarray(shared_compute(self.topo, busy.tolist()))
            times = times - busy + done
        return times

    def add(self, ranks: Sequence[int], cost: ShardCost, sign: float = 1.0) -> None:
        """Add a shard's ``cost`` to each of ``ranks`` (``sign=-1``: take it away)."""
        for r in ranks:
            self.lookup[r] += sign * cost.lookup_s
            self.cin[r] += sign * cost.bytes_in
            self.cout[r] += sign * cost.bytes_out
            self.mem[:3, r] += sign * np.asarray(cost.memory)
            self.mem[3, r] += sign * cost.fast_rows

    def add_uniform(self, u: Uniform, groups: frozenset[str], table: str) -> None:
        """Add what ``table`` costs every rank, in place of its reserved buffers."""
        self.u_in += u.bytes_in
        self.u_out += u.bytes_out
        self.u_buf += u.buffers
        self.u_sec += u.seconds
        extra = u.buffers - self.reserved.pop(table)
        self.mem[self.fast] += extra
        self.mem[3] += max(extra, 0.0)
        self.groups |= groups


@dataclass
class Evaluation:
    """Where a candidate would go and what it would cost (mutable: refinement moves it).

    Args:
        score: (step bound after it, total seconds it adds, candidate order): lower wins.
        ranks: the ranks of its shards, in shard order.
        cost: what one shard costs its rank.
        uniform: what it costs every rank.
    """

    score: tuple[float, float, int]
    ranks: tuple[int, ...]
    cost: ShardCost
    uniform: Uniform


def evaluate_option(
    st: RankLoads, table: TableSpec, option: Option, order: int, later: float = 0.0
) -> Evaluation | Shortfall:
    """The best ranks for ``option`` and the score, or why it does not fit."""
    inputs = st.inputs
    pieces = shard_sizes(table, option)
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
    k = option.blocks
    local = inputs.topology.ranks_per_node
    chosen: tuple[int, ...]
    if option.terms.span is Span.WORLD:  # the k fastest ranks with room (k = W: all)
        ok = np.flatnonzero(fits)
        if len(ok) < k:
            return _short(table, option, need, free, k, st.fast)
        best = ok[np.argsort(t_p[ok], kind="stable")[:k]]
        chosen = tuple(sorted(int(r) for r in best))
    else:  # the ranks of the best node
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
    return Evaluation(score=(score, added, order), ranks=chosen, cost=cost, uniform=u)


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


def _baseline_option(inputs: PlannerInputs, table: TableSpec) -> Option:
    """``table`` as one shard of the baseline type (TW) in the fast tier."""
    return Option(
        sharding=baseline().sharding_type,
        blocks=1,
        tier=inputs.topology.fast_tier,
        precision=table.precision,
    )


def least_buffers(inputs: PlannerInputs, table: TableSpec) -> float:
    """The requester buffers ``table`` needs on every rank at least (as the baseline)."""
    return uniform_cost(inputs, table, _baseline_option(inputs, table)).buffers


def holder_buffers(inputs: PlannerInputs, table: TableSpec) -> float:
    """The buffers of ``table``'s shards on their ranks at least (as one baseline shard)."""
    opt = _baseline_option(inputs, table)
    return shard_cost(inputs, table, opt, table.rows, table.dim).buffers
