"""How a batch splits over the parts of a ``CachedEmbeddingBagCollection``.

Each id goes to exactly one part (its slot in part "cache" on a hit, else its row in its
table's backing part); every part gets every bag, holding its share of the bag's ids::

    batch (one feature, B = 2):  bags [1, 7], [2]      row 1 in slot 0, row 2 in slot 1
    dest per id:                 cache, ram, cache
    part "cache": values [0, 1]  lengths [1, 1]        (slots)
    part "ram":   values [7]     lengths [1, 0]        (rows)

``route_batch`` finds each id's part and local index (on the host, after the policy
step of a training batch), ``split_over_parts`` builds those per-part values and
lengths; ``CacheRoute`` carries them, with the mean-pooling divisor and the admitted
rows, from the forward to the backward (in ``PreparedIds.route``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tetrarec.cache.parts import CACHE, HOME_KIND, RAM, Part
from tetrarec.embedding import TableConfig
from tetrarec.sparse import SparseFeatures

if TYPE_CHECKING:
    from tetrarec.cache.collection import CachedEmbeddingBagCollection

__all__ = ["CacheRoute", "bag_divisor", "check_table_ids", "route_batch", "split_over_parts"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheRoute:
    """One batch split over the parts of a ``CachedEmbeddingBagCollection`` (``prepare``).

    Built once per batch and handed to ``pooled_lookup`` (forward) and
    ``apply_gradients`` (backward). Its tensors index the batch it was built from: ``N``
    ids over ``B`` samples, key-major in the collection's feature order.

    Args:
        batch: ``B``, the samples of the batch.
        values: per part, the ids it takes, local to it (slots or rows), on the part's
            device.
        lengths: per part, ``(F_p * B,)`` its share of each bag, on the part's device.
        masks: per part, ``(N,)`` bool on the host: which ids of the batch it takes.
        divisor: ``(B, sum D)`` bag lengths on mean-pooled columns (1 elsewhere), on the
            output's device, or ``None`` without mean pooling.
        touched: per cached table that admitted this batch (``admit=True``):
            ``(table index, its unique rows, their slots)`` on the host;
            ``apply_gradients`` checks that they have not moved and marks the slots dirty.
    """

    batch: int
    values: list[torch.Tensor]
    lengths: list[torch.Tensor]
    masks: list[torch.Tensor]
    divisor: torch.Tensor | None
    touched: list[tuple[int, torch.Tensor, torch.Tensor]]

    def part_weights(
        self, psw: torch.Tensor | None, p: int, device: torch.device
    ) -> torch.Tensor | None:
        """Part ``p``'s share of the per-id weights ``psw`` on ``device`` (``None``: none)."""
        if psw is None:
            return None
        return psw.to(device)[self.masks[p].to(device, non_blocking=True)]


def split_over_parts(
    parts: Sequence[Part],
    local: torch.Tensor,
    dest: torch.Tensor,
    lengths: torch.Tensor,
    nf: int,
    batch: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per part: its ids, its share of every bag, and the mask of its ids (host tensors).

    Args:
        parts: the collection's parts.
        local: ``(N,)`` int64: each id's slot or row in the part it goes to.
        dest: ``(N,)`` int8: each id's part kind.
        lengths: ``(F * B,)`` int64 bag lengths, key-major.
        nf: ``F``, the features.
        batch: ``B``.

    Returns:
        ``(values, lengths, masks)``, one entry per part.
    """
    ends = torch.cumsum(lengths, 0)  # (F*B,) one past each bag's last id
    values, part_lengths, masks = [], [], []
    for part in parts:
        mask = dest == part.kind
        # ids of this part per bag: differences of the mask's running count
        taken = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(mask, 0)])
        counts = torch.diff(taken[ends], prepend=taken[:1]).view(nf, batch)
        values.append(local[mask])
        part_lengths.append(counts[part.features].reshape(-1))
        masks.append(mask)
    return values, part_lengths, masks


def bag_divisor(
    tables: Sequence[TableConfig], means: Sequence[bool], lengths: torch.Tensor, batch: int
) -> torch.Tensor | None:
    """``(B, sum D)``: each bag's length on mean-pooled columns, 1 elsewhere (host).

    ``None`` when no table is mean-pooled.
    """
    if not any(means):
        return None
    mean = [m for t, m in zip(tables, means) for _ in t.feature_names]
    per_bag = lengths.view(len(mean), batch).t().float().clamp(min=1)  # (B, F)
    per_bag[:, [f for f, m in enumerate(mean) if not m]] = 1.0
    dims = torch.tensor([t.dim for t in tables for _ in t.feature_names])
    return torch.repeat_interleave(per_bag, dims, dim=1)


def check_table_ids(
    t: TableConfig,
    ids: torch.Tensor,
    features: range,
    starts: list[int],
    feature_names: Sequence[str],
) -> None:
    """Raise for an id of table ``t`` outside it, naming the feature (one check per table).

    Args:
        t: the table.
        ids: the batch's ids of the table's features, back to back.
        features: the table's features' indices in ``feature_names``.
        starts: ``(F + 1,)`` where each feature's ids start in the batch.
        feature_names: every feature, in order.

    Raises:
        ValueError: naming the feature, the id and the table's size.
    """
    if not ids.numel():
        return
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if lo >= 0 and hi < t.num_embeddings:
        return
    bad = lo if lo < 0 else hi
    first = starts[features[0]]  # ids holds the table's features back to back
    f = next(g for g in features if (ids[starts[g] - first : starts[g + 1] - first] == bad).any())
    raise ValueError(
        f"feature {feature_names[f]!r}: id {bad} is outside its table {t.name!r} "
        f"of {t.num_embeddings} rows (valid ids are 0..{t.num_embeddings - 1})"
    )


def route_batch(
    ebc: CachedEmbeddingBagCollection, features: SparseFeatures, *, admit: bool
) -> CacheRoute:
    """Route ``features`` over ``ebc``'s parts; with ``admit``, the policy step first.

    What ``CachedEmbeddingBagCollection.prepare`` runs once it has checked the keys
    (``ebc._admit`` per cached table with ``admit``).

    Raises:
        ValueError: for an out-of-range id (when ``ebc.check_bounds``).
    """
    # The policy and the routing run on the host: the batch's ids and lengths come
    # over once (no copy on the CPU), the parts' ids go back once per device part.
    batch, lengths = features.batch_size, features.lengths.cpu().long()
    local = features.values.cpu().long().clone()  # (N,) becomes slot or row per id
    dest = torch.full_like(local, RAM, dtype=torch.int8)
    starts = [0]
    for n in features.value_counts_host():
        starts.append(starts[-1] + n)
    touched = []
    f = 0
    for i, t in enumerate(ebc.tables):
        f0, f = f, f + len(t.feature_names)
        seg = slice(starts[f0], starts[f])
        home = HOME_KIND[ebc.placements[i]]
        dest[seg] = home
        if i not in ebc._caches:
            continue
        ids = local[seg]
        if ebc.check_bounds:
            check_table_ids(t, ids, range(f0, f), starts, ebc.feature_names)
        if admit:
            rows, slots = ebc._admit(i, ids)
            touched.append((i, rows, slots.to(torch.int32)))
        slot = ebc._caches[i].slots_of(ids)
        hit = slot >= 0
        dest[seg] = torch.where(hit, CACHE, home).to(torch.int8)
        local[seg] = torch.where(hit, slot, ids)
    nf = len(ebc.feature_names)
    values, part_lengths, masks = split_over_parts(ebc._parts, local, dest, lengths, nf, batch)
    divisor = bag_divisor(ebc.tables, ebc._means, lengths, batch)
    return CacheRoute(
        batch=batch,
        values=[v.to(part.device) for v, part in zip(values, ebc._parts)],
        lengths=[n.to(part.device) for n, part in zip(part_lengths, ebc._parts)],
        masks=masks,
        divisor=divisor.to(ebc.device) if divisor is not None else None,
        touched=touched,
    )
