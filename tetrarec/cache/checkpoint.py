"""The state of a ``CachedEmbeddingBagCollection``: its state dict and optimizer state.

What its module hooks (``save_state``, ``load_state``) and its ``FusedState`` methods
(``optimizer_state``, ``check_optimizer_state``, ``load_optimizer_state``) call. The
state dict::

    weights.<table>           the complete table in its stored precision, after a flush
                              (exactly ``FusedEmbeddingBagCollection``'s layout)
    rounding                  (seed, iteration) of the stochastic-rounding stream
    cache.<table>.slot_rows   the slot map and policy state (``SlotMap.SAVED``)
    cache.<table>.dirty, .last_used, .freq, .counters
    cache.<table>.rows        (C, D) FP32 cached rows (on the slots' device)

A checkpoint without ``cache.*`` keys (of an uncached collection) loads with empty
caches (``static``: the pinned rows re-admitted from the loaded backing rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from tetrarec.cache.maintenance import copy_state_back, refresh_cached_state
from tetrarec.cache.policy import CachePolicy
from tetrarec.cache.slot_map import SlotMap
from tetrarec.kernels.tbe import load_table_rows

if TYPE_CHECKING:
    from tetrarec.cache.collection import CachedEmbeddingBagCollection

__all__ = [
    "check_optimizer_state",
    "load_optimizer_state",
    "load_state",
    "optimizer_state",
    "save_state",
]


def save_state(ebc: CachedEmbeddingBagCollection, destination: dict[str, Any], prefix: str) -> None:
    """Flush ``ebc``, then put its state-dict entries into ``destination``."""
    ebc.flush()
    for i, t in enumerate(ebc.tables):
        backing, k = ebc._backing(i)
        destination[f"{prefix}weights.{t.name}"] = backing._table_rows(k).detach()
    destination[f"{prefix}rounding"] = torch.tensor([ebc.seed, ebc.iteration])
    for i, c in ebc._caches.items():
        key = f"{prefix}cache.{ebc.tables[i].name}."
        destination.update({key + n: v for n, v in c.saved().items()})
        if c.capacity:
            rows = ebc._slots()._table_rows(ebc._slot_home[i])
            destination[key + "rows"] = rows.detach().clone()


def load_state(
    ebc: CachedEmbeddingBagCollection,
    state_dict: Mapping[str, Any],
    prefix: str,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load ``state_dict`` into ``ebc`` (``nn.Module._load_from_state_dict``'s protocol).

    Raises:
        ValueError: for a saved cache of another shape than ``ebc``'s.
    """
    rows = {}
    for i, t in enumerate(ebc.tables):
        backing, k = ebc._backing(i)
        rows[f"{prefix}weights.{t.name}"] = backing._table_rows(k)
    load_table_rows(state_dict, rows, missing_keys, error_msgs)
    expected = set(rows)
    expected.add(f"{prefix}rounding")
    rounding = state_dict.get(f"{prefix}rounding")
    if rounding is not None:
        ebc.seed, iteration = (int(x) for x in rounding.tolist())
        for part in ebc._parts:
            part.module.seed, part.module.iteration = ebc.seed, iteration
    for i in ebc._caches:
        key = f"{prefix}cache.{ebc.tables[i].name}."
        found = {n: state_dict.get(key + n) for n in (*SlotMap.SAVED, "rows")}
        expected.update(key + n for n in found)
        _load_cache(ebc, i, found)
    refresh_cached_state(ebc)
    for key in state_dict:
        if key.startswith(prefix) and key not in expected:
            unexpected_keys.append(key)


@torch.no_grad()
def _load_cache(
    ebc: CachedEmbeddingBagCollection, i: int, saved: Mapping[str, torch.Tensor | None]
) -> None:
    """Restore table ``i``'s cache, or rebuild it from the backing rows if not saved."""
    c = ebc._caches[i]
    pinned = c.slot_rows.clone()
    fresh = SlotMap(c.capacity, ebc.tables[i].num_embeddings, c.policy)
    ebc._caches[i] = fresh
    if saved["slot_rows"] is None:  # no cache in the checkpoint: start empty (static: re-pin)
        if c.policy is CachePolicy.STATIC and c.capacity:
            keep = pinned[pinned >= 0]
            ebc._fill(i, keep, torch.arange(keep.numel()))
        return
    fresh.restore(saved, ebc.tables[i].name)
    rows = saved["rows"]
    if c.capacity and rows is not None:
        ebc._slots()._table_rows(ebc._slot_home[i]).copy_(rows)


# -- the fused optimizer's state (FusedState) ---------------------------------------------


def optimizer_state(ebc: CachedEmbeddingBagCollection) -> dict[str, dict[str, torch.Tensor]]:
    """``ebc.optimizer_state()``: the backing stores' state, cached state copied back first."""
    for i, c in ebc._caches.items():
        slots = torch.nonzero(c.slot_rows >= 0).flatten()
        if slots.numel():
            copy_state_back(ebc, i, slots)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for module in ebc._backing_modules():
        out.update(module.optimizer_state())
    return {t.name: out[t.name] for t in ebc.tables}


def check_optimizer_state(
    ebc: CachedEmbeddingBagCollection, state: Mapping[str, Mapping[str, torch.Tensor]]
) -> None:
    """``ebc.check_optimizer_state(state)``: every backing store checks its tables' state.

    Raises:
        ValueError: for missing or unexpected tables or names, or another shape.
    """
    names = {t.name for t in ebc.tables}
    if set(state) != names:
        raise ValueError(
            f"optimizer state for tables {sorted(state)}, this module has {sorted(names)}"
        )
    for module in ebc._backing_modules():
        module.check_optimizer_state({t.name: state[t.name] for t in module.tables})


def load_optimizer_state(
    ebc: CachedEmbeddingBagCollection, state: Mapping[str, Mapping[str, torch.Tensor]]
) -> None:
    """``ebc.load_optimizer_state(state)``: checked, into the backing stores, then the slots.

    Raises:
        ValueError: as ``check_optimizer_state``, before anything is copied.
    """
    check_optimizer_state(ebc, state)
    for module in ebc._backing_modules():
        module.load_optimizer_state({t.name: state[t.name] for t in module.tables})
    refresh_cached_state(ebc)
