"""Whole tables out of any checkpoint, without the process group that wrote it.

A one-process checkpoint holds each table whole; a sharded one holds each rank's blocks
(``rank_<r>.safetensors``) and, in ``meta.json``, where each block sits in its table
(``sharding.ranks[r].shards``: block name, table, rows, columns) and the plan (each
table's precision when it overrides the model's). ``CheckpointTables`` reads one table at
a time, streaming only that table's blocks from the files (``safe_open``), so a
checkpoint larger than RAM can be read table by table.

A table's value is what the training run's evaluation read: the stored rows decoded to
FP32 (``tetrarec.kernels.decode_rows``), and for a cached table the FP32 rows its cache
held at the checkpoint (``cache.<block>.rows`` at ``cache.<block>.slot_rows``), which
are newer than their low-precision copy in the backing rows.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tetrarec.config import RunConfig
from tetrarec.config.tables import model_tables
from tetrarec.embedding import TableConfig
from tetrarec.kernels import decode_rows, row_width
from tetrarec.sharding import ShardingPlan
from tetrarec.train.checkpoint import _damaged_meta, rank_file, read_meta
from tetrarec.train.checkpoint_manifest import verify_checkpoint

__all__ = ["CheckpointTables", "SavedBlock"]

_TENSORS = "tensors.safetensors"
# The key of a block's stored rows in a checkpoint, one-process or sharded:
#   embedding.weights.C1                                    fused or cached collection
#   embedding.embedding_bags.C1.weight                      reference collection
#   embedding.groups.0.local.weights.C1@r0                  a rank's block
#   model.first_order.rows[.groups.0.local].weights.C1_first_order
_WEIGHTS = re.compile(
    r"^(?P<prefix>(?:embedding|model\.first_order\.rows)\.(?:groups\.\d+\.local\.)?)"
    r"weights\.(?P<block>.+)$"
)
_REFERENCE = re.compile(r"^(?P<prefix>embedding\.)embedding_bags\.(?P<block>.+)\.weight$")


@dataclass(frozen=True, kw_only=True)
class SavedBlock:
    """One block of a table in a checkpoint file.

    Args:
        file: the safetensors file that holds it.
        key: its stored rows' tensor name.
        cache_prefix: ``<prefix>cache.<block>.``: where its cache's rows and slot map
            are, if it was cached.
        table: the table it belongs to.
        rows: ``(start, stop)`` rows of the table it holds.
        cols: ``(start, stop)`` columns.
    """

    file: Path
    key: str
    cache_prefix: str
    table: str
    rows: tuple[int, int]
    cols: tuple[int, int]


class CheckpointTables:
    """The tables of a checkpoint, read whole, one at a time.

    Args:
        path: a checkpoint directory (``<checkpoint_dir>/step_<n>``, or ``best``).

    Raises:
        FileNotFoundError: if ``path`` is not a checkpoint, or a rank's file is missing.
        ValueError: for damaged metadata or files, or files that differ from the
            checkpoint's manifest (``verify_checkpoint``), naming them.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if (self.path / "meta.json").is_file():  # else read_meta names what is missing
            verify_checkpoint(self.path)  # every file it may read, before any is read
        self.meta = read_meta(self.path, require={"config": dict})
        with _damaged_meta(self.path):  # the config, a sharded run's plan and layout
            self.config = RunConfig.from_dict(self.meta["config"])
            sharding = self.meta.get("sharding")
            plan = ShardingPlan.from_dict(sharding["plan"]) if sharding else None
            tables = []
            for t in model_tables(self.config.model):
                placed = plan.table(t.name).placement if plan is not None else None
                if placed is not None:
                    t = dataclasses.replace(t, precision=placed.precision)
                tables.append(t)
            #: Every table of the model (embedding tables, then a first-order term's),
            #: with the precision its rows were stored in.
            self.tables: tuple[TableConfig, ...] = tuple(tables)
            self.world_size = int(sharding["world_size"]) if sharding else 1
            self._blocks = self._find_blocks(sharding)

    def _file_keys(self, file: Path) -> list[str]:
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing from the checkpoint")
        try:
            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        except SafetensorError as e:
            raise ValueError(f"{file}: damaged checkpoint tensors ({e})") from e

    def _find_blocks(self, sharding: dict[str, Any] | None) -> dict[str, list[SavedBlock]]:
        if sharding:
            files = [(self.path / rank_file(r), r) for r in range(self.world_size)]
            layouts = [sharding["ranks"][r]["shards"] for r in range(self.world_size)]
        else:
            files = [(self.path / _TENSORS, 0)]
            layouts = [
                [
                    {"name": t.name, "table": t.name, "rows": [0, t.num_embeddings],
                     "cols": [0, t.dim]}
                    for t in self.tables
                ]
            ]  # fmt: skip
        blocks: dict[str, list[SavedBlock]] = {t.name: [] for t in self.tables}
        for (file, _), layout in zip(files, layouts, strict=True):
            keys = {}
            for key in self._file_keys(file):
                m = _WEIGHTS.match(key) or _REFERENCE.match(key)
                if m:
                    keys[m.group("block")] = (key, f"{m.group('prefix')}cache.{m.group('block')}.")
            for entry in layout:
                name = str(entry["name"])
                if name not in keys:
                    raise ValueError(f"{file}: no rows for block {name!r} of its layout")
                if entry["table"] not in blocks:
                    raise ValueError(f"{file}: block {name!r} of an unknown table")
                key, cache = keys[name]
                blocks[str(entry["table"])].append(
                    SavedBlock(
                        file=file,
                        key=key,
                        cache_prefix=cache,
                        table=str(entry["table"]),
                        rows=(int(entry["rows"][0]), int(entry["rows"][1])),
                        cols=(int(entry["cols"][0]), int(entry["cols"][1])),
                    )
                )
        return blocks

    def blocks(self, table: str) -> list[SavedBlock]:
        """Where table ``table``'s rows are, block by block."""
        return list(self._blocks[table])

    def read_table(self, table: str) -> torch.Tensor:
        """Table ``table``'s ``(rows, dim)`` FP32 rows as the run's evaluation read them.

        Raises:
            ValueError: for a block of another shape than its layout says, or cells of
                the table that no block covers.
        """
        t = next(x for x in self.tables if x.name == table)
        with ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for b in self._blocks[table]:
                if b.file not in handles:
                    handles[b.file] = stack.enter_context(safe_open(str(b.file), framework="pt"))
            # Every block's shape, and enough cells, before the table is allocated: a
            # damaged meta.json may give the table a size no block holds (2**62 rows).
            cells = 0
            for b in self._blocks[table]:
                shape = tuple(handles[b.file].get_slice(b.key).get_shape())
                n, d = b.rows[1] - b.rows[0], b.cols[1] - b.cols[0]
                want = (n, row_width(t.precision, d))
                if shape != want:
                    raise ValueError(
                        f"{b.file}: {b.key} is {shape}, its layout says {want} "
                        f"({t.precision.value} rows of dim {d})"
                    )
                cells += n * d
            if cells < t.num_embeddings * t.dim:
                raise ValueError(f"{self.path}: table {table!r} has cells no saved block covers")
            out = torch.full((t.num_embeddings, t.dim), float("nan"))
            covered = torch.zeros(t.num_embeddings, t.dim, dtype=torch.bool)
            for b in self._blocks[table]:
                f = handles[b.file]
                stored = f.get_tensor(b.key)
                d = b.cols[1] - b.cols[0]
                rows = decode_rows(stored, t.precision, d).float()
                names = set(f.keys())
                if b.cache_prefix + "rows" in names:
                    slots = f.get_tensor(b.cache_prefix + "slot_rows")
                    cached = f.get_tensor(b.cache_prefix + "rows")
                    held = slots >= 0
                    rows[slots[held]] = cached[held].float()
                out[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]] = rows
                covered[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]] = True
        if not bool(covered.all()):
            raise ValueError(f"{self.path}: table {table!r} has cells no saved block covers")
        return out

    def __iter__(self) -> Iterator[tuple[TableConfig, torch.Tensor]]:
        """Every table with its rows, one at a time."""
        for t in self.tables:
            yield t, self.read_table(t.name)

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's tensors outside its tables (``model.<name>``, from rank 0's file).

        In a sharded checkpoint rank 0 writes the dense parameters to
        ``tensors.safetensors``, as a one-process checkpoint does.
        """
        file = self.path / _TENSORS
        try:
            with safe_open(str(file), framework="pt") as f:
                return {
                    k.removeprefix("model."): f.get_tensor(k)
                    for k in f.keys()  # noqa: SIM118
                    if k.startswith("model.")
                    and not k.startswith("model.first_order.rows.")
                    and not k.startswith("model.first_order.optim.")
                }
        except SafetensorError as e:
            raise ValueError(f"{file}: damaged checkpoint tensors ({e})") from e
