"""Data-parallel (DP): every rank holds the whole table; each update is the global batch's.

Forward moves nothing: each rank pools its own samples. Backward must leave every
replica with the same rows as one process training on the global batch, so each rank
gathers every rank's ids and pooled-output gradients and applies the fused update of
the *global* batch (ids key-major over all samples, in rank order: the one-process
layout, so the rows equal it bit for bit)::

    R0: f [[1]], grad g0        R1: f [[1, 2]], grad g1
    backward on both ranks: ids f [[1], [1, 2]], grads [g0; g1] -> the same update of
    rows 1 and 2 on both replicas (row 1 gets g0 + g1, summed in sample order)

This all-gathers B x (ids + D) values per table instead of all-reducing a dense
rows x D gradient, and never materializes a table-sized gradient; it suits the small,
hot tables data parallelism is for. The ids are gathered from the input dist on.

The replica runs through ``tetrarec.kernels.LocalLookup`` whatever module it is: a
training forward waits for the gathered ids and prepares the *global* batch
(``prepare(every, admit=training)``), pools its own samples
(``pooled_lookup(prepare(own, admit=False))``), and backward applies the global batch's
update with the global ``PreparedIds``. For the fused collection preparing changes
nothing. A cached replica (plan placement ``cached`` or ``ssd``) runs its policy step in
that forward, on the global batch (hits, misses, evictions with write-back,
admissions, all counted as one process counts them), so every replica makes the one
process's cache decisions and holds the same slots; it pools its own samples through
that slot map, and backward updates through the global route::

    R0: f [[1]]                 R1: f [[1, 2]]          (a cache of 1 slot, empty)
    forward on both ranks: policy step on f [[1], [1, 2]] -> row 1 admitted
        (2 lookups of row 1 first, row 2 once: misses 3); R0 pools slot 0, R1 pools
        slot 0 + row 2 from the backing store
    backward on both ranks: the global update; row 1 trains in FP32 in its slot

Evaluation (no grad) reads the caches without changing them, as one process does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tetrarec.comm import Handle
from tetrarec.embedding import TableConfig
from tetrarec.kernels import PreparedIds
from tetrarec.sharding.env import ShardingEnv
from tetrarec.sharding.group import LocalShard, LookupOptions, ShardedGroup
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlan
from tetrarec.sharding.routing import Routed, regroup_key_major
from tetrarec.sharding.strategy import (
    CandidateContext,
    CostTerms,
    PlacementContext,
    Split,
    register,
    register_group,
)
from tetrarec.sparse import SparseFeatures
from tetrarec.types import ShardingType

__all__ = ["DP_MAX_BYTES", "DataParallel", "ReplicatedGroup"]

#: The largest table (weights + state) the planner tries to replicate on every rank.
DP_MAX_BYTES = 16 * 2**20


class ReplicatedGroup(ShardedGroup):
    """Replicated tables (DP): see the module docstring."""

    def __init__(
        self,
        env: ShardingEnv,
        tables: Sequence[tuple[TableConfig, TablePlan]],
        options: LookupOptions,
    ) -> None:
        local = [
            LocalShard(
                name=t.name,
                table=t,
                rows=(0, t.num_embeddings),
                cols=(0, t.dim),
                feature_names=t.feature_names,
                pooling=t.pooling,
            )
            for t, _ in tables
        ]
        super().__init__(env, tables, local, options)
        # an input of every lookup that requires grad, so that its backward always runs
        self._anchor = torch.empty(0, requires_grad=True)

    def input_dist(self, features: SparseFeatures) -> Handle[Routed]:
        """Nothing moves; sizes and bad ids are shared, and (training) ids gathered."""
        comm = self.env.comm
        bad = self.bad_id(features) or (-1, -1)
        n = int(features.values.numel())
        info = torch.tensor([[features.batch_size, n, bad[0], bad[1]]], dtype=torch.int64)
        sizes = comm.all_gather_v(info, sizes=[1] * comm.world_size, label="input_dist/replicated")
        every = torch.cat(sizes.wait())  # (W, 4)
        for s in range(comm.world_size):
            f, bad_id = int(every[s, 2]), int(every[s, 3])
            if f >= 0:
                raise ValueError(
                    f"feature {self.feature_names[f]!r}: id {bad_id} is outside its table "
                    f"(found on rank {s}; every rank stops)"
                )
        batches = tuple(int(b) for b in every[:, 0].tolist())
        gathered = None
        if torch.is_grad_enabled():
            gathered = self._gather(features, batches, [int(x) for x in every[:, 1].tolist()])
        return Handle.done(Routed(features, batches, gathered=gathered))

    def _gather(
        self, features: SparseFeatures, batches: tuple[int, ...], counts: list[int]
    ) -> Handle[SparseFeatures]:
        comm, keys = self.env.comm, features.keys
        f = len(keys)
        ids = comm.all_gather_v(
            torch.cat([features.lengths.long(), features.values.long()]),
            sizes=[f * b + n for b, n in zip(batches, counts)],
            label="backward_ids/replicated",
        )
        wts = None
        if features.weights is not None:
            wts = comm.all_gather_v(
                features.weights.detach(), sizes=counts, label="backward_ids/replicated"
            )

        def finish() -> SparseFeatures:
            blocks = ids.wait()
            lens = [blk[: f * b].view(f, b) for blk, b in zip(blocks, batches)]
            vals = [blk[f * b :] for blk, b in zip(blocks, batches)]
            per_key = [[int(x) for x in ln.sum(1).tolist()] for ln in lens]
            lengths = torch.cat(lens, dim=1).reshape(-1)
            weights = regroup_key_major(wts.wait(), per_key) if wts is not None else None
            totals = tuple(sum(c[k] for c in per_key) for k in range(f))
            values = regroup_key_major(vals, per_key)
            return SparseFeatures(keys, values, lengths, sum(batches), weights, totals)

        return Handle(finish)

    def lookup(self, routed: Routed) -> torch.Tensor:
        """Pool this rank's samples; backward applies the global batch's update."""
        assert self.local is not None  # a replicated group holds every table
        sf = routed.features
        if routed.gathered is None:  # evaluation: no backward
            pooled: torch.Tensor = self.local(sf).values
            return pooled
        out = _ReplicatedLookup.apply(  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
            self, routed, sf.weights, self._anchor
        )
        assert isinstance(out, torch.Tensor)
        return out

    def output_dist(self, pooled: torch.Tensor, routed: Routed) -> Handle[torch.Tensor]:
        """Nothing to send: the rows are this rank's samples, columns in feature order."""
        return Handle.done(pooled)


class _ReplicatedLookup(torch.autograd.Function):
    """Forward: prepare the global batch, pool this rank's samples. Backward: the update.

    A cached replica runs its policy step on the global batch in forward (module
    docstring); the global batch's ``PreparedIds`` is kept for backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: ReplicatedGroup,
        routed: Routed,
        weights: torch.Tensor | None,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        local = group.local
        assert local is not None  # a replicated group holds every table
        assert routed.gathered is not None  # a training forward gathers the ids
        every = routed.gathered.wait()  # (sum B) samples: the one process's batch
        # first the global batch (a cache's policy step), then this rank's samples
        # through the slots it left
        ctx.group, ctx.routed = group, routed
        ctx.every = local.prepare(every, admit=local.training)
        return local.pooled_lookup(local.prepare(routed.features, admit=False))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group: ReplicatedGroup = ctx.group
        routed: Routed = ctx.routed
        every: PreparedIds[Any] = ctx.every
        local = group.local
        assert local is not None
        comm = group.env.comm
        grads = comm.all_gather_v(
            grad.contiguous(), sizes=list(routed.source_batches), label="backward_grads/replicated"
        ).wait()
        want_psw = routed.features.weights is not None and ctx.needs_input_grad[2]
        psw_grad = local.apply_gradients(torch.cat(grads), every, want_psw=want_psw)
        mine = None
        if want_psw:
            assert psw_grad is not None
            mine = _own_part(psw_grad, every.features, routed, comm.rank)
        return None, None, mine, None


def _own_part(
    values: torch.Tensor, every: SparseFeatures, routed: Routed, rank: int
) -> torch.Tensor:
    """This rank's ids' entries of a per-id tensor laid out like ``every`` ([f][s])."""
    batches = routed.source_batches
    lens = every.lengths_2d()  # (F, sum B)
    edges = [0]
    for b in batches:
        edges.append(edges[-1] + b)
    pieces, pos = [], 0
    for f in range(every.num_keys):
        per_source = [int(lens[f, edges[s] : edges[s + 1]].sum()) for s in range(len(batches))]
        start = pos + sum(per_source[:rank])
        pieces.append(values[start : start + per_source[rank]])
        pos += sum(per_source)
    return torch.cat(pieces)


class DataParallel:
    """The data-parallel strategy: the whole table on every rank."""

    sharding_type = ShardingType.DATA_PARALLEL
    group = "replicated"  # runs in the replicated group
    cost = CostTerms(label="DP", order=3, split=Split.WHOLE, replicated=True)

    def candidate_blocks(self, ctx: CandidateContext) -> tuple[int, ...]:
        """A copy per rank, for a table of at most ``DP_MAX_BYTES`` on several ranks."""
        w = ctx.world_size
        return (w,) if w > 1 and ctx.table_bytes <= DP_MAX_BYTES else ()

    def place(self, table: TableConfig, ctx: PlacementContext) -> tuple[Shard, ...]:
        """A full copy on every rank."""
        return tuple(
            Shard(rank=r, rows=(0, table.num_embeddings), cols=(0, table.dim))
            for r in range(ctx.world_size)
        )

    def validate(self, table: TableConfig, plan: TablePlan, whole: ShardingPlan) -> None:
        """One full copy per rank, on every rank.

        Raises:
            ValueError: otherwise.
        """
        full = ((0, table.num_embeddings), (0, table.dim))
        ranks = sorted(s.rank for s in plan.shards)
        if ranks != list(range(whole.world_size)) or any(
            (s.rows, s.cols) != full for s in plan.shards
        ):
            raise ValueError(
                f"table {table.name!r}: a data-parallel table is one full copy on each of the "
                f"{whole.world_size} ranks, got {plan.shards}"
            )


register_group("replicated", ReplicatedGroup)
register(DataParallel())
