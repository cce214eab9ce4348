"""``BlockGroup``: whole tables and column blocks (TW, CW, TWCW) on the ranks holding them.

A table-wise table is one block holding every row and column; a column-wise table is
several blocks of columns (``column_wise.py``). Both pool whole bags on the rank of the
block, so one group serves both (``BlockGroup``)::

    input dist    each rank sends every feature to each rank holding a block of its
                  table (once per rank, whatever the blocks it holds)
    lookup        the local fused kernels, one local table per run of adjacent blocks
    output dist   an all-to-all of the pooled rows; the receiver puts each block's
                  columns where they belong in the feature's embedding

Worked example, 2 ranks, batch 1 per rank, table "t" (dim 4, feature "f") table-wise on
rank 0, table "u" (dim 4, feature "g") column-wise, columns [0, 2) on rank 0, [2, 4) on
rank 1::

    R0: f [[1]], g [[7]]              R1: f [[2]], g [[8]]
    input dist:  R0 receives f and g of both ranks: f [[1], [2]], g [[7], [8]]
                 R1 receives g of both ranks: g [[7], [8]]
    lookup:      R0 pools (2, 4 + 2): t[1] | u[7, 0:2] and t[2] | u[8, 0:2]
                 R1 pools (2, 2):     u[7, 2:4] and u[8, 2:4]
    output dist: R0 gets back t[1] | u[7, 0:2] from itself and u[7, 2:4] from R1:
                 f = t[1], g = u[7]; R1 likewise gets f = t[2], g = u[8]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tetrarec.comm import Handle
from tetrarec.embedding import TableConfig
from tetrarec.sharding.env import ShardingEnv
from tetrarec.sharding.group import LocalShard, LookupOptions, ShardedGroup, select_features
from tetrarec.sharding.plan import TablePlan
from tetrarec.sharding.routing import (
    BlockColumns,
    Outgoing,
    Routed,
    place_columns,
    route_features,
    send_pooled,
)
from tetrarec.sharding.strategy import register_group
from tetrarec.sparse import SparseFeatures
from tetrarec.types import OptimizerKind

__all__ = ["BlockGroup", "runs_by_rank"]


def runs_by_rank(plan: TablePlan) -> dict[int, list[tuple[int, int]]]:
    """Each rank's column runs of a table: its blocks, adjacent ones merged, by column."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in sorted(plan.shards, key=lambda s: s.cols[0]):
        runs = out.setdefault(s.rank, [])
        if runs and runs[-1][1] == s.cols[0]:
            runs[-1] = (runs[-1][0], s.cols[1])
        else:
            runs.append(s.cols)
    return out


def _global(local_feature: str) -> str:
    """The global feature of a local feature name (``f`` or ``f#k`` for the k-th run)."""
    return local_feature.split("#")[0]


def _local_name(table: str, k: int, cols: tuple[int, int], dim: int) -> str:
    return table if cols == (0, dim) else f"{table}@c{cols[0]}"


class BlockGroup(ShardedGroup):
    """Whole tables and column blocks (TW, CW, TWCW): see the module docstring."""

    def __init__(
        self,
        env: ShardingEnv,
        tables: Sequence[tuple[TableConfig, TablePlan]],
        options: LookupOptions,
    ) -> None:
        self.label = "block"
        w = env.world_size
        # Per rank: its local tables (runs) and the global features it receives.
        shards_of: list[list[LocalShard]] = [[] for _ in range(w)]
        receives: list[list[str]] = [[] for _ in range(w)]
        for t, plan in tables:
            for rank, runs in sorted(runs_by_rank(plan).items()):
                for k, cols in enumerate(runs):
                    names = tuple(f if k == 0 else f"{f}#{k}" for f in t.feature_names)
                    shards_of[rank].append(
                        LocalShard(
                            name=_local_name(t.name, k, cols, t.dim),
                            table=t,
                            rows=(0, t.num_embeddings),
                            cols=cols,
                            feature_names=names,
                            pooling=t.pooling,
                        )
                    )
                receives[rank].extend(f for f in t.feature_names if f not in receives[rank])
        self._across = RowwiseAcrossBlocks(env, tables, shards_of[env.rank], options)
        super().__init__(env, tables, shards_of[env.rank], options)
        self.receives = [tuple(r) for r in receives]
        index = {f: i for i, f in enumerate(self.feature_names)}
        self._send_index = [[index[f] for f in r] for r in self.receives]
        mine = self.receives[env.rank]
        self._local_index = [mine.index(_global(f)) for s in self.shards for f in s.feature_names]
        self._local_keys = [f for s in self.shards for f in s.feature_names]
        # Columns: what each rank's pooled block holds, and where each goes in the output
        # (feature f's column c sits at start[f] + c).
        start, col = {}, 0
        for f, d in zip(self.feature_names, self.feature_dims):
            start[f] = col
            col += d
        self.dims: list[int] = []
        placement = []
        for rank in range(w):
            dst = [
                start[_global(f)] + c
                for s in shards_of[rank]
                for f in s.feature_names
                for c in range(*s.cols)
            ]
            self.dims.append(len(dst))
            placement.append(BlockColumns.from_columns(dst))
        self._placement = tuple(placement)

    def input_dist(self, features: SparseFeatures) -> Handle[Routed]:
        """Send every rank the features of the blocks it holds."""
        outgoing = []
        for q in range(self.env.world_size):
            sel = select_features(features, self._send_index[q], self.receives[q])
            outgoing.append(Outgoing(sel.lengths, sel.values, sel.weights))
        return route_features(
            self.env.comm,
            outgoing,
            keys=self.receives[self.env.rank],
            batch_size=features.batch_size,
            error=self.bad_id(features),
            group_features=self.feature_names,
            label=f"input_dist/{self.label}",
        )

    def lookup(self, routed: Routed) -> torch.Tensor:
        """The local kernels' pooled rows; row-wise state shared across column blocks."""
        pooled = super().lookup(routed)
        if not self._across.needed:
            return pooled
        features = self.local_features(routed.features) if self.local is not None else None
        out = _AcrossBlocks.apply(pooled, self, features)  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
        assert isinstance(out, torch.Tensor)
        return out

    def local_features(self, received: SparseFeatures) -> SparseFeatures:
        """One copy of a feature per run of its table on this rank."""
        return select_features(received, self._local_index, self._local_keys)

    def output_dist(self, pooled: torch.Tensor, routed: Routed) -> Handle[torch.Tensor]:
        """All-to-all of pooled rows; columns reassembled in feature order."""
        blocks = send_pooled(
            self.env.comm,
            pooled,
            source_batches=routed.source_batches,
            dims=self.dims,
            label=f"output_dist/{self.label}",
        )

        own = routed.source_batches[self.env.rank]
        total = sum(self.feature_dims)
        return blocks.then(lambda flat: place_columns(flat, own, self._placement, total))


class RowwiseAcrossBlocks:
    """Row-wise optimizer state of column-split tables, equal to the unsharded table's.

    Row-wise Adagrad adds ``mean_d(g'_d^2)`` over the *whole* row to its one value per
    row (row-wise Adam mixes it into its second moment), but each column block sees only
    its own columns. Before the kernels update, each rank holding blocks of a split
    table computes its blocks' share ``S_q = sum_d g'_d^2`` for every touched row (the
    same rows on every holder: each gets every id of the table's features), the holders
    exchange the shares (one all-to-all), and each adds to its row state what the
    kernel's own block-local term will miss::

        row-wise Adagrad:  s <- s + S_all / D - S_block / D_block
        row-wise Adam:     v <- v + (1 - beta2) / beta2 * (S_all / D - S_block / D_block)

    after which the kernel's update leaves ``s + S_all / D`` (resp. the Adam moment of
    the whole row), as one process would (within rounding: the shares are summed in
    rank order, not in column order).

    Args:
        env: where it runs.
        tables: the group's tables and plans.
        mine: this rank's local shards.
        options: the optimizer.

    Raises:
        ValueError: for row-wise Adam with beta2 = 0 on a column-split table.
    """

    def __init__(
        self,
        env: ShardingEnv,
        tables: Sequence[tuple[TableConfig, TablePlan]],
        mine: Sequence[LocalShard],
        options: LookupOptions,
    ) -> None:
        kind = options.optimizer.kind
        rowwise = kind in (OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ROWWISE_ADAM)
        holders = {t.name: plan.ranks() for t, plan in tables if len(plan.shards) > 1}
        self.needed = rowwise and bool(holders)
        self.env = env
        self.kind = kind
        self.weight_decay = options.optimizer.weight_decay
        self.beta2 = options.optimizer.beta2
        if self.needed and kind is OptimizerKind.ROWWISE_ADAM and self.beta2 <= 0:
            raise ValueError("row-wise Adam on column-split tables needs beta2 > 0")
        self.dims = {t.name: t.dim for t, _ in tables}
        self.holders = holders
        #: Per split table this rank holds: the indices of its local tables.
        self.local_runs: dict[str, list[int]] = {}
        for i, s in enumerate(mine):
            if s.table.name in holders:
                self.local_runs.setdefault(s.table.name, []).append(i)
        #: Per rank q: the split tables both q and this rank hold, in table order.
        self.shared = [
            [t for t in self.local_runs if q in holders[t]] for q in range(env.world_size)
        ]

    def adjust(
        self, group: BlockGroup, grad: torch.Tensor, features: SparseFeatures | None
    ) -> None:
        """Add the other blocks' share to the row state of this step's touched rows.

        Each local block's share comes from the local module's ``row_gradient_shares``
        (``tetrarec.kernels.LocalLookup``; for the fused collection one
        ``tetrarec::tbe_row_gradient_shares`` call: the sum of squares the kernel's own
        row-wise update of the block adds, bitwise; a cached one reports each row from
        the part that holds it), and the delta goes to ``add_to_row_state_`` (a cached
        row's state where it lives, slot or backing store). The batch is prepared again,
        read-only (``admit=False``): the forward's admissions are done, so it takes the
        slots the forward's lookup and the coming update use (and a cached backward
        checks that no later forward moved its rows).
        """
        local = group.local
        shares: dict[str, torch.Tensor] = {}
        runs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # local table -> (rows, S)
        if local is not None and features is not None:
            prepared = local.prepare(features, admit=False)
            for name, indices in self.local_runs.items():
                total = None
                for i in indices:
                    # One compiled pass per block (per part of a cached block): the
                    # backward's own sort and sums, the squares added as its row-wise
                    # rule adds them.
                    rows, share = local.row_gradient_shares(i, grad, prepared, self.weight_decay)
                    runs[i] = (rows, share)  # (U,), (U,)
                    total = share if total is None else total + share
                assert total is not None
                shares[name] = total
        comm = self.env.comm
        send = [
            torch.cat([shares[t] for t in ts]) if ts else grad.new_zeros(0) for ts in self.shared
        ]
        splits = [int(x.numel()) for x in send]
        got = comm.all_to_all_v(
            torch.cat(send), send_splits=splits, recv_splits=splits, label="backward/rowwise_blocks"
        ).wait()
        every: dict[str, torch.Tensor] = {}
        for q, piece in enumerate(torch.split(got, splits)):  # rank order: fixed sum order
            offset = 0
            for t in self.shared[q]:
                n = shares[t].numel()
                part = piece[offset : offset + n]
                every[t] = part if t not in every else every[t] + part
                offset += n
        if local is None:
            return
        key = "sum" if self.kind is OptimizerKind.ROWWISE_ADAGRAD else "exp_avg_sq"
        for name, indices in self.local_runs.items():
            for i in indices:
                rows, share = runs[i]
                d_block = local.tables[i].dim
                delta = every[name] / self.dims[name] - share / d_block
                if self.kind is OptimizerKind.ROWWISE_ADAM:
                    delta = delta * ((1.0 - self.beta2) / self.beta2)
                local.add_to_row_state_(i, key, rows, delta)


class _AcrossBlocks(torch.autograd.Function):
    """Identity forward; backward shares row-wise state across column blocks first."""

    @staticmethod
    def forward(
        ctx: Any, pooled: torch.Tensor, group: BlockGroup, features: SparseFeatures | None
    ) -> torch.Tensor:
        ctx.group, ctx.features = group, features
        return pooled.view_as(pooled)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.group._across.adjust(ctx.group, grad.contiguous(), ctx.features)
        return grad, None, None


register_group("block", BlockGroup)
