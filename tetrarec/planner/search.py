"""The search: candidates per table, greedy placement, local improvement.

1. **Candidates** (``candidates.py``): per table, every shard count each registered
   sharding strategy offers for it in this world (with the built-in types: TW; RW when
   the table has at least ``W`` rows; CW in 2, 4, 8 or 16 column blocks of at least 16
   columns that divide the dim; DP for tables of at most ``DP_MAX_BYTES``; TWRW and
   TWCW on several nodes), in every tier the topology has (device, host, SSD) and
   cached (rows in a tier, the hottest 1% or 5% again in the next faster one), at
   every precision the table allows; replicas only in the fast tier, or in the next
   one with a cache in the fast tier.
2. **Greedy placement** (here, scored by ``partition.py``): tables largest first
   (weights + state at their preferred precision; ties by name). For each candidate,
   the ranks it would go to are those that keep the step fastest (types spanning the
   world: the ranks with the lowest resulting time that have room, all of them for
   RW and DP; types spanning a node, TWRW and TWCW: the best node); its score is
   ``max(slowest rank, mean rank + W_later / W)`` after placing it, where ``W_later``
   is the least work the tables not yet placed will add (each whole in the fast tier,
   the cheapest of the types whose cost terms say ``lookahead``: TW or RW): a
   candidate that keeps every rank under that bound costs nothing, so the one adding
   the least total time wins the tie (LPT with a look-ahead); further ties go to
   candidate order. A lower precision than the preferred one is taken only where it
   buys a faster tier (device, cached host, host, cached SSD, SSD), where the preferred
   one does not fit, or where the preferred one would leave less room (all tiers, all
   ranks) than ``LOOKAHEAD_MARGINS`` times what the tables not yet placed need at their
   lowest precision. Communication buffers must sit in the fast tier: every table's
   least requester buffers are reserved there from the start, and room for
   ``FAST_BUFFER_MARGIN`` times the average shard buffers of the tables still to place
   (plus the largest) is kept free while it can be.
3. **Local improvement** (``refine.py``): while it lowers the slowest rank's time, move
   a whole table (TW) off the slowest rank to the rank where the new slowest time is
   lowest, or swap two.

No type is named here: what differs between types comes from their strategies'
cost terms (``tetrarec.sharding.strategy.CostTerms``). Everything is deterministic:
tables and candidates are visited in sorted orders, ties go to the lowest rank, no dict
or set order or hash decides anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tetrarec.planner.candidates import (
    candidates,
    shard_sizes,
    shards_on,
    table_bytes,
    table_placement,
)
from tetrarec.planner.cost import (
    Option,
    link_seconds_per_byte,
    option_groups,
    shard_cost,
    uniform_cost,
)
from tetrarec.planner.inputs import PlannerInputs, TableSpec
from tetrarec.planner.partition import (
    FAST_BUFFER_MARGIN,
    Evaluation,
    RankLoads,
    Shortfall,
    evaluate_option,
    holder_buffers,
)
from tetrarec.planner.refine import Chosen, improve, swap
from tetrarec.planner.topology import TIER_ORDER, Tier
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.strategy import STRATEGIES, Span, Split, baseline
from tetrarec.types import Precision

__all__ = [
    "PlannerError",
    "Shortfall",
    "TableChoice",
    "candidates",
    "fit_precisions",
    "search",
]

#: Share of device + host memory the tables may fill before precisions are lowered.
FAST_FILL = 0.8
#: A precision is kept only if the room left after it is this many times what the
#: tables not yet placed need at their lowest precision (one value per greedy pass).
LOOKAHEAD_MARGINS = (1.1, 1.5, 3.0)


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


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _reason(
    inputs: PlannerInputs,
    table: TableSpec,
    best: Evaluation,
    option: Option,
    baseline_fast: object,
    n: int,
) -> str:
    """One line: why this candidate.

    ``baseline_fast``: the evaluation of the table as the baseline type (TW) in the fast
    tier; a ``Shortfall`` there is the reason the table went elsewhere.
    """
    fast = inputs.topology.fast_tier
    head = option.terms.label
    if isinstance(baseline_fast, Shortfall):
        cap = inputs.topology.rank.capacity(fast)
        why = (
            f"{head}: {_gb(table_bytes(table))} does not fit one rank's free {fast.value} "
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
    st = RankLoads(inputs)
    order = sorted(inputs.tables, key=lambda t: (-table_bytes(t), t.name))
    later = sum(_least_work(inputs, t) for t in order)
    least = {t.name: _least_bytes(t) for t in order}
    still = sum(least.values())  # bytes the tables not yet placed need at least
    held = [holder_buffers(inputs, t) for t in order]
    after_sum = np.cumsum([0.0, *held[::-1]])[::-1][1:]  # held of the tables after i
    w = topo.world_size
    chosen: Chosen = {}
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
            best_by_precision, options_of, closest, fitting, baseline_fast = found
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
        why = _reason(inputs, table, won, won_opt, baseline_fast, fitting)
        chosen[table.name] = (won_opt, won, why, fitting)
    if failures:
        raise PlannerError(failures, _hint(inputs, failures))
    st.keep_free(0.0)
    for _ in range(8):  # moves, then swaps, until neither helps
        before = float(st.times().max())
        improve(st, inputs, chosen)
        swap(st, chosen)
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


def _best_options(
    st: RankLoads,
    inputs: PlannerInputs,
    table: TableSpec,
    opts: Sequence[Option],
    later: float,
    still: float,
    margin: float,
) -> tuple[list[Evaluation | None], list[Option | None], Shortfall | None, int, object]:
    """Per precision, the best fitting candidate of ``table``, and what the reason needs.

    Returns:
        The best per precision (``None``: none fits, or it would leave the later tables
        too little room), their options, the closest miss, how many candidates fit, and
        the evaluation of the baseline type (TW) in the fast tier.
    """
    topo = inputs.topology
    baseline_type = baseline().sharding_type
    room = float((st.cap[:3] - st.mem[:3]).sum())
    best_by_precision: list[Evaluation | None] = []
    options_of: list[Option | None] = []
    closest: Shortfall | None = None
    fitting = 0
    baseline_fast: object = None
    for precision in table.precisions:
        best: Evaluation | None = None
        best_opt: Option | None = None
        for i, opt in enumerate(opts):
            if opt.precision is not precision:
                continue
            ev = evaluate_option(st, table, opt, i, max(later, 0.0))
            if (
                baseline_fast is None
                and opt.sharding is baseline_type
                and opt.tier is topo.fast_tier
                and opt.cache_tier is None
            ):
                baseline_fast = ev
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
    return best_by_precision, options_of, closest, fitting, baseline_fast


def _least_bytes(table: TableSpec) -> float:
    """Weights and state of ``table`` at its lowest allowed precision."""
    low = min(table.row_bytes(p) for p in table.precisions)
    return float(table.rows * (low + table.state_bytes()))


def _least_work(inputs: PlannerInputs, table: TableSpec) -> float:
    """Seconds a table adds over all ranks at least.

    Whole, in the fast tier, as the cheapest of the types whose cost terms say
    ``lookahead`` (TW and RW), each in its widest cut (one whole shard, or a block per
    rank of its span): an estimate of the work the tables not yet placed will add.
    """
    topo = inputs.topology
    spb = link_seconds_per_byte(topo)
    best = math.inf
    for strategy in STRATEGIES.values():
        terms = strategy.cost
        if not terms.lookahead:
            continue
        k = topo.world_size if terms.span is Span.WORLD else topo.ranks_per_node
        if terms.split is Split.WHOLE and not terms.replicated:
            k = 1
        opt = Option(
            sharding=strategy.sharding_type,
            blocks=k,
            tier=topo.fast_tier,
            precision=table.precisions[-1],
        )
        pieces = shard_sizes(table, opt)
        c = shard_cost(inputs, table, opt, max(p[0] for p in pieces), pieces[0][1])
        u = uniform_cost(inputs, table, opt)
        work = k * (c.lookup_s + max(c.bytes_in, c.bytes_out) * spb)
        work += topo.world_size * (max(u.bytes_in, u.bytes_out) * spb + u.seconds)
        best = min(best, work)
    return best


def _pick_precision(
    bests: Sequence[Evaluation | None], options: Sequence[Option | None]
) -> int | None:
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


def _choice(
    inputs: PlannerInputs, table: TableSpec, opt: Option, ev: Evaluation, reason: str, n: int
) -> TableChoice:
    """The shards of a placed table."""
    shards = shards_on(table, opt, ev.ranks)
    return TableChoice(table=table.name, option=opt, shards=shards, reason=reason, candidates=n)


def _hint(inputs: PlannerInputs, failures: Sequence[Shortfall]) -> str:
    """What would make the model fit."""
    topo = inputs.topology
    total = sum(table_bytes(t) for t in inputs.tables)
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
