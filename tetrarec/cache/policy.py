"""Cache policies as pure functions: which missed rows enter the cache, and which leave.

A cache of ``C`` slots holds rows of one table. Each training batch, the table's unique
ids split into hits (rows already cached) and misses. The policy then picks the misses
to admit and, when no slot is free, the victims they replace. Victims are never rows
the batch uses (its backward will update them where the forward read them). Ties are
broken by row id, so the cache contents are a function of the id stream alone (not of
slot numbers), which is what lets a plain dictionary oracle check them::

    LRU     misses in order (count in this batch desc, row asc), all admitted while
            slots last; free slots (ascending) first, then victims in order
            (last batch that used them asc, row asc).
    LFU     every lookup counts (a per-row counter of the whole table, kept across
            evictions); misses in order (count desc, row asc) fill free slots, then
            miss j replaces victim j (order: count asc, row asc) only while its count is
            strictly larger.
    STATIC  the rows most frequent in a data sample (``hot_rows``) are loaded once and
            never leave; nothing is admitted.

Example (LRU, 2 slots, one id per batch): batches {1}, {2}, {1}, {3} leave rows {1, 3}
cached: batch 4 evicts row 2, used last at batch 2, before row 1 (batch 3).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tetrarec.embedding import TableConfig
from tetrarec.sparse import SparseFeatures
from tetrarec.types import NamedEnum

__all__ = ["Admission", "CachePolicy", "count_ids", "hot_rows", "plan_admission"]


class CachePolicy(NamedEnum):
    """Which rows a mixed-precision cache keeps (see the module docstring)."""

    __noun__ = "cache policy"

    LRU = "lru"
    LFU = "lfu"
    STATIC = "static"


@dataclass(frozen=True, kw_only=True)
class Admission:
    """One batch's changes to one table's cache.

    Args:
        rows: ``(A,)`` rows to admit, in admission order.
        slots: ``(A,)`` the slot each goes to.
        victims: ``(V,)`` occupied slots whose rows leave first (``V <= A``; they are
            the last ``V`` entries of ``slots``).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    victims: torch.Tensor


def _empty() -> Admission:
    none = torch.empty(0, dtype=torch.int64)
    return Admission(rows=none, slots=none, victims=none)


def plan_admission(
    policy: CachePolicy,
    *,
    miss_rows: torch.Tensor,
    miss_counts: torch.Tensor,
    slot_rows: torch.Tensor,
    busy: torch.Tensor,
    last_used: torch.Tensor,
    miss_freq: torch.Tensor,
    slot_freq: torch.Tensor,
) -> Admission:
    """Choose the misses to admit and the slots they take (pure; nothing is changed).

    Args:
        policy: the rule (see the module docstring).
        miss_rows: ``(M,)`` missed rows of this batch, ascending.
        miss_counts: ``(M,)`` how often each occurs in this batch.
        slot_rows: ``(C,)`` row held by each slot, ``-1`` if free (int32 or int64).
        busy: ``(C,)`` bool, slots this batch uses (hits): never victims.
        last_used: ``(C,)`` the last batch number that used each slot (LRU; may be
            empty for other policies).
        miss_freq: ``(M,)`` lookups of each missed row so far, this batch included
            (LFU; may be empty for other policies).
        slot_freq: ``(C,)`` lookups so far of the row each slot holds, this batch
            included (LFU; may be empty for other policies).

    Returns:
        The ``Admission``; empty for ``STATIC`` or when nothing misses.
    """
    if policy is CachePolicy.STATIC or miss_rows.numel() == 0 or slot_rows.numel() == 0:
        return _empty()
    # index_select throughout: advanced indexing (t[i]) costs several times more on CPU
    hotness = miss_counts if policy is CachePolicy.LRU else miss_freq
    order = torch.sort(-hotness, stable=True).indices  # rows asc break ties
    misses = miss_rows.index_select(0, order)
    hotness = hotness.index_select(0, order)
    occupied = slot_rows >= 0
    free = torch.nonzero(~occupied).flatten()
    n_free = min(free.numel(), misses.numel())
    rest = misses[n_free:]
    idle = torch.nonzero(occupied & ~busy).flatten() if rest.numel() else free[:0]
    k = min(rest.numel(), idle.numel())
    victims = idle[:0]
    if k:
        rows = slot_rows.index_select(0, idle).long()
        lru = policy is CachePolicy.LRU
        key = (last_used if lru else slot_freq).index_select(0, idle).long()
        victims = idle.index_select(0, _first_by_key_then_row(key, rows, k))
        if policy is CachePolicy.LFU:
            # misses by count desc, victims by count asc: the condition holds on a prefix
            hot = hotness[n_free : n_free + k]
            cold = slot_freq.index_select(0, victims)
            victims = victims[: int((hot > cold).sum())]
    k = victims.numel()
    return Admission(
        rows=torch.cat([misses[:n_free], rest[:k]]),
        slots=torch.cat([free[:n_free], victims]),
        victims=victims,
    )


def _first_by_key_then_row(key: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` smallest ``(key, row)`` pairs, in that order.

    ``rows`` are distinct and non-negative, so ``key * span + row`` (``span`` = largest
    row + 1) orders the pairs exactly as a stable sort by row and then by key does, in
    one pass: a partial ``topk`` when few are needed, a sort otherwise. Keys too large for
    that product in int64 (or negative) take the two stable sorts.

    Args:
        key: ``(n,)`` int64, the first sort key (last use or lookup count).
        rows: ``(n,)`` int64 distinct rows, the tie-break.
        k: how many, ``1 <= k <= n``.

    Returns:
        ``(k,)`` int64 positions into ``key`` and ``rows``.
    """
    span = int(rows.max()) + 1
    lo, hi = (int(x) for x in torch.aminmax(key))
    if lo < 0 or hi > (2**63 - 1 - span) // span:
        by_row = torch.argsort(rows, stable=True)
        return by_row[torch.sort(key.index_select(0, by_row), stable=True).indices[:k]]
    fused = key * span + rows  # distinct: any sort gives the same order
    if 4 * k < fused.numel():
        return torch.topk(fused, k, largest=False, sorted=True).indices
    return torch.sort(fused).indices[:k]


def count_ids(
    batches: Iterable[SparseFeatures], tables: Sequence[TableConfig]
) -> dict[str, torch.Tensor]:
    """Count every table's ids over ``batches`` (a data sample, for ``STATIC``).

    Args:
        batches: sparse batches; each feature's ids count toward its table.
        tables: the tables (their ``feature_names`` say which features they serve).

    Returns:
        ``{table name: (rows,) int64 counts}``.

    Raises:
        ValueError: for an id outside its table.
    """
    counts = {t.name: torch.zeros(t.num_embeddings, dtype=torch.int64) for t in tables}
    owner = {f: t for t in tables for f in t.feature_names}
    for batch in batches:
        for key, (values, _) in batch.to_dict().items():
            table = owner.get(key)
            if table is None or values.numel() == 0:
                continue
            ids = values.long().cpu()
            lo, hi = (int(x) for x in torch.aminmax(ids))
            if lo < 0 or hi >= table.num_embeddings:
                raise ValueError(
                    f"feature {key!r}: id {lo if lo < 0 else hi} is outside table "
                    f"{table.name!r} of {table.num_embeddings} rows"
                )
            counts[table.name] += torch.bincount(ids, minlength=table.num_embeddings)
    return counts


def hot_rows(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most frequent rows (count desc, row asc), ascending by row.

    Args:
        counts: ``(rows,)`` lookups per row (``count_ids``).
        k: how many rows (clipped to the table's rows).
    """
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[: min(k, counts.numel())]).values
