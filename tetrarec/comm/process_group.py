"""Start and stop the process group of a ``torchrun`` launch; nothing else starts processes.

``torchrun --nproc-per-node N -m tetrarec train ...`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``launch_info``
reads them once, at start. The backend follows the device: gloo for CPU, NCCL for CUDA
(``backend_for``); each rank's device is ``cuda:LOCAL_RANK`` on a GPU node
(``TrainConfig.resolve_device``).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tetrarec.comm.collectives import CollectiveError, Communicator

__all__ = [
    "LaunchInfo",
    "backend_for",
    "destroy",
    "init_from_env",
    "is_joined",
    "joined_backend",
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


def backend_for(device: torch.device) -> str:
    """The collectives backend of ``device``: ``"nccl"`` for CUDA, ``"gloo"`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(info: LaunchInfo, *, device: torch.device, timeout_s: float) -> Communicator:
    """Join the launch's process group (gloo on CPU, NCCL on CUDA) with ``timeout_s``.

    With one rank no group is created. On CUDA the process first makes ``device`` its
    current GPU (``torch.cuda.set_device``), so that NCCL binds each rank to its own
    GPU (``cuda:LOCAL_RANK``) and not every rank to GPU 0. A group the caller already
    joined is used as it is, and must be of the device's backend.

    Raises:
        ValueError: if an existing group's backend does not fit ``device``.
        CollectiveError: if joining fails or times out (a rank missing or late).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if not info.distributed:
        return Communicator(None, rank=0, world_size=1, timeout=timeout, device=device)
    backend = backend_for(device)
    joined = joined_backend()  # "gloo", "nccl", "cpu:gloo,cuda:nccl", or None
    if joined is not None and backend not in joined:
        raise ValueError(
            f"this process already joined a {joined} process group, but its device {device} "
            f"needs {backend} (NCCL for CUDA, gloo for the CPU): set train.device to match"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if joined is None:
        try:
            dist.init_process_group(backend=backend, timeout=timeout)
        except RuntimeError as e:  # DistStoreError (a rank missing), gloo's connect errors
            raise CollectiveError(
                f"rank {info.rank}: joining the {backend} process group of "
                f"{info.world_size} ranks failed within sharding.timeout_s = {timeout_s:g} s "
                f"(did every rank start, and in time?): {type(e).__name__}: {e}"
            ) from e
    return Communicator(
        dist.group.WORLD,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        timeout=timeout,
        device=device,
    )


def second_group(comm: Communicator) -> Communicator:
    """A new process group over the same ranks (every rank must call it, in step).

    Collectives of two groups never wait on each other's order: the dense layers'
    gradient all-reduce runs on its own group beside the embedding all-to-alls. It has
    ``comm``'s backend and device.
    """
    if comm.local:
        return Communicator(None, rank=0, world_size=1, timeout=comm.timeout, device=comm.device)
    group = dist.new_group(ranks=list(range(comm.world_size)), timeout=comm.timeout)
    return Communicator(
        group, rank=comm.rank, world_size=comm.world_size, timeout=comm.timeout, device=comm.device
    )


def is_joined() -> bool:
    """True when this process is already in a process group (its caller's to leave)."""
    return dist.is_initialized()


def joined_backend() -> str | None:
    """The backend of the process group this process is in (``"gloo"``, ``"nccl"``), or ``None``."""
    return str(dist.get_backend()) if dist.is_initialized() else None


def destroy(*, barrier: bool = False) -> None:
    """Leave the process group, if one was joined.

    Args:
        barrier: first wait until every rank is here (a run that completed; never after
            a failure, when a peer may be gone and the barrier would wait for it until
            the group's timeout).
    """
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
