"""The backward of a ``CachedEmbeddingBagCollection``: every part's update of a routed batch.

What its ``apply_gradients``, ``row_gradient_shares`` and ``add_to_row_state_`` run.
The gradient of the pooled output goes to every part (mean-pooled columns divided by
the bag length first, as the kernel's mean backward divides it), each part taking the
columns of its tables and its share of the per-id weights::

    grad (B, sum D) / divisor  ->  part "cache": its columns, ids = slots   (FP32 update)
                               ->  part "ram":   its columns, ids = rows    (stored precision)

A row is in exactly one part during a batch (its slot on a hit, else its backing row),
so it gets exactly one update; the rows a training batch admitted are checked not to
have moved since its forward and are marked dirty after the update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tetrarec.cache.parts import CACHE
from tetrarec.cache.route import CacheRoute

if TYPE_CHECKING:
    from tetrarec.cache.collection import CachedEmbeddingBagCollection

__all__ = ["add_to_row_state", "apply_part_gradients", "part_row_gradient_shares"]


def apply_part_gradients(
    ebc: CachedEmbeddingBagCollection,
    grad_out: torch.Tensor,
    route: CacheRoute,
    psw: torch.Tensor | None,
    want_psw: bool,
) -> torch.Tensor | None:
    """Every part's fused update (``CachedEmbeddingBagCollection.apply_gradients``).

    Raises:
        RuntimeError: if a later training forward moved rows this batch used in or out
            of the cache.
    """
    for i, rows, slots in route.touched:
        if not torch.equal(ebc._caches[i].slots_of(rows), slots.long()):
            raise RuntimeError(
                f"table {ebc.tables[i].name!r}: rows this batch used left or entered "
                "the cache before its backward; run each training forward's backward "
                "before the next training forward"
            )
    g = grad_out.contiguous()
    if route.divisor is not None:
        g = g / route.divisor  # the kernel's mean backward: gradient over the length
    psw_grad = torch.zeros_like(psw) if psw is not None and want_psw else None
    for p, part in enumerate(ebc._parts):
        if not route.values[p].numel():
            # nothing to update; the rounding stream still advances, as the
            # kernel's own call would advance it
            part.module.iteration += 1
            continue
        w = route.part_weights(psw, p, part.device)
        out = part.module.update_ids(
            g.index_select(1, part.columns).to(part.device), route.values[p],
            route.lengths[p], w, want_psw=psw_grad is not None,
        )  # fmt: skip
        if psw_grad is not None and out is not None:
            mask = route.masks[p].to(psw_grad.device, non_blocking=True)
            psw_grad[mask] = out.to(psw_grad.device)
    for i, _, slots in route.touched:
        ebc._caches[i].dirty[slots[slots >= 0].long()] = True
    return psw_grad


def part_row_gradient_shares(
    ebc: CachedEmbeddingBagCollection,
    table: int,
    grad_out: torch.Tensor,
    route: CacheRoute,
    psw: torch.Tensor | None,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's shares of table ``table``'s rows it holds, by row (slots mapped to rows).

    ``CachedEmbeddingBagCollection.row_gradient_shares``.
    """
    g = grad_out.contiguous()
    if route.divisor is not None:
        g = g / route.divisor  # as apply_part_gradients divides it
    rows, shares = [], []
    for p, part in enumerate(ebc._parts):
        if part.kind == CACHE:
            if table not in ebc._slot_home:
                continue
            k = ebc._slot_home[table]
        else:
            home, k = ebc._home[table]
            if home != p:
                continue
        w = route.part_weights(psw, p, part.device)
        got, share = part.module.row_gradient_shares_of_ids(
            k, g.index_select(1, part.columns).to(part.device), route.values[p],
            route.lengths[p], w, weight_decay,
        )  # fmt: skip
        got, share = got.cpu(), share.cpu()
        if part.kind == CACHE:
            got = ebc._caches[table].rows_in(got.long())  # slots -> their rows
        rows.append(got)
        shares.append(share)
    every = torch.cat(rows)
    order = torch.argsort(every)  # a row is in one part: unique
    out = grad_out.device
    return every[order].to(out), torch.cat(shares)[order].to(out)


@torch.no_grad()
def add_to_row_state(
    ebc: CachedEmbeddingBagCollection,
    table: int,
    key: str,
    rows: torch.Tensor,
    delta: torch.Tensor,
) -> None:
    """Add ``delta`` to the per-row state where each row's lives now (slot or backing).

    ``CachedEmbeddingBagCollection.add_to_row_state_``.

    Raises:
        ValueError: for a state that is not per row.
    """
    backing, k = ebc._backing(table)
    state = backing._table_state(k)
    if key not in state or state[key].shape[1] != 1:
        per_row = sorted(n for n, v in state.items() if v.shape[1] == 1)
        raise ValueError(f"{key!r} is not a per-row optimizer state; per-row: {per_row}")
    rows, delta = rows.cpu(), delta.cpu()  # the slot map is on the host
    c = ebc._caches.get(table)
    slots = c.slots_of(rows) if c is not None else torch.full_like(rows, -1)
    hit = slots >= 0
    if bool(hit.any()):
        cached = ebc._slots()._table_state(ebc._slot_home[table])[key]
        dev = cached.device
        cached[:, 0].index_add_(0, slots[hit].to(dev), delta[hit].to(dev))
    dev = state[key].device  # the host, but for a `device` table
    state[key][:, 0].index_add_(0, rows[~hit].to(dev), delta[~hit].to(dev))
