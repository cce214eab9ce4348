"""Sharding: tables placed over ranks by a ``ShardingPlan``.

Each group of tables that move alike runs input dist -> lookup -> output dist (see
``sharded_collection.py``).

One strategy per sharding type, each in its own module and registered by type in
``STRATEGIES``; importing this package registers them all.
"""

from tetrarec.sharding import (  # noqa: F401  (each registers its strategy or group)
    block_group,
    column_wise,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from tetrarec.sharding.env import ShardingEnv
from tetrarec.sharding.group import LookupOptions, ShardedGroup
from tetrarec.sharding.plan import Shard, ShardingPlan, TablePlacement, TablePlan
from tetrarec.sharding.shard import check_ranks_agree, shard_collection, shard_model
from tetrarec.sharding.sharded_collection import ShardedEmbeddingBagCollection
from tetrarec.sharding.state_dict import copy_unsharded_state, local_blocks, unshard
from tetrarec.sharding.strategy import STRATEGIES, PlacementContext, plan_by_type

__all__ = [
    "STRATEGIES",
    "LookupOptions",
    "PlacementContext",
    "Shard",
    "ShardedEmbeddingBagCollection",
    "ShardedGroup",
    "ShardingEnv",
    "ShardingPlan",
    "TablePlacement",
    "TablePlan",
    "check_ranks_agree",
    "copy_unsharded_state",
    "local_blocks",
    "plan_by_type",
    "shard_collection",
    "shard_model",
    "unshard",
]
