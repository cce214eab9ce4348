"""Collectives: the only package that calls ``torch.distributed`` (see ``collectives.py``)."""

from tetrarec.comm.awaitable import Handle
from tetrarec.comm.collectives import CollectiveError, CollectiveStats, Communicator
from tetrarec.comm.process_group import (
    LaunchInfo,
    destroy,
    init_from_env,
    is_joined,
    joined_backend,
    launch_info,
    second_group,
)

__all__ = [
    "CollectiveError",
    "CollectiveStats",
    "Communicator",
    "Handle",
    "LaunchInfo",
    "destroy",
    "init_from_env",
    "is_joined",
    "joined_backend",
    "launch_info",
    "second_group",
]
