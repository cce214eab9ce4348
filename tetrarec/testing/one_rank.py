"""This process as the only rank of a process group (tests of one-rank collectives).

A world of one still runs its collectives through the backend (gloo, or NCCL on one
GPU), which is how one device exercises the communicator's device handling.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from tetrarec.comm import Communicator

__all__ = ["one_rank_group"]


@contextlib.contextmanager
def one_rank_group(tmp_path: Path, backend: str, device: str) -> Iterator[Communicator]:
    """This process as the only rank of a ``backend`` group, rendezvous by file.

    Args:
        tmp_path: a directory for the file store.
        backend: ``"gloo"`` or ``"nccl"``.
        device: ``"cpu"`` or ``"cuda"`` (``cuda:0``): the communicator's device.

    Yields:
        The group's communicator; the group is destroyed on exit.
    """
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=60)
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    try:
        yield Communicator(dist.group.WORLD, rank=0, world_size=1, timeout=timeout, device=dev)
    finally:
        dist.destroy_process_group()
