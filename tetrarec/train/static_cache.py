"""The ``static`` cache policy in a run: count a data sample, then say what was pinned.

``[model.cache] policy = "static"`` pins each cached table's most frequent rows and
never admits another. The trainer takes the sample from the run's own training data,
before it builds the model::

    1. count: the ids of each cached table over the first ``static_sample_batches``
       global training batches (the batches the run trains on first, in its order);
       on several ranks each counts its slice of those batches and the counts are
       summed (one all-reduce), so every rank holds the one-process counts
    2. build: the cached collection pins ``hot_rows(counts, slots)`` of each table
       (count desc, row asc); sharded, each cached shard pins the hottest of its own
       rows (``LookupOptions.static_counts``)
    3. log, per cached table (per shard on each rank): the rows pinned and the share
       of the sample's lookups of that table they cover

A resumed run counts the same batches again (the same counts), then loads the pinned
rows its checkpoint holds.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tetrarec.cache import CachePolicy, count_ids
from tetrarec.config import RunConfig
from tetrarec.config.tables import build_tables
from tetrarec.data import BatchLoader, Dataset
from tetrarec.sharding import ShardingEnv
from tetrarec.train.build import held_tables
from tetrarec.types import Placement

__all__ = ["PinnedRows", "log_pinned", "pinned_rows", "sample_counts"]

logger = logging.getLogger(__name__)


def sample_counts(
    config: RunConfig, dataset: Dataset, env: ShardingEnv | None = None
) -> dict[str, torch.Tensor] | None:
    """Ids per row of every cached table over the run's first training batches.

    Args:
        config: the run (``[model.cache]``, ``data.batch_size``, ``data.shuffle``,
            ``train.seed``).
        dataset: its training data.
        env: the ranks of a sharded run (each counts its slice; the counts are summed);
            ``None`` in one process.

    Returns:
        ``{table name: (rows,) int64 counts}`` of the cached tables, or ``None`` unless
        a table is cached under the ``static`` policy.

    Raises:
        ValueError: for an id outside its table.
    """
    model = config.model
    if not model.cached or model.cache.policy is not CachePolicy.STATIC:
        return None
    tables = [
        t for t, p in zip(build_tables(model), model.table_placements) if p is not Placement.HOST
    ]
    rank, world = (env.rank, env.world_size) if env is not None else (0, 1)
    loader = BatchLoader(
        dataset,
        batch_size=config.data.batch_size,
        rank=rank,
        world_size=world,
        shuffle=config.data.shuffle,
        seed=config.train.seed,
        prefetch=0,
    )
    sample = itertools.islice(loader, model.cache.static_sample_batches)
    counts = count_ids((batch.sparse for batch in sample), tables)
    if env is None or env.world_size == 1:
        return counts
    flat = torch.cat([counts[t.name] for t in tables])
    total = env.comm.all_reduce(flat, label="static_sample").wait()
    return dict(
        zip((t.name for t in tables), torch.split(total, [t.num_embeddings for t in tables]))
    )


@dataclass(frozen=True, kw_only=True)
class PinnedRows:
    """The rows one cached table (or shard) pinned, and how much of the sample they serve.

    Args:
        name: the local table name (the table's own name in one process).
        table: the global table.
        rows: the pinned rows, global ids, ascending.
        table_rows: the rows of the local table (or shard).
        lookups: the sample's lookups of the global table.
        covered: those that hit a pinned row.
    """

    name: str
    table: str
    rows: torch.Tensor
    table_rows: int
    lookups: int
    covered: int

    @property
    def share(self) -> float:
        """``covered / lookups`` (0 for a table the sample never looked up)."""
        return self.covered / self.lookups if self.lookups else 0.0

    def describe(self) -> str:
        """One line for the log."""
        shown = ", ".join(str(r) for r in self.rows[:8].tolist())
        more = ", ..." if self.rows.numel() > 8 else ""
        return (
            f"{self.name}: {self.rows.numel()} of {self.table_rows} rows pinned "
            f"({shown}{more}), covering {self.share:.1%} of the sample's {self.lookups} "
            f"lookups of {self.table}"
        )


def pinned_rows(module: nn.Module, counts: Mapping[str, torch.Tensor]) -> list[PinnedRows]:
    """What each cached table (or this rank's cached shard) of ``module`` pinned.

    Args:
        module: the run's embedding module (``build.held_tables``: its cached rows, by
            local table, and where each local table sits in its global table; a
            collection without a cache pins nothing).
        counts: ``sample_counts``.

    Returns:
        One ``PinnedRows`` per cached local table.

    Raises:
        TypeError: for a module that does not report its tables (``HeldTables``).
    """
    held = held_tables(module)
    where = {e["name"]: e for e in held.shard_layout()}
    out = []
    for name, local in held.cached_rows().items():
        entry = where[name]
        table = entry["table"]
        c = counts[table]
        first, last = entry["rows"]
        rows = local + first
        out.append(
            PinnedRows(
                name=name,
                table=table,
                rows=rows,
                table_rows=last - first,
                lookups=int(c.sum()),
                covered=int(c[rows].sum()),
            )
        )
    return out


def log_pinned(pinned: list[PinnedRows], sample_batches: int, rank: int | None) -> None:
    """Log each table's pinned rows (``rank``: prefix of a sharded run's lines)."""
    where = f"rank {rank}: " if rank is not None else ""
    for p in pinned:
        logger.info("%sstatic cache (first %d batches): %s", where, sample_batches, p.describe())
