"""A training run on several ranks: the process groups, the plan and the sharded parts.

``torchrun --nproc-per-node N -m tetrarec train --config run.toml`` starts N processes;
each calls ``train``, which, seeing a launch of several ranks, does::

    1. join the process group on the rank's device (``train.device``: cuda:LOCAL_RANK
       with NCCL, or the CPU with gloo; collectives time out after sharding.timeout_s)
       and a second one for the dense layers' gradient all-reduce
    2. check that every rank runs the same config (one small collective; a rank started
       with another config stops every rank with the keys that differ)
    3. make the plan (sharding.plan; sharding.type placed by bytes; or, with neither,
       the planner's on sharding.topology: a pure function of the config, so every rank
       plans the same, and the plan's fingerprint is compared before the first
       collective) and check it against the tables and the world
    4. build the datasets (``run_datasets``): every rank fits the dense transform on
       the training rows, then all take rank 0's statistics
    5. build the model with its tables described on the meta device and its dense
       layers on the rank's device, then ``shard_model``: each rank builds only its
       blocks, on its device; the dense part trains under DistributedDataParallel
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from tetrarec.comm import LaunchInfo, init_from_env, second_group
from tetrarec.config import RunConfig
from tetrarec.config.tables import (
    build_tables,
    fixed_placements,
    model_tables,
    table_sharding_types,
)
from tetrarec.data import DenseTransform, TransformedDataset, build_datasets
from tetrarec.planner import Topology, inputs_from_config
from tetrarec.planner import plan as make_planned
from tetrarec.sharding import (
    STRATEGIES,
    ShardingEnv,
    ShardingPlan,
    check_ranks_agree,
    plan_by_type,
    shard_model,
)
from tetrarec.sharding.strategy import Split
from tetrarec.train.build import RunParts, build_parts, model_embeddings

__all__ = [
    "check_sharding_settings",
    "make_plan",
    "run_datasets",
    "sharded_parts",
    "sharding_env",
]

logger = logging.getLogger(__name__)


def sharding_env(
    config: RunConfig, launch: LaunchInfo, device: torch.device | None = None
) -> ShardingEnv:
    """Join the launch's process groups and check that every rank runs ``config``.

    Args:
        config: the run.
        launch: where this process sits in the launch.
        device: this rank's device (``TrainConfig.resolve_device(launch.local_rank)``);
            default: resolved here. It picks the backend (NCCL for CUDA, gloo for the
            CPU), and the shards' rows and every collective's buffers live on it.

    Raises:
        ValueError: on every rank, if the ranks' configs differ, or the batch sizes do
            not split over the ranks; here, for a device this rank cannot use.
    """
    if device is None:
        device = config.train.resolve_device(launch.local_rank)
    comm = init_from_env(launch, device=device, timeout_s=config.sharding.timeout_s)
    env = ShardingEnv(
        comm,
        config.sharding.local_world_size or launch.local_world_size,
        device,
        second_group(comm),
    )
    check_ranks_agree(env, {"config": config.to_dict()})
    # A global batch (training or evaluation) of any size splits as evenly as it can
    # (BatchLoader): the loss is each rank's sum over the global batch's size, so the
    # ranks' shares add up to one process's loss whatever their sizes.
    if config.data.batch_size < env.world_size:
        raise ValueError(
            f"data.batch_size = {config.data.batch_size} is smaller than the {env.world_size} "
            "ranks: every rank needs at least one sample of each global batch"
        )
    return env


def run_datasets(
    config: RunConfig, env: ShardingEnv | None
) -> tuple[TransformedDataset, TransformedDataset]:
    """The run's ``(train, eval)`` datasets; on several ranks, with identical dense statistics.

    Every rank fits the dense transform over the same training rows in the same chunks,
    which gives the same numbers on machines of one kind; float reductions may differ
    in the last bit between CPU kinds, so every rank then takes rank 0's statistics
    (one small all-gather, a collective every rank calls) and all ranks feed the model
    bitwise the same dense inputs.

    Raises:
        ValueError, DataError: see ``build_datasets``.
    """
    train, held_out = build_datasets(config.data, build_tables(config.model))
    if env is None or env.world_size == 1:
        return train, held_out
    every = env.comm.all_gather_json(train.transform.to_dict(), label="dense_transform")
    first = DenseTransform.from_dict(every[0])
    if first != train.transform:
        logger.warning(
            "rank %d fitted other dense statistics than rank 0 (%s vs %s); using rank 0's",
            env.rank,
            train.transform.to_dict(),
            every[0],
        )
    return train.with_transform(first), held_out.with_transform(first)


def check_sharding_settings(config: RunConfig) -> None:
    """Refuse a ``[sharding]`` setting that cannot work, before any training.

    What one process can check without a world: a plan file that is missing, unreadable
    or does not fit the tables, and a column block that does not divide the dim of a
    table whose type splits columns. (A one-process run trains unsharded; it refuses
    these all the same, so that a config is not found broken only under ``torchrun``.)

    Raises:
        ValueError: naming the key (``sharding.plan`` or ``sharding.column_block``).
    """
    sc = config.sharding
    tables = model_tables(config.model)
    if sc.plan is not None:
        try:
            ShardingPlan.load(sc.plan).validate(tables)
        except FileNotFoundError:
            raise ValueError(f"sharding.plan: no such file: {sc.plan}") from None
        except (ValueError, OSError) as e:
            raise ValueError(f"sharding.plan: {e}") from None
        return
    if sc.type is None or sc.column_block is None:
        return
    kinds = table_sharding_types(config.model, sc.type)
    for table, kind in zip(tables, kinds, strict=True):
        splits_columns = STRATEGIES[kind].cost.split is Split.COLUMNS
        if splits_columns and table.dim % sc.column_block:
            raise ValueError(
                f"sharding.column_block = {sc.column_block} does not divide the dim "
                f"({table.dim}) of table {table.name!r}, {kind.value}"
            )


def make_plan(config: RunConfig, env: ShardingEnv) -> ShardingPlan:
    """The run's plan: ``sharding.plan``, ``sharding.type``'s, or the planner's.

    With neither a plan file nor a type, the planner plans for ``sharding.topology``
    (and ``sharding.stats``); rank 0 logs its report.

    Raises:
        ValueError: if the plan does not fit the tables or the world.
    """
    tables = model_tables(config.model)  # the first-order term's tables too
    sc = config.sharding
    if sc.plan is not None:
        plan = ShardingPlan.load(sc.plan)
        plan.check_world(env.world_size, env.local_world_size)
        plan.validate(tables)
    elif sc.type is None:
        plan = _planned(config, env)
    else:
        plan = plan_by_type(
            tables,
            table_sharding_types(config.model, sc.type),
            world_size=env.world_size,
            local_world_size=env.local_world_size,
            column_block=sc.column_block,
        )
    plan = _with_config_placements(config, plan)
    if env.rank == 0:
        logger.info("%s", plan.describe(tables))
    return plan


def _with_config_placements(config: RunConfig, plan: ShardingPlan) -> ShardingPlan:
    """``plan`` with the config's ``cached`` and ``ssd`` tables placed so.

    Each rank then caches its own shards, at ``[model.cache]``'s fraction (a byte budget
    as one process would divide it: ``fixed_placements``); other tables keep the plan's
    placement.
    """
    fixed = fixed_placements(config.model, config.optim.sparse.kind)
    if not fixed:
        return plan
    placed = tuple(
        dataclasses.replace(tp, placement=fixed[tp.table]) if tp.table in fixed else tp
        for tp in plan
    )
    return dataclasses.replace(plan, tables=placed)


def _planned(config: RunConfig, env: ShardingEnv) -> ShardingPlan:
    """The planner's plan for this world on ``sharding.topology`` (rank 0 logs why)."""
    topology = Topology.resolve(config.sharding.topology).resized(
        env.world_size, env.local_world_size
    )
    stats = config.sharding.stats
    if stats is not None and not Path(stats).is_file():
        raise ValueError(f"sharding.stats={stats!r}: no such file (write one with tetrarec stats)")
    plan, report = make_planned(inputs_from_config(config, topology, stats))
    if env.rank == 0:
        logger.info("no sharding.type or sharding.plan: the planner's plan\n%s", report.describe())
    return plan


def sharded_parts(
    config: RunConfig,
    env: ShardingEnv,
    *,
    num_dense: int,
    static_counts: Mapping[str, torch.Tensor] | None = None,
) -> RunParts:
    """The run's model, sharded by its plan, and its optimizers.

    ``static_counts``: the ``static`` cache policy's sample counts (the same on every
    rank); each cached shard pins the hottest of its rows.
    """
    plan = make_plan(config, env)
    # The dense layers go to the env's device (DDP wraps them there); the tables are
    # only described, and each rank builds its blocks on that device (shard_model).
    parts = build_parts(config, num_dense=num_dense, device=env.device, describe_only=True)
    cache = config.model.cache.spec() if config.model.cached else None
    wrapped = shard_model(parts.model, plan, env, cache=cache, static_counts=static_counts)
    optimizer = getattr(model_embeddings(parts.model), "fused_optimizer", None)
    assert isinstance(optimizer, torch.optim.Optimizer)  # a sharded collection has one
    return RunParts(
        model=parts.model,
        dense_optimizer=parts.dense_optimizer,
        sparse_optimizer=optimizer,
        forward=wrapped,
        plan=plan,
        env=env,
    )
