"""Rows and optimizer state moved between a table's backing rows and its FP32 slots.

Admission decodes backing rows into slots and copies their state; write-back (eviction,
flush) encodes slot rows into the backing rows with stochastic rounding and copies the
state back. A table's side of either is a ``TableRows``: views into a fused part.

``InPlaceRows`` moves them where both sides share a device (the CPU cache: one compiled
pass per direction); ``StagedRows`` where the slots are on a device and the backing rows
in host memory (issue 11's device cache), through host staging buffers, with bitwise the
same results. ``CachedEmbeddingBagCollection(force_staged_copies=True)`` runs the staged
path on the CPU too, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from tetrarec.kernels import ops
from tetrarec.types import Precision

__all__ = ["InPlaceRows", "RowMover", "StagedRows", "TableRows"]


@dataclasses.dataclass(frozen=True)
class TableRows:
    """One table's rows and optimizer state in one part (views into its flat storages).

    Args:
        rows: ``(E, width)`` the rows (slots: ``(C, D)`` FP32).
        state: ``{name: (E, w)}`` FP32 optimizer state.
        precision: the rows' precision.
    """

    rows: torch.Tensor
    state: dict[str, torch.Tensor]
    precision: Precision


class RowMover(Protocol):
    """How rows and state move between a table's backing side and its slots.

    Indices are host int64 tensors; ``rows`` distinct rows of the backing side,
    ``slots`` distinct slots.
    """

    def load(self, src: TableRows, rows: torch.Tensor, dst: TableRows, slots: torch.Tensor) -> None:
        """Admit: decode backing ``rows`` into ``slots``; copy their state."""
        ...

    def store(
        self,
        src: TableRows,
        slots: torch.Tensor,
        dst: TableRows,
        rows: torch.Tensor,
        flags: list[int],
    ) -> None:
        """Write back: encode ``slots`` into backing ``rows`` (``ops.store_rows`` flags)."""
        ...

    def copy_state_back(
        self, src: TableRows, slots: torch.Tensor, dst: TableRows, rows: torch.Tensor
    ) -> None:
        """The state of ``slots`` into backing ``rows``."""
        ...

    def refresh_state(
        self, src: TableRows, rows: torch.Tensor, dst: TableRows, slots: torch.Tensor
    ) -> None:
        """The backing state of ``rows`` into ``slots``."""
        ...


class InPlaceRows:
    """Row movement where slots and backing rows share a device (the CPU cache)."""

    @torch.no_grad()
    def load(self, src: TableRows, rows: torch.Tensor, dst: TableRows, slots: torch.Tensor) -> None:
        """Admit: decode backing ``rows`` into ``slots`` (int64, distinct); copy their state."""
        # one pass: gather, decode and scatter each row (the kernels' codec)
        ops.load_rows(src.rows, rows, dst.rows, slots, src.precision.value)
        # index_select / index_copy_ / index_fill_: the same elements as t[i] and
        # t[i] = v for distinct indices, a fraction of advanced indexing's cost
        for name, out in dst.state.items():
            out.index_copy_(0, slots, src.state[name].index_select(0, rows))

    @torch.no_grad()
    def store(
        self,
        src: TableRows,
        slots: torch.Tensor,
        dst: TableRows,
        rows: torch.Tensor,
        flags: list[int],
    ) -> None:
        """Write back: encode the FP32 ``slots`` into backing ``rows``; copy their state.

        Args:
            src: the slots' side.
            slots: ``(n,)`` int64 slots.
            dst: the backing side.
            rows: ``(n,)`` int64 distinct rows they hold.
            flags: ``ops.store_rows``'s ``[stochastic, seed, iteration, row_key, col_start]``.
        """
        # The draws the kernel would make for these rows at this iteration, drawn,
        # encoded and scattered row by row in one pass (ops.store_rows).
        ops.store_rows(src.rows, slots, dst.rows, rows, dst.precision.value, flags)
        for name, s in src.state.items():
            dst.state[name].index_copy_(0, rows, s.index_select(0, slots))

    @torch.no_grad()
    def copy_state_back(
        self, src: TableRows, slots: torch.Tensor, dst: TableRows, rows: torch.Tensor
    ) -> None:
        """The state of ``slots`` into backing ``rows`` (rows unchanged)."""
        for name, s in src.state.items():
            dst.state[name][rows] = s[slots]

    @torch.no_grad()
    def refresh_state(
        self, src: TableRows, rows: torch.Tensor, dst: TableRows, slots: torch.Tensor
    ) -> None:
        """The backing state of ``rows`` into ``slots`` (after a checkpoint load)."""
        for name, d in dst.state.items():
            d[slots] = src.state[name][rows]


class StagedRows:
    """Row movement between FP32 slots on ``device`` and backing rows in host memory.

    The slots' side is on ``device`` (a GPU; or the CPU, when the staged path is forced
    there to test it); the backing side, the slot maps and every index are on the host.
    Each call moves its rows in one direction with one batched copy each way:

    - ``load`` (admission): gather and decode the backing rows on the host (the same
      ``ops.load_rows`` codec) into a staging buffer (pinned on CUDA), gather their
      state likewise, send them with ``.to(device, non_blocking=True)``, then
      ``index_copy_`` them into the slots.
    - ``store`` (eviction, flush): ``index_select`` the slots' rows and state on the
      device, one ``.cpu()`` of them side by side, then ``ops.store_rows`` on the host
      exactly as the in-place path (the rounding draws are a function of ``(seed,
      iteration, row, column)``, so the stored bits equal the CPU cache's).

    Args:
        device: where the slots live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"

    def _staging(self, n: int, width: int) -> torch.Tensor:
        # A fresh buffer per call: torch's pinned-memory allocator does not reuse it
        # before the asynchronous copy that reads it has finished.
        return torch.empty((n, width), dtype=torch.float32, pin_memory=self._pin)

    @torch.no_grad()
    def load(self, src: TableRows, rows: torch.Tensor, dst: TableRows, slots: torch.Tensor) -> None:
        """Admit: decode backing ``rows`` into ``slots`` (int64, distinct); copy their state."""
        n = rows.numel()
        staged = self._staging(n, dst.rows.shape[1])  # (n, D)
        ops.load_rows(src.rows, rows, staged, torch.arange(n), src.precision.value)
        to_slots = slots.to(self.device, non_blocking=True)
        dst.rows.index_copy_(0, to_slots, staged.to(self.device, non_blocking=True))
        for name, out in dst.state.items():
            state = self._staging(n, out.shape[1])  # (n, w)
            torch.index_select(src.state[name], 0, rows, out=state)
            out.index_copy_(0, to_slots, state.to(self.device, non_blocking=True))

    @torch.no_grad()
    def _fetch(
        self, src: TableRows, slots: torch.Tensor, *, rows: bool
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The slots' rows (if ``rows``) and state, on the host, in one device-to-host copy."""
        at = slots.to(self.device, non_blocking=True)
        parts = [src.rows.index_select(0, at)] if rows else []
        parts += [s.index_select(0, at) for s in src.state.values()]
        if not parts:  # no rows asked for, no optimizer state (SGD)
            return None, {}
        host = torch.cat(parts, dim=1).cpu()  # (n, D + sum w): one copy (syncs)
        col, got = 0, None
        if rows:
            col = src.rows.shape[1]
            got = host[:, :col].contiguous()
        state = {}
        for name, s in src.state.items():
            state[name] = host[:, col : col + s.shape[1]]
            col += s.shape[1]
        return got, state

    @torch.no_grad()
    def store(
        self,
        src: TableRows,
        slots: torch.Tensor,
        dst: TableRows,
        rows: torch.Tensor,
        flags: list[int],
    ) -> None:
        """Write back: encode the FP32 ``slots`` into backing ``rows``; copy their state.

        Args:
            src: the slots' side (on the device).
            slots: ``(n,)`` int64 slots.
            dst: the backing side (host).
            rows: ``(n,)`` int64 distinct rows they hold.
            flags: ``ops.store_rows``'s ``[stochastic, seed, iteration, row_key, col_start]``.

        Syncs:
            Once (the device-to-host copy of the rows and state).
        """
        staged, state = self._fetch(src, slots, rows=True)
        assert staged is not None
        n = rows.numel()
        ops.store_rows(staged, torch.arange(n), dst.rows, rows, dst.precision.value, flags)
        for name, s in state.items():
            dst.state[name].index_copy_(0, rows, s)

    @torch.no_grad()
    def copy_state_back(
        self, src: TableRows, slots: torch.Tensor, dst: TableRows, rows: torch.Tensor
    ) -> None:
        """The state of ``slots`` into backing ``rows`` (rows unchanged). Syncs once."""
        _, state = self._fetch(src, slots, rows=False)
        for name, s in state.items():
            dst.state[name].index_copy_(0, rows, s)

    @torch.no_grad()
    def refresh_state(
        self, src: TableRows, rows: torch.Tensor, dst: TableRows, slots: torch.Tensor
    ) -> None:
        """The backing state of ``rows`` into ``slots`` (after a checkpoint load)."""
        to_slots = slots.to(self.device, non_blocking=True)
        for name, d in dst.state.items():
            state = self._staging(rows.numel(), d.shape[1])
            torch.index_select(src.state[name], 0, rows, out=state)
            d.index_copy_(0, to_slots, state.to(self.device, non_blocking=True))
