"""The parts of a ``CachedEmbeddingBagCollection``: which fused collection holds which rows.

::

    part "cache"  FP32 slots: table t has C_t rows, one per slot  (+ FP32 state per slot)
                  on the run device (device memory on a GPU, else process memory)
    part "ram"    host and cached tables, rows in their precision (+ FP32 state per row)
                  in host memory
    part "ssd"    ssd tables, the same, the flat storages in files (+ FP32 state per row)
    part "device" device tables (a GPU run only): uncached, rows in their precision in
                  device memory, as ``FusedEmbeddingBagCollection(device=)`` holds them

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
    "DEV",
    "HOME_KIND",
    "RAM",
    "SSD",
    "Part",
    "PartLayout",
    "build_parts",
    "resolve_capacities",
    "resolve_placements",
]

#: Part kinds: the FP32 slots, the backing rows in process memory, in files, and the
#: uncached rows of ``device`` tables in device memory.
CACHE, RAM, SSD, DEV = 0, 1, 2, 3
_PLACEMENTS = (Placement.HOST, Placement.CACHED, Placement.SSD)
#: The part holding each placement's (backing) rows.
HOME_KIND = {
    Placement.HOST: RAM,
    Placement.CACHED: RAM,
    Placement.SSD: SSD,
    Placement.DEVICE: DEV,
}


@dataclasses.dataclass
class Part:
    """One fused collection inside the cached one, and where its columns go.

    Args:
        kind: ``CACHE``, ``RAM``, ``SSD`` or ``DEV``.
        module: the fused collection (its rows on ``module``'s device).
        features: ``(F_p,)`` host int64: indices of its features in the full order.
        columns: ``(sum D_p,)`` int64 on the run device: its output columns.
        device: where its rows live, and its lookups and updates run.
    """

    kind: int
    module: FusedEmbeddingBagCollection
    features: torch.Tensor
    columns: torch.Tensor
    device: torch.device


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
    tables: Sequence[TableConfig], given: Mapping[str, Placement | str], device: torch.device
) -> tuple[Placement, ...]:
    """Each table's placement (``cached`` where not named).

    Args:
        tables: the tables.
        given: ``{table name: placement}``.
        device: the run device; ``device`` placements need one that is not the CPU.

    Raises:
        ValueError: for an unknown table, or ``device`` on the CPU.
    """
    names = {t.name for t in tables}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"placements name unknown tables {unknown}; tables: {sorted(names)}")
    out = []
    for t in tables:
        p = Placement.parse(given.get(t.name, Placement.CACHED))
        if p not in _PLACEMENTS and device.type == "cpu":
            valid = ", ".join(x.value for x in _PLACEMENTS)
            raise ValueError(
                f"table {t.name!r}: placement {p.value!r} keeps its rows in device memory, "
                f"but this cached collection runs on the CPU (device=None or 'cpu'; a CPU "
                f"table's rows are 'host'); valid here: {valid}"
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
    cached = [t for t, p in zip(tables, placements) if p in (Placement.CACHED, Placement.SSD)]
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
    device: torch.device,
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
        device: the run device: the cache part's rows and every part's output columns
            live there; the backing parts stay in host memory.

    Returns:
        The parts and each table's place in them.
    """
    groups: dict[int, list[int]] = {CACHE: [], RAM: [], SSD: [], DEV: []}
    for i, p in enumerate(placements):
        groups[HOME_KIND[p]].append(i)
        if capacities.get(i, 0) > 0:
            groups[CACHE].append(i)
    parts: list[Part] = []
    home: dict[int, tuple[int, int]] = {}
    slot_home: dict[int, int] = {}
    ssd_dir = None
    for kind in (CACHE, RAM, SSD, DEV):
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
        # the ssd part is built on meta, then its storages are mapped to files
        host = torch.device("cpu")
        where = {CACHE: device, RAM: host, SSD: torch.device("meta"), DEV: device}[kind]
        # the backing parts hold the (global) cells; the slots are filled by admission
        cells = None if kind == CACHE else [slices[i] for i in members]
        module = FusedEmbeddingBagCollection(chosen, optimizer, device=where, slices=cells, **fused)
        if kind == SSD:
            ssd_dir = map_to_files(module, optimizer, directory)
        parts.append(_part(tables, kind, module, members, host if kind == SSD else where, device))
    return PartLayout(parts=parts, home=home, slot_home=slot_home, ssd_dir=ssd_dir)


def _part(
    tables: Sequence[TableConfig],
    kind: int,
    module: FusedEmbeddingBagCollection,
    members: list[int],
    device: torch.device,
    out_device: torch.device,
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
        columns=torch.tensor(cols, dtype=torch.int64, device=out_device),
        device=device,
    )
