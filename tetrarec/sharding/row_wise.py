"""Row-wise (RW): each table split by rows over every rank; partial sums reduced back.

Rank ``k`` of ``W`` holds rows ``split_evenly(rows, W)[k]`` of every row-wise table (the
first ``rows % W`` ranks hold one extra row). ``RowGroup`` also runs table-row-wise
tables, whose row blocks sit on the ranks of one node only::

    input dist    each id goes to the rank whose rows hold it, as a local row
                  (id - first row of that block); a bag is split into one piece per
                  rank, possibly empty
    lookup        the local fused kernels sum each piece (row blocks always sum)
    output dist   the partial sums go back to the samples' owner, which adds them in
                  rank order (a reduce-scatter; an all-to-all plus sum where the ranks
                  hold different tables); mean pooling divides by the whole bag's length

Worked example (a table of 10 rows over 3 ranks): rank 0 owns rows [0, 4), rank 1
[4, 7), rank 2 [7, 10). A bag {2, 5, 9} on rank 0 is bucketized into {2} for rank 0,
{5 - 4 = 1} for rank 1 and {9 - 7 = 2} for rank 2; each rank pools its piece, and the
reduce-scatter sums the three partial vectors back on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tetrarec.comm import Handle
from tetrarec.embedding import TableConfig
from tetrarec.sharding.env import ShardingEnv
from tetrarec.sharding.group import LocalShard, LookupOptions, ShardedGroup
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.routing import Outgoing, Routed, route_features, send_pooled
from tetrarec.sharding.strategy import (
    CandidateContext,
    CostTerms,
    PlacementContext,
    Split,
    check_tiling,
    register,
    register_group,
    split_evenly,
)
from tetrarec.sparse import SparseFeatures
from tetrarec.types import PoolingMode, ShardingType

__all__ = ["RowGroup", "RowWise", "row_shards", "validate_row_blocks"]


def row_shards(table: TableConfig, ranks: Sequence[int]) -> tuple[Shard, ...]:
    """``table`` split by rows over ``ranks`` (see the module docstring).

    A table with fewer rows than ranks is split over its first ``rows`` ranks.
    """
    parts = min(len(ranks), table.num_embeddings)
    return tuple(
        Shard(rank=r, rows=rows, cols=(0, table.dim))
        for r, rows in zip(ranks, split_evenly(table.num_embeddings, parts))
    )


def validate_row_blocks(table: TableConfig, plan: TablePlan) -> None:
    """Full-width blocks tiling the rows, at most one per rank.

    Raises:
        ValueError: otherwise.
    """
    if any(s.cols != (0, table.dim) for s in plan.shards):
        raise ValueError(
            f"table {table.name!r}: {plan.sharding.value} shards hold every column "
            f"[0, {table.dim}), got {plan.shards}"
        )
    if len(plan.ranks()) != len(plan.shards):
        raise ValueError(f"table {table.name!r}: a rank holds two row blocks: {plan.shards}")
    check_tiling(table.name, [s.rows for s in plan.shards], table.num_embeddings, "rows")


class RowGroup(ShardedGroup):
    """Row blocks (RW, TWRW): see the module docstring."""

    def __init__(
        self,
        env: ShardingEnv,
        tables: Sequence[tuple[TableConfig, TablePlan]],
        options: LookupOptions,
    ) -> None:
        self.label = "row"
        w = env.world_size
        shards_of: list[list[LocalShard]] = [[] for _ in range(w)]
        receives: list[list[str]] = [[] for _ in range(w)]
        bounds: list[tuple[list[int], list[int]]] = []  # per table: (row starts, ranks)
        for t, plan in tables:
            blocks = sorted(plan.shards, key=lambda s: s.rows[0])
            bounds.append(([s.rows[0] for s in blocks], [s.rank for s in blocks]))
            for s in blocks:
                whole = s.rows == (0, t.num_embeddings)
                shards_of[s.rank].append(
                    LocalShard(
                        name=t.name if whole else f"{t.name}@r{s.rows[0]}",
                        table=t,
                        rows=s.rows,
                        cols=s.cols,
                        feature_names=t.feature_names,
                        pooling=PoolingMode.SUM,  # mean divides by the whole bag, later
                    )
                )
                receives[s.rank].extend(t.feature_names)
        super().__init__(env, tables, shards_of[env.rank], options)
        self.receives = [tuple(r) for r in receives]
        self._same_everywhere = all(r == self.feature_names for r in self.receives)
        # Per feature: its table's row starts and their ranks, as tensors on the rank's
        # device, where the ids are bucketized.
        dev = env.device
        self._starts = [
            torch.tensor(b[0], device=dev)
            for b, t in zip(bounds, self.tables)
            for _ in t.feature_names
        ]
        self._ranks = [
            torch.tensor(b[1], device=dev)
            for b, t in zip(bounds, self.tables)
            for _ in t.feature_names
        ]
        self._pos = [{f: i for i, f in enumerate(r)} for r in self.receives]
        # The same, flat over the features, for one vectorized bucketization of all ids:
        # feature i's row starts become i * span + start (one sorted array), and
        # unit[i, q] * b is where feature i's bags start in what rank q receives.
        rows = [t.num_embeddings for t in self.tables for _ in t.feature_names]
        self._span = max(rows, default=1) + 1
        nf = len(rows)
        self._flat_keys = torch.cat(
            [i * self._span + st for i, st in enumerate(self._starts)]
        ) if nf else torch.zeros(0, dtype=torch.int64, device=dev)  # fmt: skip
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        self._flat_starts = torch.cat(self._starts) if nf else empty
        self._flat_ranks = torch.cat(self._ranks) if nf else empty
        self._rows = torch.tensor(rows, dtype=torch.int64, device=dev)
        before = [sum(len(r) for r in self.receives[:q]) for q in range(w)]
        self._unit = torch.tensor(
            [[before[q] + self._pos[q].get(f, 0) for q in range(w)] for f in self.feature_names],
            dtype=torch.int64,
            device=dev,
        ).reshape(nf, w)
        self.dims = [
            sum(t.dim for t in self.tables for f in t.feature_names if f in set(r))
            for r in self.receives
        ]
        col = 0
        start_of = {}
        for f, d in zip(self.feature_names, self.feature_dims):
            start_of[f] = col
            col += d
        self._cols = [
            torch.tensor(
                [
                    start_of[f] + c
                    for f in r
                    for c in range(self.feature_dims[self.feature_names.index(f)])
                ],
                dtype=torch.int64,
                device=dev,
            )
            for r in self.receives
        ]
        self._mean = [t.pooling is PoolingMode.MEAN for t in self.tables for _ in t.feature_names]

    def input_dist(self, features: SparseFeatures) -> Handle[Routed]:
        """Bucketize every id by the row block holding it; send each block its ids."""
        w, b = self.env.world_size, features.batch_size
        counts = features.value_counts_host()
        lens2d = features.lengths_2d()
        seg_base = [0]
        for q in range(w):
            seg_base.append(seg_base[-1] + len(self.receives[q]) * b)
        bad = self.bad_id(features)
        nf = len(self.feature_names)
        v = features.values.long()
        # Per id: its feature, its sample, and the row block holding it (all features in
        # one pass; bad ids are clamped here, reported below, never sent).
        dev = v.device
        fidx = torch.repeat_interleave(
            torch.arange(nf, device=dev), torch.tensor(counts, dtype=torch.int64, device=dev)
        )
        bag = torch.repeat_interleave(
            torch.arange(nf * b, device=dev) % max(b, 1), lens2d.reshape(-1)
        )
        clamped = torch.minimum(v.clamp(min=0), self._rows[fidx] - 1)
        block = torch.searchsorted(self._flat_keys, fidx * self._span + clamped, right=True) - 1
        dest = self._flat_ranks[block]
        key = self._unit[fidx, dest] * b + bag
        local_ids = v - self._flat_starts[block]
        order = torch.sort(key, stable=True).indices
        ids = local_ids[order]
        lengths = torch.bincount(key, minlength=seg_base[-1])
        weights = features.weights[order] if features.weights is not None else None
        outgoing = []
        lo = 0
        for q in range(w):
            seg = lengths[seg_base[q] : seg_base[q + 1]]
            n = int(seg.sum())
            wts = weights[lo : lo + n] if weights is not None else None
            outgoing.append(Outgoing(seg, ids[lo : lo + n], wts))
            lo += n
        routed = route_features(
            self.env.comm,
            outgoing,
            keys=self.receives[self.env.rank],
            batch_size=b,
            error=bad,
            group_features=self.feature_names,
            label=f"input_dist/{self.label}",
        )
        return routed.then(lambda r: Routed(r.features, r.source_batches, own_lengths=lens2d))

    def output_dist(self, pooled: torch.Tensor, routed: Routed) -> Handle[torch.Tensor]:
        """Partial sums back to the samples' owner, added in rank order."""
        comm = self.env.comm
        label = f"output_dist/{self.label}"
        if self._same_everywhere:
            summed = comm.reduce_scatter_v(pooled, splits=routed.source_batches, label=label)
        else:
            blocks = send_pooled(
                comm, pooled, source_batches=routed.source_batches, dims=self.dims, label=label
            )
            own = routed.source_batches[comm.rank]

            def add(flat: torch.Tensor) -> torch.Tensor:
                parts = torch.split(flat, [own * d for d in self.dims])
                out = flat.new_zeros(own, sum(self.feature_dims))
                for cols, part, d in zip(self._cols, parts, self.dims):
                    if d:
                        out = out.index_add(1, cols, part.view(own, d))
                return out

            summed = blocks.then(add)
        return summed.then(lambda out: self._mean_pool(out, routed.own_lengths))

    def _mean_pool(self, out: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        if not any(self._mean):
            return out
        assert lengths is not None
        divisor = torch.cat(
            [
                (
                    lengths[i].clamp(min=1).to(out.dtype)
                    if m
                    else torch.ones(lengths.shape[1], device=out.device)
                )
                .unsqueeze(1)
                .expand(-1, d)
                for i, (m, d) in enumerate(zip(self._mean, self.feature_dims))
            ],
            dim=1,
        )
        return out / divisor


class RowWise:
    """The row-wise strategy: every table's rows split over all ranks."""

    sharding_type = ShardingType.ROW_WISE
    group = "row"  # runs in the row group
    cost = CostTerms(label="RW", order=1, split=Split.ROWS, lookahead=True)

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """One row block per rank, when there are several ranks and a row for each."""
        w = ctx.world_size
        return (w,) if w > 1 and ctx.rows >= w else ()

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """Rows split evenly over every rank."""
        return row_shards(table, range(ctx.world_size))

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """Full-width row blocks tiling the rows, one per rank at most.

        Raises:
            ValueError: otherwise.
        """
        validate_row_blocks(table, plan)


register_group("row", RowGroup)
register(RowWise())
