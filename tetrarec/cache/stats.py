"""What a cached collection reports: per-table counters and where its bytes are.

``cache_stats`` and ``cache_memory`` compute them (what the collection's ``cache_stats``
and ``memory`` return).

``CacheStats`` is defined with the report every embedding collection gives
(``tetrarec.embedding.report``: a collection without a cache reports none) and is
re-exported here, its public home.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tetrarec.cache.parts import CACHE, DEV, RAM, SSD
from tetrarec.embedding.report import CacheStats

if TYPE_CHECKING:
    from tetrarec.cache.collection import CachedEmbeddingBagCollection

__all__ = ["CacheMemory", "CacheStats", "cache_memory", "cache_stats"]


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


def cache_stats(ebc: CachedEmbeddingBagCollection) -> dict[str, CacheStats]:
    """``ebc.cache_stats()``: the counters of every cached table, by name."""
    out = {}
    for i, c in ebc._caches.items():
        _, hits, misses, evictions, write_backs = c.counters
        out[ebc.tables[i].name] = CacheStats(
            table=ebc.tables[i].name,
            capacity=c.capacity,
            occupied=int((c.slot_rows >= 0).sum()),
            hits=hits,
            misses=misses,
            evictions=evictions,
            write_backs=write_backs,
        )
    return out


def cache_memory(ebc: CachedEmbeddingBagCollection) -> CacheMemory:
    """``ebc.memory()``: bytes by tier, summed over the parts of each kind."""
    sizes = {CACHE: [0, 0], RAM: [0, 0], SSD: [0, 0], DEV: [0, 0]}
    for part in ebc._parts:
        m = part.module
        sizes[part.kind][0] += sum(w.numel() * w.element_size() for w in m.storages())
        sizes[part.kind][1] += sum(
            s.numel() * 4 for st in range(len(m._stores)) for s in m._states(st)
        )
    return CacheMemory(
        backing_ram=sizes[RAM][0],
        backing_ssd=sizes[SSD][0],
        backing_state_ram=sizes[RAM][1],
        backing_state_ssd=sizes[SSD][1],
        cache_rows=sizes[CACHE][0],
        cache_state=sizes[CACHE][1],
        metadata=sum(c.metadata_bytes() for c in ebc._caches.values()),
        backing_device=sizes[DEV][0],
        backing_state_device=sizes[DEV][1],
        cache_device=ebc.device.type,
    )
