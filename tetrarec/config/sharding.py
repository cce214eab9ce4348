"""``[sharding]``: how the tables are placed when a run is launched on several ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tetrarec.data.config import expand_home
from tetrarec.types import ShardingType

__all__ = ["ShardingConfig"]


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How the tables are placed when the run is launched on several ranks (torchrun).

    Args:
        type: one sharding type for every table, or one per table (``table_wise``,
            ``row_wise``, ``column_wise``, ``data_parallel``, ``table_row_wise``,
            ``table_column_wise``); tables are placed by type with bytes balanced over
            ranks (``tetrarec.sharding.plan_by_type``). Default (neither ``type`` nor
            ``plan``): the planner chooses (``tetrarec.planner``, on ``topology``).
        plan: a plan file (JSON, ``ShardingPlan.save``), instead of ``type``.
        column_block: column-wise block width (it must divide the tables' dim; default:
            one block per rank).
        local_world_size: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``);
            table-row-wise and table-column-wise tables stay inside one node.
        timeout_s: how long a collective may take before every rank stops with an error.
        topology: what the planner plans for when neither ``type`` nor ``plan`` is set:
            a preset name (``this-machine``, ``gpu-node-8``, ``zionex-16x8``) or a
            topology TOML file (``tetrarec bench calibrate --out``).
        stats: optional per-feature statistics for the planner (``tetrarec stats
            --json``); without them every feature has pooling 1 and uniform access.

    Raises:
        ValueError: if both ``type`` and ``plan`` are set, or on a bad number.
    """

    type: ShardingType | tuple[ShardingType, ...] | None = None
    plan: str | None = None
    column_block: int | None = None
    local_world_size: int = 0
    timeout_s: float = 300.0
    topology: str = "this-machine"
    stats: str | None = None

    def __post_init__(self) -> None:
        for name in ("plan", "stats"):
            object.__setattr__(self, name, expand_home(getattr(self, name)))
        if self.type is not None and self.plan is not None:
            raise ValueError(
                "set sharding.type or sharding.plan, not both (to use a plan with a config "
                "that sets a type: --set sharding.type=none)"
            )
        if (self.column_block is not None and self.column_block <= 0) or not (
            0 < self.timeout_s < math.inf
        ):
            raise ValueError(
                f"bad sharding settings: column_block={self.column_block}, "
                f"timeout_s={self.timeout_s}"
            )
        if self.local_world_size < 0:
            raise ValueError(f"sharding.local_world_size must be >= 0, got {self.local_world_size}")
