"""Start and stop the process group of a ``torchrun`` launch; nothing else starts processes.

``torchrun --nproc-per-node N -m tetrarec train ...`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``launch_info``
reads them once, at start. The backend follows the device: gloo for CPU, NCCL for CUDA.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tetrarec.comm.collectives import Communicator

__all__ = [
    "LaunchInfo",
    "destroy",
    "init_from_env",
    "is_joined",
    "launch_info",
    "second_group",
]


@dataclass(frozen=True, kw_only=True)
class LaunchInfo:
    """Where this process sits in a launch.

    Args:
        rank: global rank.
        world_size: ranks in all.
        local_rank: rank within this node.
        local_world_size: ranks per node.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        """True when launched with more than one rank."""
        return self.world_size > 1


def launch_info(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """The launch torchrun describes in ``environ`` (default ``os.environ``).

    Raises:
        ValueError: on inconsistent values.
    """
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    info = LaunchInfo(
        rank=int(env.get("RANK", "0")),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )
    if not 0 <= info.rank < world or world % max(info.local_world_size, 1):
        raise ValueError(f"inconsistent torchrun environment: {info}")
    return info


def init_from_env(info: LaunchInfo, *, device: torch.device, timeout_s: float) -> Communicator:
    """Join the launch's process group (gloo on CPU, NCCL on CUDA) with ``timeout_s``.

    With one rank no group is created.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if not info.distributed:
        return Communicator(None, rank=0, world_size=1, timeout=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    return Communicator(
        dist.group.WORLD, rank=dist.get_rank(), world_size=dist.get_world_size(), timeout=timeout
    )


def second_group(comm: Communicator) -> Communicator:
    """A new process group over the same ranks (every rank must call it, in step).

    Collectives of two groups never wait on each other's order: the dense layers'
    gradient all-reduce runs on its own group beside the embedding all-to-alls.
    """
    if comm.world_size == 1:
        return Communicator(None, rank=0, world_size=1, timeout=comm.timeout)
    group = dist.new_group(ranks=list(range(comm.world_size)), timeout=comm.timeout)
    return Communicator(group, rank=comm.rank, world_size=comm.world_size, timeout=comm.timeout)


def is_joined() -> bool:
    """True when this process is already in a process group (its caller's to leave)."""
    return dist.is_initialized()


def destroy() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
