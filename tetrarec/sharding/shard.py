"""``shard_model``: parallelize a model from outside (the model never imports sharding).

::

    model = build_model(config, FusedEmbeddingBagCollection(tables, spec, device="meta"))
    ddp = shard_model(model, plan, env)     # model.embeddings is now sharded
    logits = ddp(dense, sparse)             # this rank's samples

1. every rank checks, with one small collective, that all ranks agree on the world
   size, the plan and the tables (and whatever else the caller adds to ``agree_on``);
   a mismatch fails on every rank with a message that says what differs;
2. each ``FusedEmbeddingBagCollection`` in the model (its embedding tables, and a
   first-order term's) is swapped, in place, for the ``ShardedEmbeddingBagCollection``
   of its tables' part of the plan (same tables, optimizer, seed and kernel settings;
   rows copied over unless the module lives on the meta device); the plan must place
   every table of every collection, and nothing else;
3. the model is wrapped in ``DistributedDataParallel`` for its dense parameters, on
   the env's dense process group, with gradients summed (not averaged): each rank's
   loss is its share of the global batch's mean (``sum over its samples / global
   batch``), so the sum is the one-process gradient.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tetrarec.cache import CacheSpec
from tetrarec.comm.ddp_hook import DenseGradients, sum_gradients_hook
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.sharding.env import ShardingEnv
from tetrarec.sharding.group import LookupOptions
from tetrarec.sharding.plan import ShardingPlan
from tetrarec.sharding.sharded_collection import ShardedEmbeddingBagCollection
from tetrarec.sharding.state_dict import copy_unsharded_state

__all__ = ["check_ranks_agree", "shard_collection", "shard_model"]


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Dotted paths where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out.extend(_diff(a.get(k), b.get(k), f"{path}.{k}" if path else str(k)))
        return out
    return [] if a == b else [path or "(value)"]


def check_ranks_agree(env: ShardingEnv, facts: Mapping[str, Any]) -> None:
    """Check that every rank passes the same ``facts`` (JSON values).

    Call it before any other collective: one that disagrees is where ranks would hang.

    Raises:
        ValueError: on every rank, naming the ranks and the keys that differ.
    """
    mine = json.loads(json.dumps(facts, sort_keys=True))
    every = env.comm.all_gather_json(mine, label="agree")
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            keys = _diff(every[0], theirs)
            raise ValueError(
                f"ranks disagree before training starts: rank {rank} differs from rank 0 in "
                f"{', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''} (start every rank "
                "with the same config and plan)"
            )


def _tables_fact(module: FusedEmbeddingBagCollection) -> str:
    desc = [
        (t.name, t.num_embeddings, t.dim, t.feature_names, t.pooling.value, t.precision.value)
        for t in module.tables
    ]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def shard_collection(
    module: FusedEmbeddingBagCollection,
    plan: ShardingPlan,
    env: ShardingEnv,
    *,
    cache: CacheSpec | None = None,
    static_counts: Mapping[str, torch.Tensor] | None = None,
) -> ShardedEmbeddingBagCollection:
    """The sharded version of ``module`` (its rows copied unless it is on meta).

    ``cache``: policy, default size and SSD directory of the shards the plan places
    ``cached`` or ``ssd``; ``static_counts``: ``{table: (rows,) counts}`` of a data
    sample for the ``static`` policy (``LookupOptions.static_counts``).
    """
    options = LookupOptions(
        optimizer=module.optimizer_spec,
        seed=module.seed,
        deterministic=module.deterministic,
        stochastic_rounding=module.stochastic_rounding,
        check_bounds=module.check_bounds,
        cache=cache,
        static_counts=static_counts,
    )
    sharded = ShardedEmbeddingBagCollection(module.tables, plan, env, options)
    on_meta = any(s.device.type == "meta" for s in module.storages())
    if not on_meta:
        copy_unsharded_state(module, sharded)
    for key in ("lr", "eps", "betas", "weight_decay"):  # the source's current settings
        sharded.fused_optimizer.param_groups[0][key] = module.fused_optimizer.param_groups[0][key]
    return sharded


def shard_model(
    model: nn.Module,
    plan: ShardingPlan,
    env: ShardingEnv,
    *,
    agree_on: Mapping[str, Any] | None = None,
    cache: CacheSpec | None = None,
    static_counts: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Shard ``model``'s embedding collections by ``plan``; wrap its dense part in DDP.

    Args:
        model: a model whose ``FusedEmbeddingBagCollection`` submodules hold its tables.
        plan: where the tables' blocks go.
        env: the process groups, topology and device.
        agree_on: more facts every rank must share (for example the run's config).
        cache: the row caches of tables the plan places ``cached`` or ``ssd``
            (``shard_collection``).
        static_counts: the ``static`` policy's sample counts (``shard_collection``).

    Returns:
        ``model`` wrapped in ``DistributedDataParallel`` (or ``model`` itself in a
        world of one); ``model`` itself holds the sharded collections.

    Raises:
        ValueError: if the ranks disagree, or the plan does not fit the tables or the
            world (on every rank).
        TypeError: if the model has no fused embedding collection.
    """
    found = [
        (name, m) for name, m in model.named_modules() if isinstance(m, FusedEmbeddingBagCollection)
    ]
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no FusedEmbeddingBagCollection to shard "
            "(set model.embedding = 'fused')"
        )
    every = [t for _, m in found for t in m.tables]
    plan.validate(every)  # exactly the model's tables (raised on every rank alike)
    facts = {
        "world_size": env.world_size,
        "local_world_size": env.local_world_size,
        "plan": plan.fingerprint(),
        "features": [list(m.feature_names) for _, m in found],
        "tables": [_tables_fact(m) for _, m in found],
        **(agree_on or {}),
    }
    check_ranks_agree(env, facts)
    for name, module in found:
        part = plan.select([t.name for t in module.tables])
        sharded = shard_collection(module, part, env, cache=cache, static_counts=static_counts)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, sharded)
    if env.world_size == 1:
        return model
    dense = env.dense_comm or env.comm
    # The sharded collections hold no parameters (their rows are buffers, never
    # broadcast); every rank built the dense layers from the same seed (init_sync=False).
    # One bucket of every dense gradient, reduced in parameter order (ddp_hook.py): the
    # sums are then the same whatever order DDP lays the bucket out in, and a resumed
    # run adds its first step's gradients as the uninterrupted run did.
    trained = [p for p in model.parameters() if p.requires_grad]
    size_mb = sum(p.numel() * p.element_size() for p in trained) // 2**20 + 1
    ddp = DistributedDataParallel(
        model,
        process_group=dense.group,
        forward_sync_buffers=False,
        init_sync=False,
        bucket_cap_mb=size_mb,
    )
    ddp.register_comm_hook(DenseGradients.of(dense, trained), sum_gradients_hook)
    return ddp
