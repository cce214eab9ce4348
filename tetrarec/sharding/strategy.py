"""``ShardingStrategy``: one per sharding type, in its own file, registered by type.

A strategy knows three things about its type::

    place(table, ctx)          the shards of a table (used to make a plan from types)
    validate(table, plan, ..)  whether a table's shards obey the type's rules
    group                      the group whose input dist -> lookup -> output dist runs
                               the type's tables on a rank

Types whose tables move the same way share a group: whole tables and column blocks
(``"block"``: TW, CW, TWCW), row blocks (``"row"``: RW, TWRW) and replicated tables
(``"replicated"``: DP); each group class registers its builder in ``GROUPS``. Adding a
type is a file with its strategy and one ``register`` call; nothing dispatches on the
type elsewhere.
"""

from __future__ import annotations

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
    "GroupBuilder",
    "PlacementContext",
    "ShardingStrategy",
    "check_tiling",
    "plan_by_type",
    "register",
    "register_group",
    "split_evenly",
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


class ShardingStrategy(Protocol):
    """One sharding type (see the module docstring)."""

    sharding_type: ShardingType

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """The shards of ``table`` in the world of ``ctx``."""
        ...

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """Raise ``ValueError`` if ``plan`` breaks the type's rules for ``table``."""
        ...

    #: The key in ``GROUPS`` of the group that runs the type's tables.
    group: str


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
    """Add ``strategy`` to ``STRATEGIES`` under its type."""
    STRATEGIES[strategy.sharding_type] = strategy


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
        shards = STRATEGIES[kind].place(t, ctx)
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
