"""Rank workers of the sharded training tests (``tests/distributed/test_sharded_training.py``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tetrarec.comm import LaunchInfo
from tetrarec.config import RunConfig
from tetrarec.testing.multiprocess import RankContext

__all__ = ["Scenario", "train_worker"]


@dataclass(frozen=True)
class Scenario:
    """One ``train`` call on every rank.

    Args:
        name: what it is.
        overrides: config overrides, the same on every rank...
        rank_overrides: ...plus these on some ranks (rank -> overrides).
        resume: continue from the newest checkpoint.
        stop_rank: the rank whose ``stop`` event is set before it trains (``None``:
            none): every rank must stop after the same step, with its checkpoint.
    """

    name: str
    overrides: tuple[str, ...]
    rank_overrides: tuple[tuple[int, tuple[str, ...]], ...] = ()
    resume: bool = False
    stop_rank: int | None = None


def train_worker(ctx: RankContext, scenarios: Sequence[Scenario]) -> list[dict[str, Any]]:
    """Run each scenario on this rank; its summary, or the error it raised."""
    from tetrarec.train import train

    launch = LaunchInfo(
        rank=ctx.rank,
        world_size=ctx.world_size,
        local_rank=ctx.rank % ctx.local_world_size,
        local_world_size=ctx.local_world_size,
    )
    out: list[dict[str, Any]] = []
    for sc in scenarios:
        extra = dict(sc.rank_overrides).get(ctx.rank, ())
        try:
            config = RunConfig().with_overrides([*sc.overrides, *extra])
            stop = threading.Event()
            if sc.stop_rank == ctx.rank:
                stop.set()
            result = train(config, resume=sc.resume, launch=launch, stop=stop)
            out.append({"ok": True, **result.to_dict()})
        except Exception as e:
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return out
