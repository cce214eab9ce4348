"""Pure functions over ``SparseFeatures`` and ``Batch``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tetrarec.sparse.batch import Batch
from tetrarec.sparse.features import SparseFeatures, offsets_from_lengths

__all__ = [
    "offsets_from_lengths",
    "permute_keys",
    "select_keys",
    "slice_batch",
    "split_batch",
]


def permute_keys(sf: SparseFeatures, keys: Sequence[str]) -> SparseFeatures:
    """Return the features reordered (or subset) to ``keys``.

    >>> sf = SparseFeatures.from_lists({"a": [[1], [2, 3]], "b": [[4], []]})
    >>> out = permute_keys(sf, ["b", "a"])
    >>> out.values.tolist(), out.lengths.tolist()
    ([4, 1, 2, 3], [1, 0, 1, 2])

    Raises:
        ValueError: if a key is not present.
    """
    if tuple(keys) == sf.keys:
        return sf  # already in order: nothing to copy
    missing = [k for k in keys if k not in sf.keys]
    if missing:
        raise ValueError(f"keys {missing} not in features {sf.keys}")
    counts = sf.value_counts_host()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    idx = [sf.keys.index(k) for k in keys]
    vals = [sf.values[starts[i] : starts[i + 1]] for i in idx]
    lens = sf.lengths_2d()[idx].reshape(-1)
    w = None
    if sf.weights is not None:
        w = torch.cat([sf.weights[starts[i] : starts[i + 1]] for i in idx])
    new_counts = tuple(counts[i] for i in idx)
    values = torch.cat(vals) if vals else sf.values[:0]
    return SparseFeatures(tuple(keys), values, lens, sf.batch_size, w, new_counts)


select_keys = permute_keys


def _slice_features(sf: SparseFeatures, start: int, stop: int) -> SparseFeatures:
    """Samples ``[start, stop)`` of every feature."""
    lens2d = sf.lengths_2d()
    offsets = offsets_from_lengths(sf.lengths).tolist()
    b = sf.batch_size
    pieces = []
    wpieces = []
    counts = []
    for f in range(sf.num_keys):
        lo, hi = offsets[f * b + start], offsets[f * b + stop]
        pieces.append(sf.values[lo:hi])
        if sf.weights is not None:
            wpieces.append(sf.weights[lo:hi])
        counts.append(hi - lo)
    w = torch.cat(wpieces) if sf.weights is not None else None
    return SparseFeatures(
        sf.keys,
        torch.cat(pieces),
        lens2d[:, start:stop].reshape(-1),
        stop - start,
        w,
        tuple(counts),
    )


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Samples ``[start, stop)`` of ``batch``.

    Raises:
        ValueError: if the range is empty or outside the batch.
    """
    if not 0 <= start < stop <= batch.batch_size:
        raise ValueError(f"bad slice [{start}, {stop}) of a batch of {batch.batch_size}")
    return Batch(
        batch.dense[start:stop],
        _slice_features(batch.sparse, start, stop),
        batch.labels[start:stop],
    )


def split_batch(batch: Batch, world_size: int) -> list[Batch]:
    """Split a global batch into ``world_size`` equal per-rank slices, rank order.

    Rank ``r`` gets samples ``[r*B/W, (r+1)*B/W)``.

    Raises:
        ValueError: if the batch size is not divisible by ``world_size``.
    """
    b = batch.batch_size
    if world_size < 1 or b % world_size:
        raise ValueError(f"global batch {b} does not split over {world_size} ranks")
    step = b // world_size
    return [slice_batch(batch, r * step, (r + 1) * step) for r in range(world_size)]
