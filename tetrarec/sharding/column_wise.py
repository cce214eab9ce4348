"""Column-wise (CW): each table split into blocks of columns, each block on one rank.

A block is pooled whole on its rank (every id of the bag, its columns only), so the
moving parts are those of table-wise tables (``table_wise.BlockGroup``): the feature's
ids go to every rank holding a block, and the pooled blocks come back to be put side
by side. Blocks may have different widths and one rank may hold several (adjacent
blocks on a rank are merged into one local table).

Worked example, dim 64 in blocks of 16 over 2 ranks: blocks [0,16) [16,32) go to the
less-loaded rank, [32,48) [48,64) to the other; each rank holds one local table of 32
columns; rank r's samples get columns 0-31 from one rank and 32-63 from the other.

Row-wise optimizers keep one value per row for the whole row (the mean of the squared
gradient over *all* columns); the block group adds the other blocks' share of that mean
before each update (see ``BlockGroup``), so the state equals the unsharded table's.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetrarec.embedding import TableConfig
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.strategy import (
    CandidateContext,
    CostTerms,
    PlacementContext,
    Split,
    check_tiling,
    register,
    split_evenly,
)
from tetrarec.types import ShardingType

__all__ = [
    "CANDIDATE_BLOCKS",
    "MIN_BLOCK_COLUMNS",
    "ColumnWise",
    "column_shards",
    "validate_column_blocks",
]

#: The column block counts the planner tries for a column-wise table.
CANDIDATE_BLOCKS = (2, 4, 8, 16)
#: The narrowest column block the planner makes (narrower ones cost more than they balance).
MIN_BLOCK_COLUMNS = 16


def column_shards(table: TableConfig, ranks: Sequence[int], block: int | None) -> tuple[Shard, ...]:
    """``table``'s columns in blocks of ``block`` (default: one per rank) over ``ranks``.

    Consecutive blocks go to the same rank (``ranks[0]`` first), so each rank holds one
    run of adjacent columns.

    Raises:
        ValueError: if ``block`` does not divide the dim.
    """
    if block is not None and (block <= 0 or table.dim % block):
        raise ValueError(
            f"table {table.name!r}: the column block size {block} does not divide its dim "
            f"{table.dim}"
        )
    edges = (
        [(c, c + block) for c in range(0, table.dim, block)]
        if block is not None
        else split_evenly(table.dim, min(len(ranks), table.dim))
    )
    chunks = split_evenly(len(edges), min(len(ranks), len(edges)))
    rows = (0, table.num_embeddings)
    return tuple(
        Shard(rank=rank, rows=rows, cols=c)
        for rank, (lo, hi) in zip(ranks, chunks)
        for c in edges[lo:hi]
    )


def validate_column_blocks(table: TableConfig, plan: TablePlan) -> None:
    """Every block holds all rows; the blocks tile the columns.

    Raises:
        ValueError: otherwise.
    """
    if any(s.rows != (0, table.num_embeddings) for s in plan.shards):
        raise ValueError(
            f"table {table.name!r}: {plan.sharding.value} shards hold every row "
            f"[0, {table.num_embeddings}), got {plan.shards}"
        )
    check_tiling(table.name, [s.cols for s in plan.shards], table.dim, "columns")


class ColumnWise:
    """The column-wise strategy."""

    sharding_type = ShardingType.COLUMN_WISE
    group = "block"  # runs in the block group
    cost = CostTerms(label="CW", order=2, split=Split.COLUMNS)

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """The ``CANDIDATE_BLOCKS`` counts the world and the dim allow.

        At most one block per rank, equal blocks of ``MIN_BLOCK_COLUMNS`` columns or more.
        """
        return tuple(
            k
            for k in CANDIDATE_BLOCKS
            if k <= ctx.world_size and ctx.dim % k == 0 and ctx.dim // k >= MIN_BLOCK_COLUMNS
        )

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """Blocks over the ranks, least loaded first."""
        ranks = sorted(range(ctx.world_size), key=lambda r: (ctx.loads[r], r))
        return column_shards(table, ranks, ctx.column_block)

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """Full-height blocks tiling the columns.

        Raises:
            ValueError: otherwise.
        """
        validate_column_blocks(table, plan)


register(ColumnWise())
