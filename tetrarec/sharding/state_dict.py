"""Conversions between a table's unsharded layout and the blocks ranks hold.

What a rank holds, in plain terms (``local_blocks``)::

    {"layout":  [{"name": "C1@r25", "table": "C1", "rows": [25, 50], "cols": [0, 64]}, ...],
     "weights": {"C1@r25": (25, 64) FP32 rows (decoded), ...},
     "state":   {"C1@r25": {"sum": (25,) FP32, ...}, ...}}

``unshard`` puts every rank's blocks back into whole tables (and checks that replicas
and column blocks' per-row state agree); ``copy_unsharded_state`` goes the other way, from
a one-process collection into a sharded one. Checkpoints save the same layout, so a
later tool can reshard a checkpoint without the process group that wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tetrarec.embedding import TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection, encode_rows
from tetrarec.sharding.sharded_collection import ShardedEmbeddingBagCollection

__all__ = ["copy_unsharded_state", "local_blocks", "unshard"]


def local_blocks(module: ShardedEmbeddingBagCollection) -> dict[str, Any]:
    """This rank's blocks: layout, decoded rows and optimizer state (CPU copies).

    On the CPU as ``unshard`` (and pickling between processes) needs them, whatever the
    rank's device.
    """
    state = module.fused_optimizer.state_dict()["state"]
    return {
        "layout": module.shard_layout(),
        "weights": {name: w.cpu() for name, w in module.table_weights().items()},
        "state": {
            name: {k: v.to("cpu", copy=True) for k, v in s.items()} for name, s in state.items()
        },
    }


def unshard(
    tables: Sequence[TableConfig], per_rank: Sequence[dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[str]]:
    """Full tables and optimizer state from every rank's ``local_blocks``.

    Returns:
        ``(weights, state, problems)``: problems lists cells no block covers and
        replicas (or column blocks' per-row state) that disagree.
    """
    by_name = {t.name: t for t in tables}
    weights = {t.name: torch.full((t.num_embeddings, t.dim), float("nan")) for t in tables}
    state: dict[str, dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    for rank, res in enumerate(per_rank):
        for entry in res["layout"]:
            name, table = entry["name"], entry["table"]
            (r0, r1), (c0, c1) = entry["rows"], entry["cols"]
            block = res["weights"][name]
            dst = weights[table][r0:r1, c0:c1]
            if not torch.isnan(dst).all() and not torch.equal(dst, block):
                problems.append(f"replicas of {table} rows {r0}:{r1} differ (rank {rank})")
            dst.copy_(block)
            for key, value in res["state"][name].items():
                t = by_name[table]
                full = state.setdefault(table, {})
                if value.dim() == 2:
                    buf = full.setdefault(key, torch.full((t.num_embeddings, t.dim), float("nan")))
                    piece, target = value, buf[r0:r1, c0:c1]
                else:
                    buf = full.setdefault(key, torch.full((t.num_embeddings,), float("nan")))
                    piece, target = value, buf[r0:r1]
                if not torch.isnan(target).all() and not torch.allclose(
                    target, piece, rtol=1e-5, atol=1e-7
                ):
                    problems.append(f"copies of {table}.{key} rows {r0}:{r1} differ (rank {rank})")
                target.copy_(piece)
    for name, w in weights.items():
        if torch.isnan(w).any():
            problems.append(f"no block covers some cells of {name}")
    return weights, state, problems


def copy_unsharded_state(
    source: FusedEmbeddingBagCollection, target: ShardedEmbeddingBagCollection
) -> None:
    """Copy the rows and optimizer state of ``source`` into ``target``'s blocks."""
    rows = source.state_dict()
    state = source.fused_optimizer.state_dict()["state"]
    own = target.fused_optimizer.state_dict()["state"]
    for group in target._groups():
        local = group.local
        if local is None:
            continue
        new_rows = {}
        for shard, lt in zip(group.shards, local.tables):
            (r0, r1), (c0, c1) = shard.rows, shard.cols
            full = rows[f"weights.{shard.table.name}"]
            if shard.table.precision.is_integer and (c0, c1) != (0, shard.table.dim):
                decoded = source.table_weights()[shard.table.name][r0:r1, c0:c1]
                new_rows[f"weights.{lt.name}"] = encode_rows(
                    decoded, shard.table.precision, stochastic=False
                )
            elif shard.table.precision.is_integer:
                new_rows[f"weights.{lt.name}"] = full[r0:r1]
            else:
                new_rows[f"weights.{lt.name}"] = full[r0:r1, c0:c1]
            for name, value in state[shard.table.name].items():
                piece = value[r0:r1, c0:c1] if value.dim() == 2 else value[r0:r1]
                with torch.no_grad():
                    own[lt.name][name].copy_(piece)
        new_rows["rounding"] = torch.tensor([source.seed, source.iteration])
        local.load_state_dict(new_rows)
