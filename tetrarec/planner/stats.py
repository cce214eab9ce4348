"""Per-feature access statistics measured from a sample of the training rows.

The planner's cost model needs, per feature, how many ids a bag holds and how skewed
the lookups are over the rows of the feature's table (a skewed feature is served well
by a small cache of hot rows). ``feature_stats`` reads the first ``rows`` training rows
and counts, per feature, the lookups of each row of its table.

Definitions, per feature ``f`` looking up table ``t`` of ``E = t.num_embeddings`` rows,
over the ``n`` sampled rows (samples)::

    lookups(f)      = number of ids of f in the sample (repeats within a bag count)
    count_f[r]      = lookups of f that hit row r of t          (np.bincount of the ids)
    mean_pooling    = lookups(f) / n                            (mean ids per bag; an
                                                                 empty bag counts as 0)
    hot_1pct        = sum of the ceil(0.01 * E) largest count_f[r] / lookups(f)
    hot_5pct        = sum of the ceil(0.05 * E) largest count_f[r] / lookups(f)
    distinct_rows   = number of rows r with count_f[r] > 0

Example: ``E = 100``, 4 samples with bags ``[3], [3, 7], [], [3]``: 4 lookups,
``mean_pooling = 1.0``; the hottest ``ceil(1) = 1`` row (row 3) takes 3 lookups, so
``hot_1pct = 0.75``; the hottest 5 rows take all 4, ``hot_5pct = 1.0``;
``distinct_rows = 2``.

Several features may share one table (``TableConfig.feature_names``): each is counted
on its own against the shared table's rows, since each has its own bags and its own
skew. A feature without any id in the sample has every statistic 0 (its share of hot
lookups is undefined; 0 says "no evidence of skew").

Only the first rows are read (not a random sample): reading is sequential and cheap,
and training data is usually shuffled already; for time-ordered data the first rows
may not represent the rest.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from tetrarec.data.datasets import Dataset
from tetrarec.embedding.config import TableConfig, feature_order

__all__ = ["DEFAULT_MAX_ROWS", "FeatureStat", "FeatureStats", "feature_stats"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 1_000_000  # rows read when ``rows`` is None (the sample's cap)
_CHUNK_ROWS = 65_536  # rows per ``Dataset.read``
_STAT_FIELDS = (
    "table",
    "num_embeddings",
    "mean_pooling",
    "hot_1pct",
    "hot_5pct",
    "distinct_rows",
)


@dataclass(frozen=True, kw_only=True)
class FeatureStat:
    """The access statistics of one feature (definitions in the module docstring).

    Args:
        table: the table the feature looks up.
        num_embeddings: that table's rows.
        mean_pooling: mean ids per bag over the sampled rows.
        hot_1pct: share of the feature's lookups that hit the ``ceil(1%)`` most
            looked-up rows of its table.
        hot_5pct: the same for the ``ceil(5%)`` most looked-up rows.
        distinct_rows: rows of the table the feature looked up at least once.

    Raises:
        ValueError: for a negative pooling or count, a share outside ``[0, 1]``,
            ``hot_1pct > hot_5pct`` or more distinct rows than the table has.
    """

    table: str
    num_embeddings: int
    mean_pooling: float
    hot_1pct: float
    hot_5pct: float
    distinct_rows: int

    def __post_init__(self) -> None:
        if self.num_embeddings <= 0:
            raise ValueError(
                f"table {self.table!r}: num_embeddings must be positive, got {self.num_embeddings}"
            )
        if self.mean_pooling < 0 or not math.isfinite(self.mean_pooling):
            raise ValueError(
                f"table {self.table!r}: mean_pooling must be finite and >= 0, "
                f"got {self.mean_pooling}"
            )
        for name in ("hot_1pct", "hot_5pct"):
            share = getattr(self, name)
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"table {self.table!r}: {name} must be in [0, 1], got {share}")
        if self.hot_1pct > self.hot_5pct + 1e-12:
            raise ValueError(
                f"table {self.table!r}: hot_1pct ({self.hot_1pct}) cannot exceed hot_5pct "
                f"({self.hot_5pct}): the hottest 1% of rows are among the hottest 5%"
            )
        if not 0 <= self.distinct_rows <= self.num_embeddings:
            raise ValueError(
                f"table {self.table!r}: distinct_rows must be in [0, {self.num_embeddings}], "
                f"got {self.distinct_rows}"
            )


@dataclass(frozen=True, kw_only=True)
class FeatureStats:
    """Statistics of every feature, measured on ``rows_sampled`` training rows.

    JSON layout (``to_json``; what ``tetrarec stats --json`` writes)::

        {"rows_sampled": 100000, "batch_size": 2048,
         "features": {"C1": {"table": "C1", "num_embeddings": 1000, "mean_pooling": 1.0,
                             "hot_1pct": 0.41, "hot_5pct": 0.67, "distinct_rows": 812}}}

    Args:
        rows_sampled: training rows read.
        batch_size: the run's global training batch (the planner's step size).
        features: feature name -> its ``FeatureStat``, in feature order.

    Raises:
        ValueError: for a non-positive ``rows_sampled`` or ``batch_size``.
    """

    rows_sampled: int
    batch_size: int
    features: Mapping[str, FeatureStat]

    def __post_init__(self) -> None:
        if self.rows_sampled <= 0 or self.batch_size <= 0:
            raise ValueError(
                f"rows_sampled and batch_size must be positive, got {self.rows_sampled} "
                f"and {self.batch_size}"
            )
        object.__setattr__(self, "features", MappingProxyType(dict(self.features)))

    def to_json(self) -> dict[str, Any]:
        """The JSON-ready dict (layout in the class docstring)."""
        return {
            "rows_sampled": self.rows_sampled,
            "batch_size": self.batch_size,
            "features": {
                name: {k: getattr(s, k) for k in _STAT_FIELDS} for name, s in self.features.items()
            },
        }

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> FeatureStats:
        """Read what ``to_json`` wrote.

        Raises:
            ValueError: naming the missing or invalid field.
        """
        for key in ("rows_sampled", "batch_size", "features"):
            if key not in payload:
                raise ValueError(f"feature statistics: missing key {key!r}")
        features: dict[str, FeatureStat] = {}
        for name, entry in dict(payload["features"]).items():
            missing = [k for k in _STAT_FIELDS if k not in entry]
            if missing:
                raise ValueError(f"feature statistics of {name!r}: missing keys {missing}")
            extra = sorted(set(entry) - set(_STAT_FIELDS))
            if extra:
                raise ValueError(
                    f"feature statistics of {name!r}: unknown keys {extra} "
                    f"(valid: {list(_STAT_FIELDS)})"
                )
            features[name] = FeatureStat(
                table=str(entry["table"]),
                num_embeddings=int(entry["num_embeddings"]),
                mean_pooling=float(entry["mean_pooling"]),
                hot_1pct=float(entry["hot_1pct"]),
                hot_5pct=float(entry["hot_5pct"]),
                distinct_rows=int(entry["distinct_rows"]),
            )
        return cls(
            rows_sampled=int(payload["rows_sampled"]),
            batch_size=int(payload["batch_size"]),
            features=features,
        )

    def format_table(self) -> str:
        """A readable text table, one line per feature, with a header line."""
        head = ("feature", "table", "rows", "mean pooling", "hot 1%", "hot 5%", "distinct rows")
        cells = [
            (
                name,
                s.table,
                f"{s.num_embeddings:,}",
                f"{s.mean_pooling:.2f}",
                f"{s.hot_1pct:.1%}",
                f"{s.hot_5pct:.1%}",
                f"{s.distinct_rows:,} ({s.distinct_rows / s.num_embeddings:.1%})",
            )
            for name, s in self.features.items()
        ]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(c, widths)) for c in cells]
        return "\n".join(line.rstrip() for line in lines)


def _hot_share(sorted_counts: np.ndarray, num_rows: int, total: int) -> float:
    """Share of ``total`` in the ``num_rows`` largest counts (``sorted_counts`` descending)."""
    return float(sorted_counts[:num_rows].sum() / total) if total else 0.0


def _stat(table: TableConfig, ids: list[np.ndarray], rows: int) -> FeatureStat:
    """One feature's statistics from its ids of ``rows`` samples."""
    e = table.num_embeddings
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    total = int(flat.size)
    # bincount needs E counters; past a few per id, unique's sort is the smaller cost.
    if e <= 4 * total + 1024:
        counts = np.bincount(flat, minlength=e)
        counts = counts[counts > 0]
    else:
        counts = np.unique(flat, return_counts=True)[1]
    counts = np.sort(counts)[::-1]
    return FeatureStat(
        table=table.name,
        num_embeddings=e,
        mean_pooling=total / rows,
        hot_1pct=_hot_share(counts, math.ceil(0.01 * e), total),
        hot_5pct=_hot_share(counts, math.ceil(0.05 * e), total),
        distinct_rows=int(counts.size),
    )


def _check_ids(ids: np.ndarray, feature: str, table: TableConfig, first_row: int) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
        raise ValueError(
            f"feature {feature!r}: ids in rows from {first_row} lie outside table "
            f"{table.name!r}'s [0, {table.num_embeddings}): min {int(ids.min())}, "
            f"max {int(ids.max())}"
        )


def feature_stats(
    dataset: Dataset,
    tables: Sequence[TableConfig],
    *,
    rows: int | None = None,
    batch_size: int,
    chunk_rows: int = _CHUNK_ROWS,
) -> FeatureStats:
    """Measure each feature's pooling and skew on the first ``rows`` rows of ``dataset``.

    Reads ``chunk_rows`` rows at a time and logs its progress; holds the ids of the
    sample (4 bytes per id for tables under 2^31 rows) until the end, then counts
    them per feature (definitions in the module docstring).

    Args:
        dataset: the training rows (``build_datasets(...)[0]``); its ``keys`` must be
            ``feature_order(tables)``.
        tables: the model's tables.
        rows: rows to read from the start; ``None`` reads all, up to
            ``DEFAULT_MAX_ROWS``; more than the dataset has reads all it has.
        batch_size: the run's global training batch, recorded for the planner.
        chunk_rows: rows per read.

    Returns:
        The statistics, one entry per feature in feature order.

    Raises:
        ValueError: if ``rows`` or ``chunk_rows`` is not positive, the dataset has no
            rows, its features are not the tables' features, or an id lies outside its
            table.
    """
    if rows is not None and rows <= 0:
        raise ValueError(f"rows must be positive (or None for all), got {rows}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    keys = feature_order(list(tables))
    if tuple(dataset.keys) != keys:
        raise ValueError(
            f"the dataset's features {list(dataset.keys)} are not the tables' features "
            f"{list(keys)} (in feature order)"
        )
    table_of = {f: t for t in tables for f in t.feature_names}
    n = min(dataset.num_samples, DEFAULT_MAX_ROWS if rows is None else rows)
    if n == 0:
        raise ValueError("the training data has no rows to measure")
    if rows is None and dataset.num_samples > DEFAULT_MAX_ROWS:
        logger.info(
            "reading the first %d of %d rows (pass rows= to read more)", n, dataset.num_samples
        )
    narrow = all(t.num_embeddings < 2**31 for t in tables)
    ids: dict[str, list[np.ndarray]] = {f: [] for f in keys}
    started, last_log = time.monotonic(), time.monotonic()
    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        sparse = dataset.read(np.arange(start, stop, dtype=np.int64)).sparse
        per_key = sparse.lengths.view(len(sparse.keys), -1).sum(dim=1).tolist()  # (F,)
        values = sparse.values.numpy()
        offset = 0
        for key, count in zip(sparse.keys, per_key):
            part = values[offset : offset + count]
            offset += count
            _check_ids(part, key, table_of[key], start)
            ids[key].append(part.astype(np.int32 if narrow else np.int64))
        if time.monotonic() - last_log > 5.0 or stop == n:
            last_log = time.monotonic()
            logger.info(
                "feature statistics: %d of %d rows read (%.1f s)",
                stop,
                n,
                last_log - started,
            )
    return FeatureStats(
        rows_sampled=n,
        batch_size=batch_size,
        features={f: _stat(table_of[f], ids[f], n) for f in keys},
    )
