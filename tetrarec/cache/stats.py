"""What a cached collection reports: per-table counters and where its bytes are."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CacheMemory", "CacheStats"]


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


@dataclass(frozen=True, kw_only=True)
class CacheMemory:
    """Bytes a cached collection holds, by tier (all tables together).

    Args:
        backing_ram: backing rows held in process memory (``host`` and ``cached``
            tables), in their stored precision.
        backing_ssd: backing rows in memory-mapped files (``ssd`` tables).
        backing_state_ram: FP32 optimizer state of every row of the in-memory tables
            (the state of uncached rows, and a stale copy for cached ones).
        backing_state_ssd: the same for ``ssd`` tables, in their files.
        cache_rows: the FP32 rows of every cache slot.
        cache_state: the FP32 optimizer state of every cache slot (the live state of
            the cached rows).
        metadata: the slot maps and policy counters (row -> slot int32 per row,
            slot -> row, last use and dirty flag per slot, LFU's int64 count per row),
            always in process memory.
        backing_device: rows of ``device`` tables (uncached, in device memory: a GPU
            run only).
        backing_state_device: their FP32 optimizer state (device memory).
        cache_device: the device type of the cache slots and their state (``"cpu"``:
            process memory; ``"cuda"``: device memory, issue 11's device cache).
    """

    backing_ram: int
    backing_ssd: int
    backing_state_ram: int
    backing_state_ssd: int
    cache_rows: int
    cache_state: int
    metadata: int
    backing_device: int = 0
    backing_state_device: int = 0
    cache_device: str = "cpu"

    @property
    def weight_bytes(self) -> int:
        """Embedding weights without optimizer state: backing rows plus cache rows."""
        return self.backing_ram + self.backing_ssd + self.backing_device + self.cache_rows

    @property
    def ram_bytes(self) -> int:
        """Everything held in process memory (files and device memory excluded)."""
        cache = self.cache_rows + self.cache_state if self.cache_device == "cpu" else 0
        return self.backing_ram + self.backing_state_ram + cache + self.metadata

    @property
    def device_bytes(self) -> int:
        """Everything held in device memory (0 for a cache on the CPU)."""
        cache = self.cache_rows + self.cache_state if self.cache_device != "cpu" else 0
        return self.backing_device + self.backing_state_device + cache
