"""Rows moving in and out of the FP32 caches of a ``CachedEmbeddingBagCollection``.

The policy step of a training batch (step 1 of the collection's docstring) and what
checkpoints and loads need::

    admit       per cached table: unique ids, hits and misses counted, the policy's plan
                (``slot_map.py``); SSD pages prefetched; victims evicted; misses filled
    evict       victims leave their slots; the dirty ones are written back first
    write_back  FP32 slot rows -> stored precision (rounded as the kernel would round
                them at this iteration), state copied back
    fill        backing rows decoded into free slots, with their state
    flush       every dirty row written back, every clean row's state copied back
                (the cache itself unchanged: training goes on as without it)

The rows move through the collection's ``RowMover`` (``movement.py``: in place on the
CPU, through host staging buffers for a device cache). The collection's ``_admit``,
``_evict``, ``_write_back`` and ``_fill`` run these functions, and the nested steps
are called through them (``benchmarks/bench_cache.py`` times each on an instance).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from tetrarec.cache.files import prefetch_rows
from tetrarec.cache.movement import TableRows
from tetrarec.cache.policy import hot_rows
from tetrarec.cache.slot_map import unique_rows
from tetrarec.types import Placement, Precision

if TYPE_CHECKING:
    from tetrarec.cache.collection import CachedEmbeddingBagCollection

__all__ = [
    "admit",
    "copy_state_back",
    "evict",
    "fill",
    "flush",
    "pin_static",
    "refresh_cached_state",
    "write_back",
]


def _slot_rows(ebc: CachedEmbeddingBagCollection, i: int) -> TableRows:
    """Table ``i``'s FP32 slots and their state (part "cache")."""
    cache, k = ebc._slots(), ebc._slot_home[i]
    return TableRows(cache._table_rows(k), cache._table_state(k), Precision.FP32)


def _backing_rows(ebc: CachedEmbeddingBagCollection, i: int) -> TableRows:
    """Table ``i``'s backing rows and their state."""
    backing, k = ebc._backing(i)
    return TableRows(backing._table_rows(k), backing._table_state(k), ebc.tables[i].precision)


@torch.no_grad()
def fill(
    ebc: CachedEmbeddingBagCollection, i: int, rows: torch.Tensor, slots: torch.Tensor
) -> None:
    """Admit ``rows`` into ``slots`` (free): decode rows, copy their state."""
    rows, slots = rows.long().contiguous(), slots.long().contiguous()
    ebc._mover.load(_backing_rows(ebc, i), rows, _slot_rows(ebc, i), slots)
    ebc._caches[i].filled(rows, slots)


@torch.no_grad()
def write_back(ebc: CachedEmbeddingBagCollection, i: int, slots: torch.Tensor) -> None:
    """Store the FP32 rows of ``slots`` into the backing store; copy their state."""
    t, c = ebc.tables[i], ebc._caches[i]
    slots = slots.long().contiguous()
    rows = c.rows_in(slots)
    backing, k = ebc._backing(i)
    # The draws the kernel would make for these rows at this iteration (the kernel
    # itself never updates them at this iteration: they are idle).
    sl = backing.slices[k]
    stochastic = backing.stochastic_rounding and t.precision is not Precision.FP32
    flags = [int(stochastic), backing.seed, backing.iteration, sl.row_key(), sl.col_start]
    ebc._mover.store(_slot_rows(ebc, i), slots, _backing_rows(ebc, i), rows, flags)


def evict(ebc: CachedEmbeddingBagCollection, i: int, victims: torch.Tensor) -> None:
    """Empty the slots ``victims`` of table ``i``, writing the dirty ones back first."""
    c = ebc._caches[i]
    dirty = c.dirty_among(victims)
    if dirty.numel():
        ebc._write_back(i, dirty)
    c.evicted(victims, dirty.numel())


def admit(
    ebc: CachedEmbeddingBagCollection, i: int, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch's policy step for table ``i``; its unique rows and slots."""
    c = ebc._caches[i]
    fits = ebc.check_bounds and ebc.tables[i].num_embeddings <= 2**31
    uniq, counts = unique_rows(ids, fits_int32=fits)
    slots, plan = c.plan_batch(ids, uniq, counts)
    if ebc.placements[i] is Placement.SSD:
        # every backing row this step reads or writes: the misses (admitted ones are
        # read now, the others by the kernels) and the dirty victims' rows
        dirty = c.dirty_among(plan.victims)
        misses = uniq.masked_select(slots < 0)
        _prefetch(ebc, i, torch.cat([misses, c.rows_in(dirty)]))
    if plan.victims.numel():
        ebc._evict(i, plan.victims)
    if plan.rows.numel():
        ebc._fill(i, plan.rows, plan.slots)
        slots = c.slots_of(uniq)
    c.used(slots)
    return uniq, slots


def _prefetch(ebc: CachedEmbeddingBagCollection, i: int, rows: torch.Tensor) -> None:
    """Start reading ``rows``' pages of an SSD table (weights and state) at once."""
    backing, k = ebc._backing(i)
    pages = prefetch_rows(backing._table_rows(k), rows)
    for state in backing._table_state(k).values():
        pages += prefetch_rows(state, rows)
    ebc.prefetched_pages += pages


def flush(ebc: CachedEmbeddingBagCollection) -> None:
    """Write every dirty cached row back and copy every clean one's state back."""
    for i, c in ebc._caches.items():
        occupied = c.occupied()
        dirty = occupied[c.dirty[occupied]]
        if dirty.numel():
            ebc._write_back(i, dirty)  # also copies the state of these slots
        clean = occupied[~c.dirty[occupied]]
        if clean.numel():
            copy_state_back(ebc, i, clean)


@torch.no_grad()
def copy_state_back(ebc: CachedEmbeddingBagCollection, i: int, slots: torch.Tensor) -> None:
    """Copy the optimizer state of table ``i``'s ``slots`` to their rows' backing state."""
    rows = ebc._caches[i].rows_in(slots)
    ebc._mover.copy_state_back(_slot_rows(ebc, i), slots, _backing_rows(ebc, i), rows)


@torch.no_grad()
def refresh_cached_state(ebc: CachedEmbeddingBagCollection) -> None:
    """Copy the backing state of every cached row into its slot (after a load)."""
    for i, c in ebc._caches.items():
        slots = c.occupied()
        if not slots.numel():
            continue
        rows = c.rows_in(slots)
        ebc._mover.refresh_state(_backing_rows(ebc, i), rows, _slot_rows(ebc, i), slots)


def pin_static(
    ebc: CachedEmbeddingBagCollection, counts: Mapping[str, torch.Tensor] | None
) -> None:
    """Fill each cached table's slots with its most counted rows (the ``static`` policy).

    Raises:
        ValueError: for a cached table without counts.
    """
    for i, c in ebc._caches.items():
        name = ebc.tables[i].name
        if counts is None or name not in counts:
            raise ValueError(
                f"cache policy 'static' needs static_counts for table {name!r} "
                "(count_ids over a data sample)"
            )
        if c.capacity:
            rows = hot_rows(counts[name].long(), c.capacity)
            ebc._fill(i, rows, torch.arange(rows.numel()))
