"""Table-wise (TW): each table whole on one rank.

A table-wise table is one block holding every row and column; it runs in the block group
with column-wise tables (``block_group.BlockGroup``, whose docstring has the worked
example): the table's ids go to its rank, which pools whole bags and sends the pooled
rows back with an all-to-all.
"""

from __future__ import annotations

from tetrarec.embedding import TableConfig
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.strategy import (
    CandidateContext,
    CostTerms,
    PlacementContext,
    Split,
    register,
)
from tetrarec.types import ShardingType

__all__ = ["TableWise"]


class TableWise:
    """The table-wise strategy: placement, validation, the group it runs in."""

    sharding_type = ShardingType.TABLE_WISE
    group = "block"  # runs in the block group
    cost = CostTerms(label="TW", order=0, split=Split.WHOLE, baseline=True, lookahead=True)

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """One whole shard, in any world."""
        return (1,)

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """The whole table on the least-loaded rank."""
        rank = ctx.least_loaded(range(ctx.world_size))
        return (Shard(rank=rank, rows=(0, table.num_embeddings), cols=(0, table.dim)),)

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """One shard covering the whole table.

        Raises:
            ValueError: otherwise.
        """
        full = ((0, table.num_embeddings), (0, table.dim))
        if len(plan.shards) != 1 or (plan.shards[0].rows, plan.shards[0].cols) != full:
            raise ValueError(
                f"table {table.name!r}: a table-wise table is one shard of rows "
                f"[0, {table.num_embeddings}) and columns [0, {table.dim}), got {plan.shards}"
            )


register(TableWise())
