"""``SlotMap``: one cached table's slot maps and policy state (host tensors, no rows).

The rows themselves live in the parts of ``CachedEmbeddingBagCollection`` (the FP32
slots in part "cache", the backing rows in "ram" or "ssd"); this is the bookkeeping the
policy step reads and writes, always in host memory, also when the slots are on a
device (the policy decides on the host)::

    slot_rows  (C,) int64   row held by each slot, -1 when free
    row_slot   (E,) int32   slot of each row, -1 when not cached
    last_used  (C,) int64   LRU: the batch (clock) that last used the slot
    dirty      (C,) bool    updated since admission (an eviction writes it back)
    freq       (E,) int64   LFU: lookups per row, kept across evictions (else empty)
    counters   [clock, hits, misses, evictions, write_backs]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tetrarec.cache.policy import Admission, CachePolicy, plan_admission

__all__ = ["SlotMap", "unique_rows"]


class SlotMap:
    """One table's slot maps and policy state (plain host tensors; see the module docstring).

    Args:
        capacity: ``C``, the table's slots.
        rows: ``E``, the table's rows.
        policy: the cache policy (LFU keeps a count per row).
    """

    def __init__(self, capacity: int, rows: int, policy: CachePolicy) -> None:
        self.capacity = capacity
        self.policy = policy
        self.slot_rows = torch.full((capacity,), -1, dtype=torch.int64)  # row per slot
        self.row_slot = torch.full((rows,), -1, dtype=torch.int32)  # slot per row
        self.last_used = torch.zeros(capacity, dtype=torch.int64)  # LRU: batch number
        self.dirty = torch.zeros(capacity, dtype=torch.bool)  # updated since admission
        lfu = policy is CachePolicy.LFU
        self.freq = torch.zeros(rows if lfu else 0, dtype=torch.int64)  # LFU: lookups
        self.counters = [0, 0, 0, 0, 0]  # clock, hits, misses, evictions, write_backs

    def metadata_bytes(self) -> int:
        """Bytes of the maps and policy state."""
        tensors = (self.slot_rows, self.row_slot, self.last_used, self.dirty, self.freq)
        return sum(t.numel() * t.element_size() for t in tensors)

    def occupied(self) -> torch.Tensor:
        """``(n,)`` int64 slots that hold a row, ascending."""
        return torch.nonzero(self.slot_rows >= 0).flatten()

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """``(n,)`` int64 slot of each row (``-1``: not cached)."""
        return self.row_slot.index_select(0, rows).long()

    def plan_batch(
        self, ids: torch.Tensor, uniq: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, Admission]:
        """Count a training batch's hits and misses and plan its admissions.

        Args:
            ids: ``(N,)`` the batch's ids of this table.
            uniq: ``(U,)`` its unique rows, ascending.
            counts: ``(U,)`` how often each appears.

        Returns:
            ``(slots (U,) of the unique rows before the admission, the plan)``.
        """
        slots = self.slots_of(uniq)
        hit = slots >= 0
        hits = int(torch.where(hit, counts, 0).sum())
        self.counters[1] += hits
        self.counters[2] += ids.numel() - hits  # the counts add up to the ids
        if self.policy is CachePolicy.LFU:
            self.freq.index_add_(0, uniq, counts)
        # slot -1 (a miss) marks the extra last entry, dropped: no mask of the hits needed
        busy = torch.zeros(self.capacity + 1, dtype=torch.bool)
        busy.index_fill_(0, slots, True)
        miss = torch.nonzero(~hit).flatten()
        plan = plan_admission(
            self.policy,
            miss_rows=uniq.index_select(0, miss),
            miss_counts=counts.index_select(0, miss),
            slot_rows=self.slot_rows,
            busy=busy[:-1],
            last_used=self.last_used,
            freq=self.freq,
        )
        return slots, plan

    def dirty_among(self, slots: torch.Tensor) -> torch.Tensor:
        """The dirty ones of ``slots`` (int64), in their order."""
        return slots.masked_select(self.dirty.index_select(0, slots))

    def evicted(self, victims: torch.Tensor, written_back: int) -> None:
        """Free ``victims`` (their rows leave the cache) and count the eviction."""
        self.counters[3] += victims.numel()
        self.counters[4] += written_back
        self.row_slot.index_fill_(0, self.slot_rows.index_select(0, victims), -1)
        self.slot_rows.index_fill_(0, victims, -1)
        self.dirty.index_fill_(0, victims, False)

    def filled(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Record ``rows`` (int64) as admitted into ``slots`` (int64, free), clean."""
        self.row_slot.index_copy_(0, rows, slots.to(torch.int32))
        self.slot_rows.index_copy_(0, slots, rows)
        self.dirty.index_fill_(0, slots, False)

    #: The state-dict entries of a slot map (``cache.<table>.<name>``), besides ``rows``.
    SAVED = ("slot_rows", "dirty", "last_used", "freq", "counters")

    def saved(self) -> dict[str, torch.Tensor]:
        """``{name: copy}`` of the maps and counters, as a checkpoint holds them."""
        return {
            "slot_rows": self.slot_rows.clone(),
            "dirty": self.dirty.clone(),
            "last_used": self.last_used.clone(),
            "freq": self.freq.clone(),
            "counters": torch.tensor(self.counters, dtype=torch.int64),
        }

    def restore(self, saved: Mapping[str, torch.Tensor | None], table: str) -> None:
        """Load ``saved()``'s entries into this (fresh) map, checking their shapes.

        Args:
            saved: ``{name: tensor}`` for every name of ``SAVED``.
            table: the table's name, for the error message.

        Raises:
            ValueError: for an entry missing or of another shape than this map's.
        """
        for name in ("slot_rows", "dirty", "last_used", "freq"):
            value, dst = saved[name], getattr(self, name)
            if value is None or value.shape != dst.shape:
                got = None if value is None else tuple(value.shape)
                raise ValueError(
                    f"table {table!r}: the checkpoint's cache.{name} is {got}, "
                    f"this cache ({self.capacity} slots, policy {self.policy.value!r}) "
                    f"needs {tuple(dst.shape)}"
                )
            dst.copy_(value)
        counters = saved["counters"]
        assert counters is not None
        self.counters = [int(x) for x in counters.tolist()]
        occupied = self.occupied()
        self.row_slot[self.slot_rows[occupied]] = occupied.to(torch.int32)

    def used(self, slots: torch.Tensor) -> None:
        """End a training batch that used ``slots`` (``-1`` entries ignored): LRU, clock."""
        if self.policy is CachePolicy.LRU:
            self.last_used.index_fill_(0, slots.masked_select(slots >= 0), self.counters[0])
        self.counters[0] += 1


def unique_rows(ids: torch.Tensor, *, fits_int32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows ascending, counts)`` of ``ids``; int32 sorting when the ids fit (faster).

    Args:
        ids: ``(N,)`` int64 ids.
        fits_int32: the ids are known to lie in ``[0, 2**31]`` (checked against a table
            of at most ``2**31`` rows): sort them as int32, about twice as fast.
    """
    if fits_int32:
        # checked ids fit int32, whose sort is about twice as fast; same rows, counts
        ordered = torch.sort(ids.to(torch.int32)).values
        uniq32, counts = torch.unique_consecutive(ordered, return_counts=True)
        return uniq32.long(), counts
    uniq, counts = torch.unique(ids, return_counts=True)  # rows ascending
    return uniq, counts
