"""The parts of a ``CachedEmbeddingBagCollection``: which fused collection holds which rows.

::

    part "cache"  FP32 slots: table t has C_t rows, one per slot  (+ FP32 state per slot)
    part "ram"    host and cached tables, rows in their precision (+ FP32 state per row)
    part "ssd"    ssd tables, the same, the flat storages in files (+ FP32 state per row)

Every part pools as sum (a mean bag is divided by its whole length after the parts' sums
are added). The backing parts hold the (global) cells of their tables: same names, rows
and bounds, so the same initial rows and rounding keys as the uncached collection.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tetrarec.cache.config import CacheSpec
from tetrarec.cache.files import map_to_files
from tetrarec.embedding import SparseOptimizerSpec, TableConfig, TableSlice
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.types import Placement, PoolingMode, Precision

__all__ = [
    "CACHE",
    "RAM",
    "SSD",
    "Part",
    "PartLayout",
    "build_parts",
    "resolve_capacities",
    "resolve_placements",
]

#: Part kinds: the FP32 slots, the backing rows in process memory, in files.
CACHE, RAM, SSD = 0, 1, 2
_PLACEMENTS = (Placement.HOST, Placement.CACHED, Placement.SSD)


@dataclasses.dataclass
class Part:
    """One fused collection inside the cached one, and where its columns go.

    Args:
        kind: ``CACHE``, ``RAM`` or ``SSD``.
        module: the fused collection (its rows on ``module``'s device).
        features: ``(F_p,)`` host int64: indices of its features in the full order.
        columns: ``(sum D_p,)`` int64: its output columns.
    """

    kind: int
    module: FusedEmbeddingBagCollection
    features: torch.Tensor
    columns: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartLayout:
    """The parts and where each table sits in them.

    Args:
        parts: the parts, in kind order (the cache part first when there is one).
        home: ``{table: (backing part index, local index)}`` for every table.
        slot_home: ``{table: local index in the cache part}`` for tables with slots.
        ssd_dir: the directory of the ``ssd`` part's files, if any.
    """

    parts: list[Part]
    home: dict[int, tuple[int, int]]
    slot_home: dict[int, int]
    ssd_dir: Path | None


def resolve_placements(
    tables: Sequence[TableConfig], given: Mapping[str, Placement | str]
) -> tuple[Placement, ...]:
    """Each table's placement (``cached`` where not named).

    Raises:
        ValueError: for an unknown table or a placement other than host, cached, ssd.
    """
    names = {t.name for t in tables}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"placements name unknown tables {unknown}; tables: {sorted(names)}")
    out = []
    for t in tables:
        p = Placement.parse(given.get(t.name, Placement.CACHED))
        if p not in _PLACEMENTS:
            valid = ", ".join(x.value for x in _PLACEMENTS)
            raise ValueError(
                f"table {t.name!r}: placement {p.value!r} is not available on CPU "
                f"(the device cache needs a GPU); valid: {valid}"
            )
        out.append(p)
    return tuple(out)


def resolve_capacities(
    tables: Sequence[TableConfig],
    placements: Sequence[Placement],
    cache: CacheSpec,
    optimizer: SparseOptimizerSpec,
    fractions: Mapping[str, float],
) -> dict[str, int]:
    """``{table: slots}`` of every cached (or ssd) table: ``cache``'s size or its fraction.

    Raises:
        ValueError: for a fraction outside ``[0, 1]``.
    """
    cached = [t for t, p in zip(tables, placements) if p is not Placement.HOST]
    capacity = cache.capacities(cached, optimizer.kind)
    for t in cached:
        f = fractions.get(t.name)
        if f is not None:
            if not 0.0 <= f <= 1.0:
                raise ValueError(f"table {t.name!r}: cache fraction {f} is not in [0, 1]")
            capacity[t.name] = min(t.num_embeddings, math.floor(f * t.num_embeddings))
    return capacity


def build_parts(
    tables: Sequence[TableConfig],
    slices: Sequence[TableSlice],
    placements: Sequence[Placement],
    capacities: Mapping[int, int],
    optimizer: SparseOptimizerSpec,
    directory: str | None,
    fused: Mapping[str, Any],
) -> PartLayout:
    """Build the fused parts (rows initialized; slots filled later by admission).

    Args:
        tables: every table, in collection order.
        slices: where each sits in its global table.
        placements: each table's placement.
        capacities: ``{table index: slots}`` of every cached table.
        optimizer: the fused rule.
        directory: where the ``ssd`` part's files go (``CacheSpec.directory``).
        fused: the fused collections' keyword settings (bounds, rounding, seed).

    Returns:
        The parts and each table's place in them.
    """
    groups: dict[int, list[int]] = {CACHE: [], RAM: [], SSD: []}
    for i, p in enumerate(placements):
        groups[SSD if p is Placement.SSD else RAM].append(i)
        if capacities.get(i, 0) > 0:
            groups[CACHE].append(i)
    parts: list[Part] = []
    home: dict[int, tuple[int, int]] = {}
    slot_home: dict[int, int] = {}
    ssd_dir = None
    for kind in (CACHE, RAM, SSD):
        members = groups[kind]
        if not members:
            continue
        if kind == CACHE:
            chosen = [
                dataclasses.replace(
                    tables[i],
                    num_embeddings=capacities[i],
                    pooling=PoolingMode.SUM,
                    precision=Precision.FP32,
                )
                for i in members
            ]
            slot_home.update({i: k for k, i in enumerate(members)})
        else:
            chosen = [dataclasses.replace(tables[i], pooling=PoolingMode.SUM) for i in members]
            home.update({i: (len(parts), k) for k, i in enumerate(members)})
        device = "meta" if kind == SSD else None
        # the backing parts hold the (global) cells; the slots are filled by admission
        cells = None if kind == CACHE else [slices[i] for i in members]
        module = FusedEmbeddingBagCollection(
            chosen, optimizer, device=device, slices=cells, **fused
        )
        if kind == SSD:
            ssd_dir = map_to_files(module, optimizer, directory)
        parts.append(_part(tables, kind, module, members))
    return PartLayout(parts=parts, home=home, slot_home=slot_home, ssd_dir=ssd_dir)


def _part(
    tables: Sequence[TableConfig],
    kind: int,
    module: FusedEmbeddingBagCollection,
    members: list[int],
) -> Part:
    feats: list[int] = []
    cols: list[int] = []
    f = col = 0
    for i, t in enumerate(tables):
        for _ in t.feature_names:
            if i in members:
                feats.append(f)
                cols.extend(range(col, col + t.dim))
            f, col = f + 1, col + t.dim
    return Part(
        kind=kind,
        module=module,
        features=torch.tensor(feats, dtype=torch.int64),
        columns=torch.tensor(cols, dtype=torch.int64),
    )
