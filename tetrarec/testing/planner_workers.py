"""Rank workers that check the planner's cost model against the sharded runtime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tetrarec.comm import second_group
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.models import DLRMConfig, build_model
from tetrarec.sharding import ShardingEnv, ShardingPlan, shard_model
from tetrarec.sparse import SparseFeatures
from tetrarec.testing.multiprocess import RankContext
from tetrarec.types import OptimizerKind

__all__ = ["collectives_per_step_worker"]


def collectives_per_step_worker(
    ctx: RankContext,
    tables: list[TableConfig],
    optimizers: Sequence[OptimizerKind],
    plans: dict[str, dict[str, Any]],
    steps: int = 2,
) -> list[dict[str, float]]:
    """Per optimizer: each plan's collective calls per training step (both groups).

    A small DLRM over ``tables`` (pooling 2, local batch 4) is sharded by each plan and
    trained one step, then ``steps`` steps are counted.
    """
    dense_comm = second_group(ctx.comm)
    env = ShardingEnv(ctx.comm, ctx.world_size, dense_comm=dense_comm)
    keys = tuple(t.name for t in tables)
    gen = torch.Generator().manual_seed(ctx.rank)
    batch = 4
    values = torch.cat(
        [torch.randint(0, t.num_embeddings, (2 * batch,), generator=gen) for t in tables]
    )
    feats = SparseFeatures.from_lengths(
        keys, values, torch.full((len(tables) * batch,), 2, dtype=torch.int64)
    ).with_value_counts()
    dense = torch.randn(batch, 3, generator=gen)
    out = []
    for optimizer in optimizers:
        counts = {}
        for name, d in plans.items():
            spec = SparseOptimizerSpec(kind=optimizer, lr=0.01)
            emb = FusedEmbeddingBagCollection(tables, spec, seed=0, device="meta")
            dlrm = DLRMConfig(num_dense=3, bottom_mlp=(8, tables[0].dim), top_mlp=(8, 1), seed=0)
            forward = shard_model(build_model(dlrm, emb), ShardingPlan.from_dict(d), env)
            for i in range(steps + 1):
                if i == 1:
                    ctx.comm.reset_stats()
                    dense_comm.reset_stats()
                forward(dense, feats).sum().backward()
            calls = sum(s.calls for c in (ctx.comm, dense_comm) for s in c.stats.values())
            counts[name] = calls / steps
        out.append(counts)
    return out
