"""``CacheSpec``: the policy and size of the mixed-precision caches of a collection.

Size is given one way, as a fraction of each table's rows or as a byte budget for all
cached tables together::

    fraction = 0.05      every cached table gets floor(0.05 * rows) slots
    bytes = 2**20        the same fraction for every cached table, the largest whose
                         slots (FP32 row + FP32 optimizer state, ``slot_bytes``) fit
                         in 1 MiB in all: fraction = bytes / sum(rows_t * slot_bytes_t)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tetrarec.cache.policy import CachePolicy
from tetrarec.embedding import TableConfig
from tetrarec.kernels.optim_rules import state_layout
from tetrarec.types import OptimizerKind

__all__ = ["CacheSpec", "slot_bytes"]


def slot_bytes(dim: int, kind: OptimizerKind) -> int:
    """Bytes one cache slot takes: the FP32 row plus its FP32 optimizer state."""
    return 4 * (dim + sum(state_layout(kind, dim).values()))


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """How the cached tables of a collection cache their rows.

    Args:
        policy: ``lru``, ``lfu`` or ``static`` (see ``tetrarec.cache.policy``).
        fraction: slots per cached table as a fraction of its rows, in [0, 1].
        bytes: or a budget in bytes for the slots of all cached tables together.
        directory: where the ``ssd`` placement puts its memory-mapped files (default:
            the system's temporary directory, which is often a RAM-backed tmpfs: point
            it at the SSD).

    Raises:
        ValueError: if both or neither of ``fraction`` and ``bytes`` are given, or
            either is out of range; the message names the field.
    """

    policy: CachePolicy = CachePolicy.LRU
    fraction: float | None = None
    bytes: int | None = None
    directory: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", CachePolicy.parse(self.policy))
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError(
                "cache: give exactly one of fraction (of each table's rows) or bytes "
                f"(a budget for all cached tables), got fraction={self.fraction} "
                f"bytes={self.bytes}"
            )
        if self.fraction is not None and not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"cache.fraction must be in [0, 1], got {self.fraction}")
        if self.bytes is not None and self.bytes < 0:
            raise ValueError(f"cache.bytes must be >= 0, got {self.bytes}")

    def capacities(self, tables: Sequence[TableConfig], kind: OptimizerKind) -> dict[str, int]:
        """Slots of each of ``tables`` (the cached ones).

        Args:
            tables: the cached tables.
            kind: the optimizer, whose state each slot also holds.

        Returns:
            ``{table name: slots}``, each in ``[0, rows]``.
        """
        if self.fraction is not None:
            return {
                t.name: min(t.num_embeddings, math.floor(self.fraction * t.num_embeddings))
                for t in tables
            }
        assert self.bytes is not None  # __post_init__ guarantees one of the two
        total = sum(t.num_embeddings * slot_bytes(t.dim, kind) for t in tables)
        out = {}
        for t in tables:
            # integer arithmetic: sum(slots_t * slot_bytes_t) <= bytes exactly
            slots = self.bytes * t.num_embeddings // total if total else 0
            out[t.name] = min(t.num_embeddings, slots)
        return out
