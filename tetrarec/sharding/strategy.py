"""``ShardingStrategy``: one per sharding type, in its own file, registered by type.

A strategy knows five things about its type::

    place(table, ctx)          the shards of a table (used to make a plan from types)
    validate(table, plan, ..)  whether a table's shards obey the type's rules
    group                      the group whose input dist -> lookup -> output dist runs
                               the type's tables on a rank
    cost                       its ``CostTerms``: what the planner prices it by
    candidate_blocks(ctx)      the block counts the planner may try for a table

Types whose tables move the same way share a group: whole tables and column blocks
(``"block"``: TW, CW, TWCW), row blocks (``"row"``: RW, TWRW) and replicated tables
(``"replicated"``: DP); each group class registers its builder in ``GROUPS``. Adding a
type is a file with its strategy and one ``register`` call (and, for a type that is not
built in, ``ShardingType.declare``); nothing dispatches on the type elsewhere: the
sharded collection finds its group, and the planner (``tetrarec.planner``) reads its
cost terms and candidate block counts, from ``STRATEGIES``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tetrarec.embedding import TableConfig
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.types import ShardingType

if TYPE_CHECKING:
    from tetrarec.sharding.env import ShardingEnv
    from tetrarec.sharding.group import LookupOptions, ShardedGroup

__all__ = [
    "GROUPS",
    "STRATEGIES",
    "CandidateContext",
    "CostTerms",
    "GroupBuilder",
    "PlacementContext",
    "ShardingStrategy",
    "Span",
    "Split",
    "baseline",
    "check_tiling",
    "plan_by_type",
    "register",
    "register_group",
    "split_evenly",
    "strategy_of",
]


@dataclass
class PlacementContext:
    """What placing one table needs: the world and how loaded each rank already is.

    Args:
        world_size: ranks.
        local_world_size: ranks per node.
        column_block: the column-wise block width (``None``: one block per rank of the
            placement, as even as the dim allows).
        loads: bytes placed on each rank so far (updated by the caller).
    """

    world_size: int
    local_world_size: int
    column_block: int | None = None
    loads: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.loads:
            self.loads = [0] * self.world_size

    def least_loaded(self, ranks: Iterable[int]) -> int:
        """The least-loaded rank of ``ranks`` (the lowest on a tie)."""
        return min(ranks, key=lambda r: (self.loads[r], r))

    def least_loaded_node(self) -> int:
        """The node whose ranks hold the fewest bytes (the lowest on a tie)."""
        nodes = range(self.world_size // self.local_world_size)
        return min(nodes, key=lambda n: (sum(self.loads[r] for r in self.node_ranks(n)), n))

    def node_ranks(self, node: int) -> range:
        """The ranks of ``node``."""
        return range(node * self.local_world_size, (node + 1) * self.local_world_size)


class Split(enum.Enum):
    """How a sharding type cuts a table into shards (``CostTerms.split``)."""

    WHOLE = "whole"  # every shard holds every row and column (one, or a copy per rank)
    ROWS = "rows"  # full-width blocks of rows; each pools a partial sum of a bag
    COLUMNS = "columns"  # full-height blocks of columns; each pools its columns of a bag


class Span(enum.Enum):
    """Which ranks a sharding type's shards may sit on (``CostTerms.span``)."""

    WORLD = "world"  # any ranks
    NODE = "node"  # the ranks of one node


@dataclass(frozen=True, slots=True, kw_only=True)
class CostTerms:
    """What the planner prices a sharding type by; it names no type, it reads these.

    With the strategy's ``group`` (latency and routing are paid per group in use), the
    planner's formulas (``tetrarec.planner.cost``) read:

    - ``split``: a shard's size (rows or columns of the table), the ids it looks up
      (``ROWS``: its share of the rows' ids; otherwise every id of the table's
      features), and the output dist: row blocks send full-width partial sums
      (``partial_sums``, a reduce-scatter), other shards their own columns (an
      all-to-all); column blocks share a row-wise optimizer's per-row state
      (``shares_row_state``: the ``split`` group);
    - ``span``: the ranks the search may pick (``WORLD``: the best of all ranks;
      ``NODE``: the best node's ranks);
    - ``replicated``: a whole copy on every rank; its forward pools the rank's own
      samples and moves nothing, its backward all-gathers every rank's ids and output
      gradients and applies the global batch's update (where compute lands: ``b P``
      ids forward, ``B P`` backward); its rows stay in the fast tier (or behind a
      cache there).

    Args:
        label: the short name in plan reports (``"TW"``; column-split types show their
            block count: ``"CW/4"``).
        order: the type's place among a table's candidates (search ties go to the
            earlier candidate, so this order is part of what a plan is).
        split: how the type cuts a table.
        span: which ranks its shards may sit on.
        replicated: a whole copy on every rank (see above).
        baseline: the planner's neutral layout (exactly one registered type): a table's
            least buffers are priced so, and a plan's reason says when a table does not
            fit it in the fast tier. Table-wise: the whole table on one rank.
        lookahead: the planner estimates the work of the tables not yet placed as their
            cheapest over the types that set this (table-wise and row-wise).
        offered: the planner tries the type for every table; ``False``: only for the
            tables whose ``TableSpec.shardings`` names it (a type on trial).

    Raises:
        ValueError: for a replicated type that is not ``Split.WHOLE``, or a negative
            ``order``.
    """

    label: str
    order: int
    split: Split
    span: Span = Span.WORLD
    replicated: bool = False
    baseline: bool = False
    lookahead: bool = False
    offered: bool = True

    def __post_init__(self) -> None:
        if self.replicated and self.split is not Split.WHOLE:
            raise ValueError(f"cost terms {self.label}: a replicated type holds whole tables")
        if self.order < 0:
            raise ValueError(f"cost terms {self.label}: order must be >= 0, got {self.order}")

    @property
    def partial_sums(self) -> bool:
        """Whether a shard sends full-width partial sums (row blocks: a reduce-scatter)."""
        return self.split is Split.ROWS

    @property
    def shares_row_state(self) -> bool:
        """Whether the blocks share a row-wise optimizer's per-row state (column blocks)."""
        return self.split is Split.COLUMNS


@dataclass(frozen=True, slots=True, kw_only=True)
class CandidateContext:
    """What a strategy needs to say into how many blocks it may cut one table.

    Args:
        rows: the table's rows.
        dim: its dim.
        table_bytes: its weights and optimizer state at its preferred precision.
        world_size: ranks.
        local_world_size: ranks per node.
    """

    rows: int
    dim: int
    table_bytes: int
    world_size: int
    local_world_size: int

    @property
    def nodes(self) -> int:
        """Nodes in the world."""
        return self.world_size // self.local_world_size


class ShardingStrategy(Protocol):
    """One sharding type (see the module docstring)."""

    sharding_type: ShardingType

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """The shards of ``table`` in the world of ``ctx``."""
        ...

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """Raise ``ValueError`` if ``plan`` breaks the type's rules for ``table``."""
        ...

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """The shard counts the planner may try for the table of ``ctx`` (none: empty).

        Each count is one candidate: ``ROWS``/``COLUMNS`` types cut the table into that
        many blocks, a replicated type puts that many copies (the world size), others
        one whole shard (``(1,)``).
        """
        ...

    #: The key in ``GROUPS`` of the group that runs the type's tables.
    group: str
    #: What the planner prices the type by.
    cost: CostTerms


STRATEGIES: dict[ShardingType, ShardingStrategy] = {}

#: Builds the group running some tables on this rank: (env, tables with plans, options).
GroupBuilder = Callable[
    ["ShardingEnv", Sequence[tuple[TableConfig, TablePlan]], "LookupOptions"], "ShardedGroup"
]
GROUPS: dict[str, GroupBuilder] = {}


def register_group(key: str, builder: GroupBuilder) -> None:
    """Add a group builder to ``GROUPS`` under ``key``."""
    GROUPS[key] = builder


def register(strategy: ShardingStrategy) -> None:
    """Add ``strategy`` to ``STRATEGIES`` under its type.

    Raises:
        ValueError: if its cost terms claim the baseline that another type holds.
    """
    kind = strategy.sharding_type
    if strategy.cost.baseline:
        held = [t.value for t, s in STRATEGIES.items() if s.cost.baseline and t is not kind]
        if held:
            raise ValueError(
                f"{kind.value}: the planner's baseline type is {held[0]} already; one only"
            )
    STRATEGIES[kind] = strategy


def strategy_of(kind: ShardingType, table: str) -> ShardingStrategy:
    """The registered strategy of ``kind``, which ``table`` is planned by.

    Raises:
        ValueError: naming the table and the type, if no strategy is registered for it
            (a type declared by a plug-in that never registered its strategy).
    """
    strategy = STRATEGIES.get(kind)
    if strategy is None:
        known = ", ".join(k.value for k in STRATEGIES)
        raise ValueError(
            f"table {table!r}: no sharding strategy is registered for type {kind.value!r} "
            f"(registered: {known})"
        )
    return strategy


def baseline() -> ShardingStrategy:
    """The registered strategy whose cost terms are the planner's baseline (table-wise).

    Raises:
        LookupError: if none is registered.
    """
    for strategy in STRATEGIES.values():
        if strategy.cost.baseline:
            return strategy
    raise LookupError("no registered sharding strategy is the planner's baseline")


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` ranges tiling ``[0, total)``; the first ``total % parts`` get one more.

    >>> split_evenly(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append((start, start + size))
        start += size
    return out


def check_tiling(name: str, ranges: Sequence[tuple[int, int]], total: int, what: str) -> None:
    """Raise ``ValueError`` unless ``ranges`` tile ``[0, total)`` exactly once."""
    edges = sorted(ranges)
    pos = 0
    for lo, hi in edges:
        if lo != pos or hi <= lo:
            raise ValueError(
                f"table {name!r}: the shards' {what} {edges} do not tile [0, {total}) exactly once"
            )
        pos = hi
    if pos != total:
        raise ValueError(
            f"table {name!r}: the shards' {what} {edges} do not tile [0, {total}) exactly once"
        )


def plan_by_type(
    tables: Sequence[TableConfig],
    types: ShardingType | Sequence[ShardingType],
    *,
    world_size: int,
    local_world_size: int | None = None,
    column_block: int | None = None,
) -> ShardingPlan:
    """A plan placing each table by its sharding type, balancing bytes over ranks.

    Tables are placed largest first (ties in table order); a table-wise table goes to the
    least-loaded rank, a table-row-wise or table-column-wise table to the least-loaded
    node. The result is deterministic. The planner makes better plans; this one is what a
    config's ``[sharding] type`` asks for.

    Args:
        tables: the tables, in collection order.
        types: one type for every table, or one per table.
        world_size: ranks.
        local_world_size: ranks per node (default: all on one node).
        column_block: column-wise block width (default: one block per rank).

    Raises:
        ValueError: for a wrong number of types, or a block that does not divide a dim.
    """
    local = local_world_size or world_size
    per_table = [types] * len(tables) if isinstance(types, ShardingType) else list(types)
    if len(per_table) != len(tables):
        raise ValueError(f"{len(per_table)} sharding types for {len(tables)} tables")
    ctx = PlacementContext(world_size, local, column_block)
    placed: dict[str, TablePlan] = {}
    order = sorted(
        range(len(tables)),
        key=lambda i: (-tables[i].num_embeddings * tables[i].precision.row_bytes(tables[i].dim), i),
    )
    for i in order:
        t, kind = tables[i], per_table[i]
        shards = strategy_of(kind, t.name).place(t, ctx)
        for s in shards:
            ctx.loads[s.rank] += s.num_rows * t.precision.row_bytes(s.dim)
        placed[t.name] = TablePlan(table=t.name, sharding=kind, shards=shards)
    plan = ShardingPlan(
        world_size=world_size,
        local_world_size=local,
        tables=tuple(placed[t.name] for t in tables),
    )
    plan.validate(tables)
    return plan
