"""``run_ranks``: run a function on ``world_size`` gloo ranks, with timeouts and tracebacks.

The harness of every multi-process test (STYLE.md section 6)::

    results = run_ranks(worker, world_size=2, args=(case,), timeout_s=120)
    # results[r] is what worker(ctx, case) returned on rank r

- ranks are ``spawn``ed processes (a fresh interpreter each) that rendezvous through a
  ``FileStore`` in a fresh temporary directory: no port is guessed, none can collide;
- the parent joins with a deadline and kills stragglers; a rank that raises sends its
  traceback back, and the parent's error shows it (not just "exit code 1");
- each rank runs with deterministic algorithms, one intra-op thread (the ranks share the
  machine's cores) and ``torch.manual_seed(rank)``;
- the worker is a module-level function (spawn imports it by name) taking a
  ``RankContext`` and picklable arguments; it returns picklable results. Run many cases
  in one call: each spawn pays for importing torch on every rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import FileStore  # type: ignore[attr-defined]  # exported at run time only

from tetrarec.comm import Communicator

__all__ = ["RankContext", "RankFailedError", "run_ranks"]


@dataclass(frozen=True)
class RankContext:
    """What a worker gets: its rank, the world and the communicator of the group.

    Args:
        rank: this rank.
        world_size: ranks in all.
        local_world_size: ranks per (simulated) node.
        comm: the collectives of the group.
    """

    rank: int
    world_size: int
    local_world_size: int
    comm: Communicator


class RankFailedError(RuntimeError):
    """One or more ranks failed or timed out; the message holds their tracebacks."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    local_world_size: int,
    store_path: str,
    collective_timeout_s: float,
    deterministic: bool,
    args: Sequence[Any],
    out: Any,
) -> None:
    try:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(deterministic)
        torch.manual_seed(rank)
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        store = FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        try:
            comm = Communicator(dist.group.WORLD, rank=rank, world_size=world_size, timeout=timeout)
            ctx = RankContext(rank, world_size, local_world_size, comm)
            out.put((rank, "ok", _to_wire(fn(ctx, *args))))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    local_world_size: int | None = None,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
    deterministic: bool = True,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    Args:
        fn: a module-level function ``(RankContext, *args) -> picklable``.
        world_size: ranks to start.
        args: picklable arguments, the same on every rank.
        local_world_size: ranks per simulated node (default: all on one node).
        timeout_s: the whole run's deadline; stragglers are killed after it.
        collective_timeout_s: each collective's timeout.
        deterministic: run under ``torch.use_deterministic_algorithms`` (tests; it also
            fills new tensors with NaN, which catches reads of unwritten memory).

    Raises:
        RankFailedError: if a rank raised (with its traceback), exited without a result,
            or the deadline passed.
    """
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()  # multiprocessing's queue (typeshed types it apart)
    with tempfile.TemporaryDirectory(prefix="tetrarec-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    fn,
                    r,
                    world_size,
                    local_world_size or world_size,
                    store,
                    collective_timeout_s,
                    deterministic,
                    tuple(args),
                    results,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                got[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    failures = [f"rank {r}:\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        why = "timed out" if time.monotonic() >= deadline else "exited without a result"
        failures.append(f"ranks {missing} {why} (deadline {timeout_s:.0f} s)")
    if failures:
        raise RankFailedError("\n".join(failures))
    return [_from_wire(got[r][1]) for r in range(world_size)]


def _to_wire(value: Any) -> Any:
    """Tensors as (dtype, shape, bytes), sent by value.

    So no shared-memory file descriptor has to outlive the rank that sent it.
    """
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return (
            "__tensor__",
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            t.view(-1).view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_wire(v) for v in value)
    return value


def _from_wire(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
        _, dtype, shape, data = value
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape).clone()
    if isinstance(value, dict):
        return {k: _from_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_from_wire(v) for v in value)
    return value
