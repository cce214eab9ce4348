"""What every embedding collection reports to the trainer: its tables and cache counters.

The trainer asks the run's embedding module (the reference, fused, cached or sharded
collection) two things without asking which it holds: which blocks of which tables
this process holds (``shard_layout``: an unsharded collection holds its whole tables)
and what its caches counted (``cache_stats``, ``counted_cache_stats``,
``cached_rows``: empty for a collection without a cache)::

    unsharded, tables t (10 x 4) and u (6 x 8):
      shard_layout()  [{"name": "t", "table": "t", "rows": [0, 10], "cols": [0, 4]},
                       {"name": "u", "table": "u", "rows": [0, 6], "cols": [0, 8]}]
    sharded, rank 1 holding rows [5, 10) of t:
      shard_layout()  [{"name": "t@r5", "table": "t", "rows": [5, 10], "cols": [0, 4]}]

``CacheStats`` lives here, below every collection that reports it (its public home is
``tetrarec.cache``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from tetrarec.embedding.config import TableConfig

__all__ = [
    "CacheCounters",
    "CacheStats",
    "HeldTables",
    "UncachedWholeTables",
    "whole_tables_layout",
]


@dataclass(frozen=True, kw_only=True)
class CacheStats:
    """Counters of one table's cache since it was built (or restored from a checkpoint).

    Counted in training forwards only (``module.training`` with grad enabled); an
    evaluation forward reads the cache without changing it or these counters.

    Args:
        table: the table's name (``"*"`` for a sum over tables).
        capacity: slots.
        occupied: slots holding a row now.
        hits: ids looked up whose row was cached before the batch's admissions.
        misses: the other ids looked up (``hits + misses`` = ids looked up).
        evictions: rows that left the cache.
        write_backs: evicted rows written back to the backing store (those updated
            since their admission); checkpoint flushes are not counted.
    """

    table: str
    capacity: int
    occupied: int
    hits: int
    misses: int
    evictions: int
    write_backs: int

    @property
    def lookups(self) -> int:
        """Ids looked up: ``hits + misses``."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """``hits / lookups`` (0 before the first lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0

    @classmethod
    def total(cls, stats: Iterable[CacheStats]) -> CacheStats:
        """The sum of several tables' counters, named ``"*"``."""
        items = list(stats)
        return cls(
            table="*",
            capacity=sum(s.capacity for s in items),
            occupied=sum(s.occupied for s in items),
            hits=sum(s.hits for s in items),
            misses=sum(s.misses for s in items),
            evictions=sum(s.evictions for s in items),
            write_backs=sum(s.write_backs for s in items),
        )


class CacheCounters(Protocol):
    """The counters of a module's caches, keyed by the module's own table names."""

    def cache_stats(self) -> dict[str, CacheStats]:
        """``{table: CacheStats}`` for every cached table (``{}`` without a cache)."""
        ...

    def cached_rows(self) -> dict[str, torch.Tensor]:
        """``{table: rows its cache holds, ascending}`` (``{}`` without a cache)."""
        ...


@runtime_checkable
class HeldTables(CacheCounters, Protocol):
    """An embedding collection as the trainer sees it (module docstring).

    Unsharded collections hold whole tables and count every lookup themselves; a
    sharded one holds this rank's blocks and says which of its counters count a table's
    lookups for the world (each lookup once, summed over the ranks).
    """

    def shard_layout(self) -> list[dict[str, Any]]:
        """Each local table: its ``name``, global ``table``, ``rows`` and ``cols``."""
        ...

    def counted_cache_stats(self) -> dict[str, CacheStats]:
        """The ``cache_stats`` that, summed over the ranks, count each lookup once."""
        ...


def whole_tables_layout(tables: Sequence[TableConfig]) -> list[dict[str, Any]]:
    """The ``shard_layout`` of an unsharded collection: every table, whole."""
    return [
        {"name": t.name, "table": t.name, "rows": [0, t.num_embeddings], "cols": [0, t.dim]}
        for t in tables
    ]


class UncachedWholeTables:
    """The ``HeldTables`` answers of an unsharded collection without a cache.

    A mixin for the reference and the fused collections (written once, not in each):
    every table held whole, no cache counters, no cached rows. The class sets
    ``tables``.
    """

    tables: tuple[TableConfig, ...]

    def shard_layout(self) -> list[dict[str, Any]]:
        """Every table, whole (``whole_tables_layout``)."""
        return whole_tables_layout(self.tables)

    def cache_stats(self) -> dict[str, CacheStats]:
        """``{}``: no table is cached."""
        return {}

    def counted_cache_stats(self) -> dict[str, CacheStats]:
        """``{}``: no table is cached."""
        return {}

    def cached_rows(self) -> dict[str, torch.Tensor]:
        """``{}``: no table is cached."""
        return {}
