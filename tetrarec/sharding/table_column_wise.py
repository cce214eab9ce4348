"""Table-column-wise (TWCW): a table placed on one node, split by columns over its ranks.

The column blocks of a column-wise table, kept on the ranks of one node; it runs in the
block group with table-wise and column-wise tables (``table_wise.BlockGroup``).

Worked example, 2 nodes x 2 ranks, dim 8 placed on node 0: rank 0 holds columns [0, 4),
rank 1 columns [4, 8); ranks 2 and 3 send their ids to both and get both halves back.
"""

from __future__ import annotations

from tetrarec.embedding import TableConfig
from tetrarec.sharding.column_wise import column_shards, validate_column_blocks
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.strategy import PlacementContext, register
from tetrarec.sharding.table_row_wise import check_one_node
from tetrarec.types import ShardingType

__all__ = ["TableColumnWise"]


class TableColumnWise:
    """The table-column-wise strategy."""

    sharding_type = ShardingType.TABLE_COLUMN_WISE
    group = "block"  # runs in the block group

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """Column blocks over the ranks of the least-loaded node."""
        return column_shards(table, list(ctx.node_ranks(ctx.least_loaded_node())), ctx.column_block)

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """Column blocks on one node.

        Raises:
            ValueError: otherwise.
        """
        validate_column_blocks(table, plan)
        check_one_node(table, plan, whole)


register(TableColumnWise())
