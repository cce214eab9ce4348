"""The collective timeout the config sets (``sharding.timeout_s``) is the one the process
groups get (issue 31, item 6).

A rank that hangs is caught only by the collective timeout; a timeout dropped on the
way (``init_process_group`` called without it, a second group made with torch's
default of 30 minutes) would leave every other rank waiting that long. The groups are
joined as a torchrun launch joins them (``sharding_env``, env:// rendezvous), here as
the only rank: one process, gloo, ``MASTER_PORT=0`` (the operating system picks a free
port, so no port is guessed), and each group's timeout is read back from gloo.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tetrarec.comm import LaunchInfo
from tetrarec.config import RunConfig
from tetrarec.train.distributed import sharding_env


def _gloo_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    timeout: datetime.timedelta = group._get_backend(torch.device("cpu")).options._timeout
    return timeout


@pytest.mark.parametrize("seconds", [37.0, 4.5])
def test_the_process_groups_get_the_configs_collective_timeout(monkeypatch, seconds) -> None:
    """Both groups (the embeddings' and the dense layers' second group) time out after
    ``sharding.timeout_s``; a group joined without it gets torch's default (30 min for
    gloo) and fails here."""
    assert not dist.is_initialized(), "another test left a process group joined"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = RunConfig().with_overrides(
        [f"sharding.timeout_s={seconds}", "sharding.local_world_size=1", "data.batch_size=8"]
    )
    # A launch of two ranks makes sharding_env join a group (one rank needs none); the
    # env:// rendezvous above makes it a group of this process alone.
    launch = LaunchInfo(rank=0, world_size=2, local_rank=0, local_world_size=2)
    try:
        env = sharding_env(config, launch, torch.device("cpu"))
        want = datetime.timedelta(seconds=seconds)
        assert env.comm.timeout == want
        assert _gloo_timeout(dist.group.WORLD) == want
        assert env.dense_comm is not None
        assert env.dense_comm.group is not dist.group.WORLD
        assert _gloo_timeout(env.dense_comm.group) == want
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
