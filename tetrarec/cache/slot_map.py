"""``SlotMap``: one cached table's slot maps and policy state (host tensors, no rows).

The rows themselves live in the parts of ``CachedEmbeddingBagCollection`` (the FP32
slots in part "cache", the backing rows in "ram" or "ssd"); this is the bookkeeping the
policy step reads and writes, always in host memory, also when the slots are on a
device (the policy decides on the host)::

    row_map    (E,) int32   per row: >= 0 not cached (LFU: its lookup count; else 0),
                            < 0 cached in slot ~value (bitwise not: slot s is -s - 1)
    slot_rows  (C,) int32   row held by each slot, -1 when free (int64 for tables of
                            more than 2**31 - 1 rows)
    dirty      (C,) bool    updated since admission (an eviction writes it back)
    last_used  (C,) int64   LRU: the batch (clock) that last used the slot (else empty)
    slot_freq  (C,) int32   LFU: the lookup count of the slot's row (else empty)
    counters   [clock, hits, misses, evictions, write_backs]

One int32 per row is the only per-row cost, whatever the policy: LFU's count of a row
that is not cached shares the row's entry with its slot, and a cached row's count moves
to its slot at admission and back at eviction (counts survive eviction). Counts saturate
at ``2**31 - 1`` (a row looked up more often ties with the others there; ties go by row
id, as always). Per slot: 13 bytes for LRU (row, last use, dirty), 9 for LFU (row,
count, dirty). ``metadata_bytes`` adds them up.

The checkpoint keeps the layout it had before this packing (``saved``): ``slot_rows``
and ``last_used`` as int64 per slot, LFU's ``freq`` as int64 per row.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tetrarec.cache.policy import Admission, CachePolicy, plan_admission

__all__ = ["COUNT_MAX", "SlotMap", "unique_rows"]

#: The largest LFU lookup count a row keeps (its count saturates there).
COUNT_MAX = 2**31 - 1


class SlotMap:
    """One table's slot maps and policy state (plain host tensors; see the module docstring).

    Args:
        capacity: ``C``, the table's slots.
        rows: ``E``, the table's rows.
        policy: the cache policy (LFU keeps a count per row, LRU a last use per slot).
    """

    def __init__(self, capacity: int, rows: int, policy: CachePolicy) -> None:
        self.capacity = capacity
        self.rows = rows
        self.policy = policy
        row_dtype = torch.int32 if rows <= 2**31 else torch.int64  # row ids 0 .. rows - 1
        self.slot_rows = torch.full((capacity,), -1, dtype=row_dtype)  # row per slot
        self.row_map = torch.zeros(rows, dtype=torch.int32)  # count, or ~slot if cached
        self.dirty = torch.zeros(capacity, dtype=torch.bool)  # updated since admission
        lru, lfu = policy is CachePolicy.LRU, policy is CachePolicy.LFU
        self.last_used = torch.zeros(capacity if lru else 0, dtype=torch.int64)  # LRU
        self.slot_freq = torch.zeros(capacity if lfu else 0, dtype=torch.int32)  # LFU
        self.counters = [0, 0, 0, 0, 0]  # clock, hits, misses, evictions, write_backs

    def metadata_bytes(self) -> int:
        """Bytes of the maps and policy state (``CacheMemory.metadata`` adds them up)."""
        tensors = (self.row_map, self.slot_rows, self.dirty, self.last_used, self.slot_freq)
        return sum(t.numel() * t.element_size() for t in tensors)

    def occupied(self) -> torch.Tensor:
        """``(n,)`` int64 slots that hold a row, ascending."""
        return torch.nonzero(self.slot_rows >= 0).flatten()

    def rows_in(self, slots: torch.Tensor) -> torch.Tensor:
        """``(n,)`` int64 rows held by ``slots`` (``-1`` for a free slot)."""
        return self.slot_rows.index_select(0, slots).long()

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """``(n,)`` int64 slot of each row (``-1``: not cached)."""
        # ~v is -v - 1: a cached row's slot; for v >= 0 (not cached) it is <= -1
        return torch.bitwise_not(self.row_map.index_select(0, rows)).clamp_min_(-1).long()

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
        miss = torch.nonzero(~hit).flatten()
        miss_rows = uniq.index_select(0, miss)
        miss_counts = counts.index_select(0, miss)
        miss_freq = miss_counts[:0]
        if self.policy is CachePolicy.LFU:
            miss_freq = self._count(miss_rows, miss_counts, slots.masked_select(hit), hit, counts)
        # slot -1 (a miss) marks the extra last entry, dropped: no mask of the hits needed
        busy = torch.zeros(self.capacity + 1, dtype=torch.bool)
        busy.index_fill_(0, slots, True)
        plan = plan_admission(
            self.policy,
            miss_rows=miss_rows,
            miss_counts=miss_counts,
            slot_rows=self.slot_rows,
            busy=busy[:-1],
            last_used=self.last_used,
            miss_freq=miss_freq,
            slot_freq=self.slot_freq,
        )
        return slots, plan

    def _count(
        self,
        miss_rows: torch.Tensor,
        miss_counts: torch.Tensor,
        hit_slots: torch.Tensor,
        hit: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """LFU: add the batch's lookups to every row's count; the misses' new counts."""
        before = self.slot_freq.index_select(0, hit_slots).long()
        now = (before + counts.masked_select(hit)).clamp_max_(COUNT_MAX)
        self.slot_freq.index_copy_(0, hit_slots, now.int())
        # a missed row is not cached: its entry of row_map is its count
        miss_freq = self.row_map.index_select(0, miss_rows).long() + miss_counts
        miss_freq.clamp_max_(COUNT_MAX)
        self.row_map.index_copy_(0, miss_rows, miss_freq.int())
        return miss_freq

    def dirty_among(self, slots: torch.Tensor) -> torch.Tensor:
        """The dirty ones of ``slots`` (int64), in their order."""
        return slots.masked_select(self.dirty.index_select(0, slots))

    def evicted(self, victims: torch.Tensor, written_back: int) -> None:
        """Free ``victims`` (their rows leave the cache) and count the eviction."""
        self.counters[3] += victims.numel()
        self.counters[4] += written_back
        rows = self.rows_in(victims)
        if self.policy is CachePolicy.LFU:  # the count goes back to the row's entry
            self.row_map.index_copy_(0, rows, self.slot_freq.index_select(0, victims))
        else:
            self.row_map.index_fill_(0, rows, 0)
        self.slot_rows.index_fill_(0, victims, -1)
        self.dirty.index_fill_(0, victims, False)

    def filled(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Record ``rows`` (int64, not cached) as admitted into ``slots`` (int64, free), clean."""
        if self.policy is CachePolicy.LFU:  # the row's count moves to its slot
            self.slot_freq.index_copy_(0, slots, self.row_map.index_select(0, rows))
        self.row_map.index_copy_(0, rows, torch.bitwise_not(slots.to(torch.int32)))
        self.slot_rows.index_copy_(0, slots, rows.to(self.slot_rows.dtype))
        self.dirty.index_fill_(0, slots, False)

    #: The state-dict entries of a slot map (``cache.<table>.<name>``), besides ``rows``.
    SAVED = ("slot_rows", "dirty", "last_used", "freq", "counters")

    def _saved_shapes(self) -> dict[str, tuple[int, ...]]:
        lfu = self.policy is CachePolicy.LFU
        c = self.capacity
        return {
            "slot_rows": (c,),
            "dirty": (c,),
            "last_used": (c,),
            "freq": (self.rows,) if lfu else (0,),
        }

    def saved(self) -> dict[str, torch.Tensor]:
        """``{name: copy}`` of the maps and counters, as a checkpoint holds them.

        The layout of a checkpoint, not of this map: ``slot_rows`` and ``last_used``
        int64 per slot (``last_used`` zeros but for LRU), ``freq`` LFU's int64 count per
        row (empty for the other policies).
        """
        freq = torch.zeros(0, dtype=torch.int64)
        if self.policy is CachePolicy.LFU:
            freq = self.row_map.long().clamp_min_(0)
            occupied = self.occupied()
            freq.index_copy_(0, self.rows_in(occupied), self.slot_freq[occupied].long())
        last_used = self.last_used.clone()
        if self.policy is not CachePolicy.LRU:
            last_used = torch.zeros(self.capacity, dtype=torch.int64)
        return {
            "slot_rows": self.slot_rows.long(),
            "dirty": self.dirty.clone(),
            "last_used": last_used,
            "freq": freq,
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
        values = {}
        for name, shape in self._saved_shapes().items():
            value = saved[name]
            if value is None or tuple(value.shape) != shape:
                got = None if value is None else tuple(value.shape)
                raise ValueError(
                    f"table {table!r}: the checkpoint's cache.{name} is {got}, "
                    f"this cache ({self.capacity} slots, policy {self.policy.value!r}) "
                    f"needs {shape}"
                )
            values[name] = value
        counters = saved["counters"]
        assert counters is not None
        self.counters = [int(x) for x in counters.tolist()]
        self.dirty.copy_(values["dirty"])
        if self.policy is CachePolicy.LRU:
            self.last_used.copy_(values["last_used"])
        if self.policy is CachePolicy.LFU:
            self.row_map.copy_(values["freq"].clamp(0, COUNT_MAX))
        rows = values["slot_rows"].long()
        occupied = torch.nonzero(rows >= 0).flatten()
        self.slot_rows.fill_(-1)
        self.filled(rows.index_select(0, occupied), occupied)
        self.dirty.copy_(values["dirty"])  # filled() marks its slots clean

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
