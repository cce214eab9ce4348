"""Table-row-wise (TWRW): a table placed on one node, split by rows over its ranks.

On a topology of nodes x local ranks (torchrun's ``LOCAL_WORLD_SIZE``), the table's ids
only travel to the ranks of its node. It runs in the row group (``row_wise.RowGroup``):
ids are bucketized by row block exactly as for row-wise tables, and the partial sums come
back with an all-to-all plus a rank-order sum. (A cluster implementation would reduce
inside the node first; here the one flat all-to-all carries the same bytes.)

Worked example, 2 nodes x 2 ranks, a table of 10 rows placed on node 1: rank 2 holds rows
[0, 5), rank 3 rows [5, 10); ranks 0 and 1 hold none of it and send every id of its
features to ranks 2 and 3.
"""

from __future__ import annotations

from tetrarec.embedding import TableConfig
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.row_wise import row_shards, validate_row_blocks
from tetrarec.sharding.strategy import (
    CandidateContext,
    CostTerms,
    PlacementContext,
    Span,
    Split,
    register,
)
from tetrarec.types import ShardingType

__all__ = ["TableRowWise", "check_one_node"]


def check_one_node(table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
    """Every shard on the ranks of one node.

    Raises:
        ValueError: otherwise.
    """
    nodes = {s.rank // whole.local_world_size for s in plan.shards}
    if len(nodes) != 1:
        raise ValueError(
            f"table {table.name!r}: {plan.sharding.value} shards must sit on one node of "
            f"{whole.local_world_size} ranks, got ranks {sorted(s.rank for s in plan.shards)}"
        )


class TableRowWise:
    """The table-row-wise strategy."""

    sharding_type = ShardingType.TABLE_ROW_WISE
    group = "row"  # runs in the row group
    cost = CostTerms(label="TWRW", order=4, split=Split.ROWS, span=Span.NODE)

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """One row block per rank of a node, on several nodes of several ranks."""
        local = ctx.local_world_size
        return (local,) if ctx.nodes > 1 and local > 1 and ctx.rows >= local else ()

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """Rows split over the ranks of the least-loaded node."""
        return row_shards(table, ctx.node_ranks(ctx.least_loaded_node()))

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """Row blocks on one node.

        Raises:
            ValueError: otherwise.
        """
        validate_row_blocks(table, plan)
        check_one_node(table, plan, whole)


register(TableRowWise())
