"""``ShardingEnv``: the process group, topology and device a sharded module runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tetrarec.comm import Communicator

__all__ = ["ShardingEnv"]


@dataclass(frozen=True)
class ShardingEnv:
    """Where a sharded module runs.

    Args:
        comm: the collectives of the embedding all-to-alls (rank and world size).
        local_world_size: ranks per node; table-row-wise and table-column-wise tables
            stay inside one node of this many ranks (torchrun's ``LOCAL_WORLD_SIZE``).
        device: where this rank's rows live.
        dense_comm: the collectives of the dense layers' gradient all-reduce, a
            separate process group so that its calls never interleave with the
            embedding all-to-alls (default: ``comm``, for one process).

    Raises:
        ValueError: if the world is not a whole number of nodes.
    """

    comm: Communicator
    local_world_size: int = 0  # 0: every rank on one node
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dense_comm: Communicator | None = None

    def __post_init__(self) -> None:
        if self.local_world_size == 0:
            object.__setattr__(self, "local_world_size", self.comm.world_size)
        if self.local_world_size < 1 or self.comm.world_size % self.local_world_size:
            raise ValueError(
                f"world size {self.comm.world_size} is not a multiple of the ranks per node "
                f"{self.local_world_size} (sharding.local_world_size, or torchrun's "
                "LOCAL_WORLD_SIZE)"
            )

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ShardingEnv:
        """One process, no process group."""
        return cls(Communicator.single(), 1, torch.device(device))

    @property
    def rank(self) -> int:
        """This rank."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return self.comm.world_size

    @property
    def num_nodes(self) -> int:
        """Nodes in all."""
        return self.world_size // self.local_world_size

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """The ranks of ``node``."""
        return tuple(range(node * self.local_world_size, (node + 1) * self.local_world_size))
