"""The moving parts shared by the sharding types: sending ids to shards, pooled rows back.

Input dist (``route_features``): every rank sends each rank ``q`` a key-major block of its
own samples holding the features ``q``'s shards pool (with ids already local to ``q``'s
shard for row-wise tables), and receives such a block from every rank. Three collectives:

    1. counts (blocking, tiny): per destination [own batch size, ids sent, bad feature,
       bad id]; it sizes the next two and makes a bad id fail on *every* rank at once;
    2. ids: per destination [lengths (F_q x B), ids] as one int64 all-to-all;
    3. per-id weights (weighted bags only), autograd-aware.

Worked example, 2 ranks, one table-wise table "t" on rank 1 with feature "f", batch 2
per rank::

    R0 has f: [[3], [4, 5]]      R1 has f: [[6], []]
    R0 sends nothing to R0; to R1: lengths [1, 2], ids [3, 4, 5]
    R1 sends to R1: lengths [1, 0], ids [6]
    R1 receives from R0 then R1 and regroups key-major over the 4 samples:
        f: lengths [1, 2, 1, 0], ids [3, 4, 5, 6]      (rows 0-1: R0's, 2-3: R1's)

Output dist: the pooled rows ``(sum of source batches, D)`` go back to the ranks that own
the samples: an all-to-all for whole tables and column blocks (``send_pooled``), a
reduce-scatter of partial sums for row blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tetrarec.comm import Communicator, Handle
from tetrarec.kernels import ops
from tetrarec.sparse import SparseFeatures

__all__ = [
    "BlockColumns",
    "Outgoing",
    "Routed",
    "bad_id",
    "place_columns",
    "regroup_key_major",
    "route_features",
    "send_pooled",
]


@dataclass(frozen=True)
class Outgoing:
    """What this rank sends one destination: a key-major block of its own samples.

    Args:
        lengths: ``(F_q * B,)`` bag lengths of the destination's features.
        values: the ids, key-major.
        weights: per-id weights, or ``None``.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None


@dataclass(frozen=True)
class Routed:
    """What an input dist hands the lookup (and the output dist).

    Args:
        features: the received features, key-major over the samples of every source
            rank in rank order (``batch_size == sum(source_batches)``).
        source_batches: the batch size of each source rank.
        own_lengths: this rank's own ``(F, B)`` bag lengths of the group's features,
            where the output dist needs them (mean pooling of row blocks).
        gathered: every rank's features, key-major over all samples, where backward
            needs them (replicated tables).
    """

    features: SparseFeatures
    source_batches: tuple[int, ...]
    own_lengths: torch.Tensor | None = None
    gathered: Handle[SparseFeatures] | None = None


def bad_id(features: SparseFeatures, rows: Sequence[int]) -> tuple[int, int] | None:
    """``(feature index, id)`` of the first id outside ``[0, rows[f])``, or ``None``.

    One pass over the ids and one host sync.
    """
    counts = features.value_counts_host()
    if not counts or features.values.numel() == 0:
        return None
    limit = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.int64, device=features.values.device),
        torch.tensor(counts, device=features.values.device),
    )
    v = features.values.long()
    bad = (v < 0) | (v >= limit)
    if not bool(bad.any()):
        return None
    j = int(bad.nonzero()[0, 0])
    f = int(torch.searchsorted(torch.tensor(counts).cumsum(0), j, right=True))
    return f, int(v[j])


def regroup_key_major(
    pieces: Sequence[torch.Tensor], counts: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Concatenate source-major segments ``[s][f]`` in key-major order ``[f][s]``.

    Args:
        pieces: one tensor per source, its features' segments back to back.
        counts: ``counts[s][f]``, the elements of feature ``f`` from source ``s``.
    """
    split = [torch.split(p, list(c)) for p, c in zip(pieces, counts)]
    num_f = len(counts[0]) if counts else 0
    parts = [split[s][f] for f in range(num_f) for s in range(len(pieces))]
    return torch.cat(parts) if parts else pieces[0][:0]


def route_features(
    comm: Communicator,
    outgoing: Sequence[Outgoing],
    *,
    keys: tuple[str, ...],
    batch_size: int,
    error: tuple[int, int] | None,
    group_features: Sequence[str],
    label: str,
) -> Handle[Routed]:
    """Send ``outgoing[q]`` to each rank ``q``; receive the features named ``keys``.

    Args:
        comm: the collectives.
        outgoing: one block per rank (empty blocks included).
        keys: the features this rank receives from every rank, in order.
        batch_size: this rank's own batch size.
        error: ``(index in group_features, id)`` of a bad id found here, sent to every
            rank so that all of them raise the same error.
        group_features: the group's feature names (to name a bad id's feature).
        label: the counted name of the collectives.

    Returns:
        A handle to the received features (see ``Routed``).

    Raises:
        ValueError: on every rank, if any rank found a bad id.
    """
    w = comm.world_size
    ids_sent = [int(o.values.numel()) for o in outgoing]
    flag = error if error is not None else (-1, -1)
    # Host-side sizes: the communicator sends them on its device and hands them back here.
    counts = torch.tensor([[batch_size, n, flag[0], flag[1]] for n in ids_sent], dtype=torch.int64)
    got = comm.all_to_all_v(
        counts, send_splits=[1] * w, recv_splits=[1] * w, label=label + "/counts"
    )
    received = got.wait()  # (W, 4): sizes of what each source sends here
    for s in range(w):
        f, bad = int(received[s, 2]), int(received[s, 3])
        if f >= 0:
            raise ValueError(
                f"feature {group_features[f]!r}: id {bad} is outside its table "
                f"(found on rank {s}; every rank stops)"
            )
    batches = [int(b) for b in received[:, 0].tolist()]
    n_from = [int(n) for n in received[:, 1].tolist()]
    payload = torch.cat([torch.cat([o.lengths.long(), o.values.long()]) for o in outgoing])
    send = [o.lengths.numel() + o.values.numel() for o in outgoing]
    recv = [len(keys) * b + n for b, n in zip(batches, n_from)]
    ids = comm.all_to_all_v(payload, send_splits=send, recv_splits=recv, label=label + "/ids")
    weights = None
    if any(o.weights is not None for o in outgoing):
        wts = torch.cat([o.weights for o in outgoing if o.weights is not None])
        weights = comm.all_to_all_v(
            wts, send_splits=ids_sent, recv_splits=n_from, label=label + "/weights"
        )

    def finish() -> Routed:
        got = ids.wait()  # on the ids' device
        blocks = torch.split(got, recv)
        lens = [b[: len(keys) * bs].view(len(keys), bs) for b, bs in zip(blocks, batches)]
        vals = [b[len(keys) * bs :] for b, bs in zip(blocks, batches)]
        per_key = [[int(x) for x in ln.sum(1).tolist()] for ln in lens]  # [s][f]
        lengths = torch.cat([ln for ln in lens], dim=1).reshape(-1) if lens else got[:0]
        values = regroup_key_major(vals, per_key)
        wts = None
        if weights is not None:
            wts = regroup_key_major(torch.split(weights.wait(), n_from), per_key)
        counts_per_key = tuple(sum(per_key[s][f] for s in range(w)) for f in range(len(keys)))
        sf = SparseFeatures(keys, values, lengths.long(), sum(batches), wts, counts_per_key)
        return Routed(sf, tuple(batches))

    return Handle(finish)


def send_pooled(
    comm: Communicator,
    pooled: torch.Tensor,
    *,
    source_batches: Sequence[int],
    dims: Sequence[int],
    label: str,
) -> Handle[torch.Tensor]:
    """Send the pooled rows of each source's samples back to it (an all-to-all).

    Args:
        comm: the collectives.
        pooled: ``(sum(source_batches), dims[rank])`` rows, source-major.
        source_batches: the batch size of each rank.
        dims: the pooled width of each rank (columns its shards produce).
        label: the counted name.

    Returns:
        A handle to the flat received rows: one ``(own batch, dims[q])`` row-major block
        per rank ``q``, back to back (see ``place_columns``).
    """
    me = comm.rank
    flat = pooled.reshape(-1)
    send = [b * dims[me] for b in source_batches]
    own = source_batches[me]
    recv = [own * d for d in dims]
    return comm.all_to_all_v(flat, send_splits=send, recv_splits=recv, label=label)


@dataclass(frozen=True)
class BlockColumns:
    """Where one ``(B, width)`` block of a flat buffer goes in the output's columns.

    Args:
        width: the block's columns.
        runs: ``(first column in the block, first column in the output, columns)``
            of each run of columns copied as one piece.
    """

    width: int
    runs: tuple[tuple[int, int, int], ...]

    @staticmethod
    def from_columns(dst: Sequence[int]) -> BlockColumns:
        """The block whose column ``j`` goes to output column ``dst[j]``."""
        runs: list[tuple[int, int, int]] = []
        for j, c in enumerate(dst):
            if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == c:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((j, c, 1))
        return BlockColumns(len(dst), tuple(runs))


def place_columns(
    flat: torch.Tensor, batch: int, blocks: Sequence[BlockColumns], total: int
) -> torch.Tensor:
    """``(batch, total)`` from ``(batch, width)`` blocks laid one after another in ``flat``.

    Every output column comes from exactly one block column (a permutation), copied in
    runs of adjacent columns, row by row (``tetrarec::copy_row_runs``). Differentiable:
    backward copies the same runs back into a flat gradient (no zero-filled scatter, no
    per-block split).
    """
    out: torch.Tensor = _PlaceColumns.apply(flat, batch, tuple(blocks), total)  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
    return out


def _runs(
    batch: int, blocks: tuple[BlockColumns, ...], total: int, to_output: bool
) -> torch.Tensor:
    """``copy_row_runs`` table between the flat blocks and the ``(batch, total)`` output."""
    rows: list[list[int]] = []
    offset = 0
    for blk in blocks:
        for s, d, n in blk.runs:
            if to_output:
                rows.append([offset + s, blk.width, d, total, n])
            else:
                rows.append([d, total, offset + s, blk.width, n])
        offset += batch * blk.width
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)


class _PlaceColumns(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, flat: torch.Tensor, batch: int, blocks: tuple[BlockColumns, ...], total: int
    ) -> torch.Tensor:
        ctx.batch, ctx.blocks, ctx.total = batch, blocks, total
        out = flat.new_empty(batch, total)
        ops.copy_row_runs(flat.contiguous(), out, _runs(batch, blocks, total, True), batch)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        batch, blocks, total = ctx.batch, ctx.blocks, ctx.total
        flat = grad.new_empty(sum(batch * b.width for b in blocks))
        ops.copy_row_runs(grad.contiguous(), flat, _runs(batch, blocks, total, False), batch)
        return flat, None, None, None
