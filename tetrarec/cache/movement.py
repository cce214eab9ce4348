"""Rows and optimizer state moved between a table's backing rows and its FP32 slots.

Admission decodes backing rows into slots and copies their state; write-back (eviction,
flush) encodes slot rows into the backing rows with stochastic rounding and copies the
state back. A table's side of either is a ``TableRows``: views into a fused part.
"""

from __future__ import annotations

import dataclasses

import torch

from tetrarec.kernels import ops
from tetrarec.types import Precision

__all__ = ["InPlaceRows", "TableRows"]


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
