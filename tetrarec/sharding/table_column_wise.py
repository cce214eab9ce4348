"""Table-column-wise (TWCW): a table placed on one node, split by columns over its ranks.

The column blocks of a column-wise table, kept on the ranks of one node; it runs in the
block group with table-wise and column-wise tables (``table_wise.BlockGroup``).

Worked example, 2 nodes x 2 ranks, dim 8 placed on node 0: rank 0 holds columns [0, 4),
rank 1 columns [4, 8); ranks 2 and 3 send their ids to both and get both halves back.
"""

from __future__ import annotations

from tetrarec.embedding import TableConfig
from tetrarec.sharding.column_wise import MIN_BLOCK_COLUMNS, column_shards, validate_column_blocks
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.strategy import (
    CandidateContext,
    CostTerms,
    PlacementContext,
    Span,
    Split,
    register,
)
from tetrarec.sharding.table_row_wise import check_one_node
from tetrarec.types import ShardingType

__all__ = ["TableColumnWise"]


class TableColumnWise:
    """The table-column-wise strategy."""

    sharding_type = ShardingType.TABLE_COLUMN_WISE
    group = "block"  # runs in the block group
    cost = CostTerms(label="TWCW", order=5, split=Split.COLUMNS, span=Span.NODE)

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """One column block per rank of a node, on several nodes of several ranks.

        Only where the blocks are equal and ``MIN_BLOCK_COLUMNS`` columns or wider.
        """
        local = ctx.local_world_size
        fits = ctx.dim % local == 0 and ctx.dim // local >= MIN_BLOCK_COLUMNS
        return (local,) if ctx.nodes > 1 and local > 1 and fits else ()

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
