"""``PlanReport``: what the plan costs each rank, and why each table went where it did.

Per rank: bytes per tier against capacity and the predicted step time (lookup,
communication, dense); the imbalance; per table the placement and the reason.

The report is recomputed from the final shards with the same cost functions the search
used (``cost.py``), shard by shard at their exact sizes, so its sums are the plan's.

Each table's tier, cache and precision are in the plan too (``TablePlan.placement``);
the report adds why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetrarec import jsonio
from tetrarec.planner.candidates import option_of
from tetrarec.planner.cost import (
    Option,
    dense_seconds,
    group_seconds,
    link_parts,
    option_groups,
    shard_cost,
    shared_compute,
    uniform_cost,
)
from tetrarec.planner.inputs import PlannerInputs
from tetrarec.planner.search import TableChoice
from tetrarec.planner.topology import TIER_ORDER
from tetrarec.sharding.plan import ShardingPlan
from tetrarec.sharding.strategy import STRATEGIES, Split

__all__ = ["PlanReport", "RankReport", "TableReport", "evaluate", "plot_report", "predict"]


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """One rank's predicted load.

    Args:
        rank: the rank.
        memory: bytes per tier name (weights, state, cache and buffers together).
        capacity: capacity per tier name.
        weights: stored row bytes (all tiers).
        state: optimizer-state bytes.
        cache: cached row bytes.
        buffers: communication buffer bytes.
        lookup_s: lookup forward + backward seconds per step.
        comm_s: communication seconds per step (all-to-alls, DP all-reduce, latency).
        dense_s: dense compute and its gradient all-reduce.
    """

    rank: int
    memory: dict[str, float]
    capacity: dict[str, float]
    weights: float
    state: float
    cache: float
    buffers: float
    lookup_s: float
    comm_s: float
    dense_s: float

    @property
    def step_s(self) -> float:
        """Predicted seconds per step."""
        return self.lookup_s + self.comm_s + self.dense_s


@dataclass(frozen=True, kw_only=True)
class TableReport:
    """One table's placement: type, ranks, tier, precision and the reason."""

    table: str
    sharding: str
    label: str
    ranks: tuple[int, ...]
    tier: str
    precision: str
    params: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """The plan's predicted costs (module docstring).

    Args:
        topology: the topology's one-line description.
        ranks: per rank.
        tables: per table, in table order.
        plan_seconds: how long the search took (0 when not measured).
    """

    topology: str
    ranks: tuple[RankReport, ...]
    tables: tuple[TableReport, ...]
    plan_seconds: float = 0.0

    @property
    def step_s(self) -> float:
        """The slowest rank's step time."""
        return max(r.step_s for r in self.ranks)

    @property
    def imbalance(self) -> float:
        """Slowest rank / mean rank (1.0: balanced)."""
        mean = sum(r.step_s for r in self.ranks) / len(self.ranks)
        return self.step_s / mean if mean > 0 else 1.0

    @property
    def total_params(self) -> int:
        """Embedding parameters over all tables."""
        return sum(t.params for t in self.tables)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (the JSON side-car)."""
        return {
            "topology": self.topology,
            "step_s": self.step_s,
            "imbalance": self.imbalance,
            "total_params": self.total_params,
            "plan_seconds": self.plan_seconds,
            "ranks": [
                {
                    "rank": r.rank,
                    "memory": r.memory,
                    "capacity": r.capacity,
                    "weights": r.weights,
                    "state": r.state,
                    "cache": r.cache,
                    "buffers": r.buffers,
                    "lookup_s": r.lookup_s,
                    "comm_s": r.comm_s,
                    "dense_s": r.dense_s,
                    "step_s": r.step_s,
                }
                for r in self.ranks
            ],
            "tables": [
                {
                    "table": t.table,
                    "sharding": t.sharding,
                    "ranks": list(t.ranks),
                    "tier": t.tier,
                    "precision": t.precision,
                    "reason": t.reason,
                }
                for t in self.tables
            ],
        }

    def save(self, path: str | Path) -> None:
        """Write ``to_dict`` as JSON."""
        Path(path).write_text(jsonio.dumps(self.to_dict(), indent=1) + "\n")

    def summary(self) -> str:
        """A few lines: step time, imbalance, memory use per tier."""
        tiers = [t for t in self.ranks[0].capacity if self.ranks[0].capacity[t] > 0]
        use = ", ".join(
            f"{t} {_b(sum(r.memory[t] for r in self.ranks))} of "
            f"{_b(sum(r.capacity[t] for r in self.ranks))}"
            for t in tiers
        )
        return (
            f"{self.topology}\n"
            f"{len(self.tables)} tables, {self.total_params:,} parameters; predicted step "
            f"{self.step_s * 1e3:.3f} ms (slowest rank), imbalance {self.imbalance:.3f}; "
            f"memory used: {use}"
        )

    def describe(self, max_tables: int = 50) -> str:
        """The printed report: summary, one line per rank, one per table."""
        lines = [self.summary(), ""]
        tiers = [t for t in self.ranks[0].capacity if self.ranks[0].capacity[t] > 0]
        head = f"{'rank':>4}  " + "  ".join(f"{t + ' used/cap':>22}" for t in tiers)
        lines.append(head + f"  {'lookup ms':>10} {'comm ms':>9} {'dense ms':>9} {'step ms':>9}")
        for r in self.ranks:
            cells = "  ".join(f"{_b(r.memory[t]) + ' / ' + _b(r.capacity[t]):>22}" for t in tiers)
            lines.append(
                f"{r.rank:>4}  {cells}  {r.lookup_s * 1e3:>10.3f} {r.comm_s * 1e3:>9.3f} "
                f"{r.dense_s * 1e3:>9.3f} {r.step_s * 1e3:>9.3f}"
            )
        lines.append("")
        shown = self.tables[:max_tables]
        width = max([12, *(len(t.table) for t in shown)])  # C1_first_order is 14
        lines.append(f"{'table':<{width}} {'placement':<28} {'ranks':<14} reason")
        for t in shown:
            ranks = _ranks(t.ranks)
            lines.append(f"{t.table:<{width}} {t.label:<28} {ranks:<14} {t.reason}")
        if len(self.tables) > max_tables:
            lines.append(f"... and {len(self.tables) - max_tables} more tables (see --json)")
        return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def _b(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def evaluate(
    inputs: PlannerInputs,
    plan: ShardingPlan,
    choices: Sequence[TableChoice],
    plan_seconds: float = 0.0,
) -> PlanReport:
    """The report of ``plan`` (whose tables were placed as ``choices``).

    Every shard's cost is ``shard_cost`` at its exact rows and columns; every table adds
    its ``uniform_cost`` to every rank (formulas in ``cost.py``).
    """
    topo = inputs.topology
    w = topo.world_size
    by_name = {t.name: t for t in inputs.tables}
    names = [t.value for t in TIER_ORDER]
    memory = [[0.0] * 3 for _ in range(w)]
    parts = [[0.0] * 4 for _ in range(w)]  # weights, state, cache, buffers
    lookup = [0.0] * w
    cin = [0.0] * w
    cout = [0.0] * w
    u_in = u_out = u_buf = u_sec = 0.0
    groups: set[str] = set()
    tables = []
    for choice in choices:
        table, opt = by_name[choice.table], choice.option
        for shard in plan.table(choice.table).shards:
            c = shard_cost(inputs, table, opt, shard.num_rows, shard.dim)
            r = shard.rank
            lookup[r] += c.lookup_s
            cin[r] += c.bytes_in
            cout[r] += c.bytes_out
            for i in range(3):
                memory[r][i] += c.memory[i]
            for i, v in enumerate((c.weights, c.state, c.cache, c.buffers)):
                parts[r][i] += v
        u = uniform_cost(inputs, table, opt)
        u_in += u.bytes_in
        u_out += u.bytes_out
        u_buf += u.buffers
        u_sec += u.seconds
        groups |= option_groups(table, opt)
        tables.append(
            TableReport(
                table=table.name,
                sharding=opt.sharding.value,
                label=opt.label(),
                ranks=tuple(dict.fromkeys(s.rank for s in choice.shards)),
                tier=opt.placement(),
                precision=opt.precision.value,
                params=table.params,
                reason=choice.reason,
            )
        )
    fast = TIER_ORDER.index(topo.fast_tier)
    intra, inter = link_parts(topo)
    if not topo.cores_shared:
        intra, inter = 0.0, intra + inter
    compute, allreduce = dense_seconds(inputs)
    latency = group_seconds(topo, groups)
    moved = [max(cin[r] + u_in, cout[r] + u_out) for r in range(w)]
    copies = [moved[r] * intra for r in range(w)]  # shared cores: copies by the cores
    busy = [lookup[r] + compute + copies[r] for r in range(w)]
    done = shared_compute(topo, busy)  # shared cores: each rank's share of its node's
    ranks = []
    for r in range(w):
        memory[r][fast] += u_buf
        scale = done[r] / busy[r] if busy[r] > 0 else 1.0
        ranks.append(
            RankReport(
                rank=r,
                memory=dict(zip(names, memory[r])),
                capacity={n: topo.rank.capacity(t) for n, t in zip(names, TIER_ORDER)},
                weights=parts[r][0],
                state=parts[r][1],
                cache=parts[r][2],
                buffers=parts[r][3] + u_buf,
                lookup_s=lookup[r] * scale,
                comm_s=copies[r] * scale + moved[r] * inter + u_sec + latency,
                dense_s=compute * scale + allreduce,
            )
        )
    return PlanReport(
        topology=topo.describe(),
        ranks=tuple(ranks),
        tables=tuple(tables),
        plan_seconds=plan_seconds,
    )


def predict(inputs: PlannerInputs, plan: ShardingPlan) -> PlanReport:
    """The report of any plan of ``inputs``' tables (by hand, another planner, this one).

    The cost model (``cost.py``) prices it exactly as it prices the planner's own.

    Each table is priced where its ``placement`` puts it; a table without one in the
    topology's fast tier at its configured precision (``TableSpec.precision``).

    Raises:
        ValueError: if the plan does not fit the tables (``ShardingPlan.validate``) or
            was made for another world size than the topology's.
    """
    topo = inputs.topology
    plan.validate(inputs.table_configs())
    if plan.world_size != topo.world_size:
        raise ValueError(
            f"the plan is for {plan.world_size} ranks, the topology has {topo.world_size}"
        )
    by_name = {t.name: t for t in inputs.tables}
    choices = []
    for tp in plan:
        table = by_name[tp.table]
        if STRATEGIES[tp.sharding].cost.split is Split.COLUMNS:
            blocks = len({s.cols for s in tp.shards})
        else:
            blocks = len(tp.shards)
        tier, cache_tier, fraction, precision = option_of(tp.placement, table, topo)
        option = Option(
            sharding=tp.sharding,
            blocks=blocks,
            tier=tier,
            cache_tier=cache_tier,
            cache_fraction=fraction,
            precision=precision,
        )
        choices.append(
            TableChoice(
                table=tp.table, option=option, shards=tp.shards, reason="given", candidates=1
            )
        )
    order = {t.name: i for i, t in enumerate(inputs.tables)}
    choices.sort(key=lambda c: order[c.table])
    return evaluate(inputs, plan, choices)


def plot_report(report: PlanReport, path: str | Path) -> None:
    """A PNG of per-rank memory and step time.

    Memory per tier as a share of capacity; step time stacked: lookup, communication,
    dense.

    Raises:
        ValueError: if matplotlib is not installed (an optional dependency).
    """
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ValueError(
            "--plot needs matplotlib, which tetrarec does not depend on: pip install matplotlib"
        ) from e
    ranks = [r.rank for r in report.ranks]
    tiers = [t for t in report.ranks[0].capacity if report.ranks[0].capacity[t] > 0]
    fig, (ax_mem, ax_time) = plt.subplots(2, 1, figsize=(max(6, len(ranks) * 0.12 + 4), 7))
    width = 0.8 / len(tiers)
    for i, t in enumerate(tiers):
        ax_mem.bar(
            [r + i * width for r in ranks],
            [r.memory[t] / r.capacity[t] * 100 for r in report.ranks],
            width=width,
            label=t,
        )
    ax_mem.set_ylabel("memory used, % of capacity")
    ax_mem.legend()
    bottom = [0.0] * len(ranks)
    for name in ("lookup_s", "comm_s", "dense_s"):
        values = [getattr(r, name) * 1e3 for r in report.ranks]
        ax_time.bar(ranks, values, bottom=bottom, label=name.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_time.set_ylabel("predicted ms per step")
    ax_time.set_xlabel("rank")
    ax_time.legend()
    fig.suptitle(f"{report.topology[:90]}\nimbalance {report.imbalance:.3f}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
