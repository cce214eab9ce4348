"""``Communicator``: the only place in tetrarec that calls ``torch.distributed`` collectives.

Every collective of a step goes through one ``Communicator``, which

- starts it asynchronously and returns a ``Handle`` (``wait()`` when the result is needed);
- is autograd-aware where gradients flow back through it (all-to-all, reduce-scatter): the
  backward pass runs the mirror collective, also asynchronously;
- counts calls and bytes sent to other ranks per label (``stats``), for benchmarks and the
  planner's cost model; a later codec for reduced-precision communication hooks in here;
- waits with an explicit timeout and turns a failed or timed-out collective into a
  ``CollectiveError`` that names the rank and the collective;
- works with world size 1 (no process group: every collective is a local copy), so a
  sharded layout also runs, unchanged, in one process; with a process group, even of
  one rank, every collective goes through it (a one-GPU NCCL group runs NCCL's code);
- moves what it sends to its ``device`` when it lives elsewhere (NCCL takes CUDA
  tensors only, gloo CPU ones) and hands the result back on the caller's device, so a
  small host-side tensor (split sizes, a flag, JSON bytes) can be passed as is; large
  payloads (pooled rows, ids) are already on the device, and nothing is copied.

Worked examples, two ranks (R0, R1); rows are along dim 0 (each letter is one row):

all_to_all_v: rank r sends its rows in blocks ``send_splits[q]`` to rank q::

    R0: x = [a0 a1 | b0]   send_splits [2, 1]  ->  R0 gets [a0 a1 | c0]     recv [2, 1]
    R1: x = [c0 | d0 d1]   send_splits [1, 2]  ->  R1 gets [b0 | d0 d1]     recv [1, 2]

reduce_scatter_v: every rank sends block q of its rows to rank q, which sums them::

    R0: x = [a0 a1 | b0]   splits [2, 1]       ->  R0 gets [a0+c0, a1+c1]
    R1: x = [c0 c1 | d0]   splits [2, 1]       ->  R1 gets [b0+d0]

all_gather_v: every rank gets every rank's rows (sizes may differ)::

    R0: x = [a0 a1]        sizes [2, 1]        ->  both get [[a0 a1], [c0]]
    R1: x = [c0]

all_reduce: every rank gets the elementwise sum::

    R0: x = [1 2]                              ->  both get [4 6]
    R1: x = [3 4]
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tetrarec.comm.awaitable import Handle

__all__ = ["CollectiveError", "CollectiveStats", "Communicator"]

logger = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective failed or timed out (the message names the rank and the collective)."""


@dataclass
class CollectiveStats:
    """Calls of one labelled collective and the bytes this rank sent to other ranks."""

    calls: int = 0
    bytes_sent: int = 0


def _rows_bytes(x: torch.Tensor, rows: int) -> int:
    return rows * math.prod(x.shape[1:]) * x.element_size()


class Communicator:
    """The collectives of one process group (see the module docstring).

    Args:
        group: the process group; ``None`` with ``world_size == 1`` for one process.
        rank: this process's rank in ``group``.
        world_size: ranks in ``group``.
        timeout: how long a collective may take before it fails with ``CollectiveError``.
        device: where the group's collectives run (``cuda:<local rank>`` for NCCL, the
            CPU for gloo and for one process): what is sent lives there on the wire.

    Raises:
        ValueError: for a bad rank or a missing group with ``world_size > 1``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        device: torch.device | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if group is None and world_size > 1:
            raise ValueError(f"world size {world_size} needs a process group")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.device = torch.device("cpu") if device is None else device
        self.stats: dict[str, CollectiveStats] = {}
        self._warned: set[str] = set()

    @classmethod
    def single(cls) -> Communicator:
        """One process: every collective is a local copy."""
        return cls(None, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))

    @property
    def backend(self) -> str:
        """The process group's backend (``"gloo"``, ``"nccl"``), or ``"local"``."""
        return "local" if self.group is None else str(dist.get_backend(self.group))

    @property
    def local(self) -> bool:
        """True without a process group: every collective is a local copy."""
        return self.group is None

    def _wire(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the group's device (``x`` itself when it is there already)."""
        return x if self.local else x.to(self.device)

    # -- bookkeeping ------------------------------------------------------------------------

    def _count(self, label: str, nbytes: int) -> None:
        s = self.stats.setdefault(label, CollectiveStats())
        s.calls += 1
        s.bytes_sent += nbytes

    def reset_stats(self) -> None:
        """Forget the counted calls and bytes."""
        self.stats.clear()

    def _wait(self, work: Any, label: str) -> None:
        start = time.monotonic()
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            waited, limit = time.monotonic() - start, self.timeout.total_seconds()
            how = "timed out" if waited >= 0.9 * limit else "failed"
            raise CollectiveError(
                f"rank {self.rank}/{self.world_size}: collective {label!r} {how} after "
                f"{waited:.1f} s of waiting (timeout {limit:.0f} s; another rank may have "
                f"stopped with an error: see its log): {e}"
            ) from e

    def _note_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.info(message)

    def _check_splits(self, name: str, splits: Sequence[int]) -> list[int]:
        if len(splits) != self.world_size or min(splits, default=0) < 0:
            raise ValueError(
                f"rank {self.rank}: {name} needs {self.world_size} non-negative sizes, "
                f"got {list(splits)}"
            )
        return [int(s) for s in splits]

    # -- all-to-all -------------------------------------------------------------------------

    def _start_all_to_all(
        self, x: torch.Tensor, send: list[int], recv: list[int], label: str
    ) -> tuple[torch.Tensor, Any]:
        """Start the collective; return (output buffer on the group's device, work or None)."""
        x = self._wire(x)
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self._count(label, _rows_bytes(x, sum(send) - send[self.rank]))
        if self.local:
            out.copy_(x)
            return out, None
        work = dist.all_to_all_single(
            out, x.contiguous(), recv, send, group=self.group, async_op=True
        )
        return out, work

    def all_to_all_v(
        self,
        x: torch.Tensor,
        *,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        label: str,
    ) -> Handle[torch.Tensor]:
        """Send rows ``send_splits[q]`` to rank ``q``; receive ``recv_splits[q]`` from it.

        Autograd-aware: when ``x`` requires grad, backward sends the output's gradient
        back the same way (an all-to-all with the splits swapped), asynchronously.

        Args:
            x: ``(sum(send_splits), ...)`` rows, in destination-rank order.
            send_splits: rows for each rank.
            recv_splits: rows from each rank (must match what each rank sends here).
            label: the name under which the call is counted in ``stats``.

        Returns:
            A handle to the ``(sum(recv_splits), ...)`` received rows, in source order.

        Raises:
            ValueError: on split sizes that do not fit ``x`` or the world size.
        """
        send = self._check_splits("send_splits", send_splits)
        recv = self._check_splits("recv_splits", recv_splits)
        if sum(send) != x.shape[0]:
            raise ValueError(
                f"rank {self.rank}: {label}: send_splits sum to {sum(send)}, x has "
                f"{x.shape[0]} rows"
            )
        if x.requires_grad and torch.is_grad_enabled():
            pending = _Pending(self, send, recv, label, x.device)
            dummy = _AllToAllStart.apply(pending, x)  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
            return Handle(lambda: _AllToAllWait.apply(pending, dummy))  # type: ignore[no-untyped-call]
        out, work = self._start_all_to_all(x, send, recv, label)
        home = x.device

        def finish() -> torch.Tensor:
            if work is not None:
                self._wait(work, label)
            return out.to(home)

        return Handle(finish)

    # -- reduce-scatter -----------------------------------------------------------------------

    def reduce_scatter_v(
        self, x: torch.Tensor, *, splits: Sequence[int], label: str
    ) -> Handle[torch.Tensor]:
        """Send block ``q`` of ``x``'s rows to rank ``q``, which sums what every rank sent.

        Every rank must pass the same ``splits``. It runs as an all-to-all plus a local
        sum in rank order on every backend (gloo has no reduce-scatter; the rank-order
        sum gives the same bits on every run and rank count layout), logged once.
        Autograd-aware: the gradient of block ``q`` on every rank is rank ``q``'s output
        gradient.

        Args:
            x: ``(sum(splits), ...)`` rows.
            splits: rows of each rank's block.
            label: the name under which the call is counted in ``stats``.

        Returns:
            A handle to this rank's ``(splits[rank], ...)`` sums.

        Raises:
            ValueError: on split sizes that do not fit ``x`` or the world size.
        """
        sp = self._check_splits("splits", splits)
        if sum(sp) != x.shape[0]:
            raise ValueError(
                f"rank {self.rank}: {label}: splits sum to {sum(sp)}, x has {x.shape[0]} rows"
            )
        if self.world_size > 1:
            self._note_once(
                "reduce_scatter",
                f"reduce-scatter runs as all-to-all + a rank-order local sum on {self.backend}",
            )
        me = sp[self.rank]
        recv = [me] * self.world_size
        blocks = self.all_to_all_v(x, send_splits=sp, recv_splits=recv, label=label)

        def total(received: torch.Tensor) -> torch.Tensor:
            parts = received.view(self.world_size, me, *x.shape[1:])  # (W, me, ...)
            out = parts[0]
            for r in range(1, self.world_size):
                out = out + parts[r]
            return out if self.world_size > 1 else out.clone()

        return blocks.then(total)

    # -- all-gather, all-reduce ---------------------------------------------------------------

    def all_gather_v(
        self, x: torch.Tensor, *, sizes: Sequence[int], label: str
    ) -> Handle[list[torch.Tensor]]:
        """Every rank's rows, ``sizes[q]`` of them from rank ``q`` (no autograd).

        Raises:
            ValueError: if ``x`` does not have ``sizes[rank]`` rows.
        """
        sz = self._check_splits("sizes", sizes)
        if x.shape[0] != sz[self.rank]:
            raise ValueError(
                f"rank {self.rank}: {label}: x has {x.shape[0]} rows, sizes say {sz[self.rank]}"
            )
        self._count(label, _rows_bytes(x, x.shape[0] * (self.world_size - 1)))
        if self.local:
            return Handle.done([x.detach().clone()])
        home = x.device
        rows = max(sz)
        padded = self._wire(x.detach()).new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x.detach()
        outs = [torch.empty_like(padded) for _ in range(self.world_size)]
        work = dist.all_gather(outs, padded, group=self.group, async_op=True)

        def finish() -> list[torch.Tensor]:
            self._wait(work, label)
            return [o[:n].to(home) for o, n in zip(outs, sz)]

        return Handle(finish)

    def all_reduce(self, x: torch.Tensor, *, label: str) -> Handle[torch.Tensor]:
        """The elementwise sum of ``x`` over all ranks (a new tensor; no autograd)."""
        out = self._wire(x.detach()).clone()
        self._count(label, out.numel() * out.element_size() * (self.world_size > 1))
        if self.local:
            return Handle.done(out)
        home = x.device
        work = dist.all_reduce(out, group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            self._wait(work, label)
            return out.to(home)

        return Handle(finish)

    def all_reduce_future(
        self, x: torch.Tensor, *, label: str
    ) -> torch.futures.Future[torch.Tensor]:
        """Sum ``x`` over all ranks, in place; a future of it (a DDP gradient hook's form).

        ``x`` must live on the group's device (DDP's buckets do: they sit beside the
        parameters), since it is reduced in place.
        """
        self._count(label, x.numel() * x.element_size() * (self.world_size > 1))
        if self.local:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(x)
            return fut
        work = dist.all_reduce(x, group=self.group, async_op=True)
        done: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda f: f.value()[0])
        return done

    def all_gather_json(self, value: Any, *, label: str) -> list[Any]:
        """Every rank's JSON-serializable ``value``, in rank order (blocking).

        Used before the first step to check that all ranks agree (plan, tables, world
        size); JSON, never pickle, crosses the wire.
        """
        raw = list(json.dumps(value, sort_keys=True).encode())
        data = torch.tensor(raw, dtype=torch.uint8, device=self.device)
        sizes = self.all_gather_v(
            torch.tensor([data.numel()], device=self.device),
            sizes=[1] * self.world_size,
            label=label,
        ).wait()
        blobs = self.all_gather_v(data, sizes=[int(s[0]) for s in sizes], label=label).wait()
        return [json.loads(bytes(b.tolist()).decode()) for b in blobs]

    def barrier(self, *, label: str = "barrier") -> None:
        """Wait until every rank gets here (with the timeout)."""
        self.all_reduce(torch.zeros(1, device=self.device), label=label).wait()


class _Pending:
    """An autograd-aware all-to-all in flight: forward and backward buffers and work."""

    def __init__(
        self, comm: Communicator, send: list[int], recv: list[int], label: str, home: torch.device
    ) -> None:
        self.comm, self.send, self.recv, self.label = comm, send, recv, label
        self.home = home  # the caller's device: results and gradients are handed back there
        self.out: torch.Tensor | None = None
        self.work: Any = None
        self.grad_in: torch.Tensor | None = None
        self.grad_work: Any = None


class _AllToAllStart(torch.autograd.Function):
    """Forward: start the all-to-all. Backward: wait for the gradient's all-to-all."""

    @staticmethod
    def forward(ctx: Any, pending: _Pending, x: torch.Tensor) -> torch.Tensor:
        pending.out, pending.work = pending.comm._start_all_to_all(
            x.detach(), pending.send, pending.recv, pending.label
        )
        ctx.pending = pending
        return x.new_empty(0)  # links the graph to _AllToAllWait

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor) -> tuple[None, torch.Tensor]:
        p: _Pending = ctx.pending
        if p.grad_work is not None:
            p.comm._wait(p.grad_work, p.label + "/backward")
            p.grad_work = None
        assert p.grad_in is not None
        grad, p.grad_in = p.grad_in, None
        return None, grad.to(p.home)


class _AllToAllWait(torch.autograd.Function):
    """Forward: wait for the all-to-all. Backward: start the gradient's all-to-all."""

    @staticmethod
    def forward(ctx: Any, pending: _Pending, dummy: torch.Tensor) -> torch.Tensor:
        if pending.work is not None:
            pending.comm._wait(pending.work, pending.label)
            # A finished work still holds its buffers, among them the output returned
            # here, whose graph holds this context and so ``pending``: a cycle through C++
            # that Python's collector cannot see (it leaked every step's buffers).
            pending.work = None
        ctx.pending = pending
        assert pending.out is not None
        out, pending.out = pending.out, None
        return out.to(pending.home)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, torch.Tensor]:
        p: _Pending = ctx.pending
        p.grad_in, p.grad_work = p.comm._start_all_to_all(
            grad_out.contiguous(), p.recv, p.send, p.label + "/backward"
        )
        return None, grad_out.new_empty(0)
