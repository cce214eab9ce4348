"""``PlannerInputs``: what the planner knows about a model, its data and its machines.

Per table: rows, dim, the features that look it up, the row precision (and the ones the
planner may choose from), the optimizer state per row; per feature: the mean pooling
factor and the access skew (share of lookups hitting the hottest 1% and 5% of rows). A
feature without statistics gets pooling 1 and no skew (``hot_1pct = 0.01``,
``hot_5pct = 0.05``: uniform access).

Dense FLOPs per sample (forward + backward = 3 x forward; a matmul of ``a x b`` weights
costs ``2ab`` per sample forward)::

    mlp(n_in, sizes)   = sum_l 2 * in_l * out_l
    dot interaction    = 2 * F^2 * d            (F = tables + 1 vectors of dim d, one bmm)
    dcn cross layers   = layers * 2 * (2 * F d * r)   (x (F d) -> r -> F d per layer)
    top input          = d + F (F - 1) / 2      (dot)   or   F d   (dcn)
    flops_per_sample   = 3 * (mlp(bottom) + interaction + mlp(top))
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tetrarec.config.tables import build_tables, fixed_placements, model_tables
from tetrarec.embedding import TableConfig
from tetrarec.models import first_order_optimizer
from tetrarec.planner.topology import Topology
from tetrarec.sharding.plan import TablePlacement
from tetrarec.types import OptimizerKind, Precision, ShardingType

if TYPE_CHECKING:
    from tetrarec.config import RunConfig
    from tetrarec.models.config import DLRMConfig

logger = logging.getLogger(__name__)

__all__ = [
    "AccessStats",
    "PlannerInputs",
    "TableSpec",
    "dense_cost",
    "inputs_from_config",
    "load_stats",
    "state_bytes_per_row",
]

#: Bytes of one optimizer-state value (the kernels keep FP32 state, step counts included).
STATE_VALUE_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class AccessStats:
    """One feature's access statistics (``tetrarec stats``).

    Args:
        mean_pooling: ids per sample.
        hot_1pct: share of lookups that hit the hottest 1% of the table's rows.
        hot_5pct: same for 5%.

    Raises:
        ValueError: on a negative pooling or shares outside [0, 1] or out of order.
    """

    mean_pooling: float = 1.0
    hot_1pct: float = 0.01
    hot_5pct: float = 0.05

    def __post_init__(self) -> None:
        if self.mean_pooling < 0:
            raise ValueError(f"mean_pooling must be >= 0, got {self.mean_pooling}")
        if not 0.0 <= self.hot_1pct <= self.hot_5pct <= 1.0:
            raise ValueError(
                f"need 0 <= hot_1pct <= hot_5pct <= 1, got {self.hot_1pct}, {self.hot_5pct}"
            )


def state_bytes_per_row(kind: OptimizerKind, dim: int) -> int:
    """Optimizer-state bytes per row: FP32 values of ``state_layout``, step count included.

    >>> state_bytes_per_row(OptimizerKind.ROWWISE_ADAGRAD, 64)
    4
    >>> state_bytes_per_row(OptimizerKind.ADAM, 4)
    36
    """
    widths = sum(kind.state_layout(dim).values()) + (1 if kind.counts_steps else 0)
    return widths * STATE_VALUE_BYTES


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One table as the planner sees it.

    Args:
        name: table name.
        rows: rows.
        dim: embedding dim.
        features: features that look it up.
        precision: the configured row precision (the plan keeps it unless
            ``precisions`` allows lower ones).
        precisions: precisions the planner may choose from, preferred first (default:
            ``(precision,)``: no choice).
        optimizer: the sparse optimizer (its state lives beside the rows).
        stats: per-feature statistics, in ``features`` order.
        placement: where the config fixes the rows (its ``cached`` and ``ssd``
            tables: a run keeps them there whatever its plan says), so the planner
            chooses only the sharding; ``None``: the planner chooses the tier too.
        shardings: the sharding types the planner may choose from (default: every
            registered type whose cost terms say ``offered``).

    Raises:
        ValueError: on a bad size or stats that do not match ``features``.
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    precision: Precision = Precision.FP32
    precisions: tuple[Precision, ...] = ()
    optimizer: OptimizerKind = OptimizerKind.ROWWISE_ADAGRAD
    stats: tuple[AccessStats, ...] = ()
    placement: TablePlacement | None = None
    shardings: tuple[ShardingType, ...] = ()

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: rows and dim must be > 0")
        if not self.features:
            object.__setattr__(self, "features", (self.name,))
        if not self.precisions:
            object.__setattr__(self, "precisions", (self.precision,))
        if not self.stats:
            object.__setattr__(self, "stats", tuple(AccessStats() for _ in self.features))
        if len(self.stats) != len(self.features):
            raise ValueError(
                f"table {self.name!r}: {len(self.stats)} stats for {len(self.features)} features"
            )

    @property
    def pooling(self) -> float:
        """Ids per sample over all its features."""
        return sum(s.mean_pooling for s in self.stats)

    def hot(self, fraction: float) -> float:
        """Share of lookups hitting the hottest ``fraction`` (0.01 or 0.05) of rows.

        Lookup-weighted over the features.
        """
        total = self.pooling
        if total <= 0:
            return fraction
        hot = [s.hot_1pct if fraction <= 0.01 else s.hot_5pct for s in self.stats]
        return sum(h * s.mean_pooling for h, s in zip(hot, self.stats)) / total

    def distinct(self, ids: float) -> float:
        """Expected distinct rows among ``ids`` lookups of this table.

        The statistics split the rows into the hottest 1%, the next 4% and the rest,
        with shares ``h1``, ``h5 - h1`` and ``1 - h5`` of the lookups; within a part,
        lookups are taken as uniform, so a part of ``k`` rows receiving ``m`` of them
        touches ``k (1 - exp(-m / k))`` rows.
        """
        if ids <= 0:
            return 0.0
        h1, h5 = self.hot(0.01), self.hot(0.05)
        parts = ((0.01, h1), (0.04, h5 - h1), (0.95, 1.0 - h5))
        total = 0.0
        for frac, share in parts:
            k = max(frac * self.rows, 1.0)
            m = ids * max(share, 0.0)
            total += k * -math.expm1(-m / k)
        return min(total, ids, float(self.rows))

    def row_bytes(self, precision: Precision, cols: int | None = None) -> int:
        """Bytes of one stored row of ``cols`` columns (default: the dim)."""
        return precision.row_bytes(self.dim if cols is None else cols)

    def state_bytes(self, cols: int | None = None) -> int:
        """Optimizer-state bytes of one row of ``cols`` columns (default: the dim)."""
        return state_bytes_per_row(self.optimizer, self.dim if cols is None else cols)

    @property
    def params(self) -> int:
        """Parameters (rows x dim)."""
        return self.rows * self.dim

    def config(self) -> TableConfig:
        """The ``TableConfig`` the plan is validated against."""
        return TableConfig(
            name=self.name,
            num_embeddings=self.rows,
            dim=self.dim,
            feature_names=self.features,
            precision=self.precision,
        )


@dataclass(frozen=True, kw_only=True)
class PlannerInputs:
    """Everything a plan depends on.

    Args:
        tables: the tables, in model order.
        batch_size: the global batch size (samples per step over all ranks).
        dense_flops_per_sample: forward + backward FLOPs of the dense part per sample.
        dense_params: parameters of the dense part (all-reduced every step).
        topology: the machines (its world size is the plan's).

    Raises:
        ValueError: on no tables, repeated names, or a bad batch size.
    """

    tables: tuple[TableSpec, ...]
    batch_size: int
    dense_flops_per_sample: float = 0.0
    dense_params: int = 0
    topology: Topology

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        if not self.tables:
            raise ValueError("the planner needs at least one table")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names repeat: {names}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.dense_flops_per_sample < 0 or self.dense_params < 0:
            raise ValueError("dense_flops_per_sample and dense_params must be >= 0")

    def table_configs(self) -> tuple[TableConfig, ...]:
        """The tables as ``TableConfig`` (for ``ShardingPlan.validate``)."""
        return tuple(t.config() for t in self.tables)


def _mlp(n_in: int, sizes: Sequence[int]) -> tuple[int, int]:
    """(forward FLOPs per sample, parameters) of an MLP."""
    flops = params = 0
    for out in sizes:
        flops += 2 * n_in * out
        params += n_in * out + out
        n_in = out
    return flops, params


def dense_cost(dlrm: DLRMConfig, num_tables: int) -> tuple[float, int]:
    """(forward + backward FLOPs per sample, parameters) of the dense part.

    See the module docstring for the formula. DCN's cross layers count as in
    ``tetrarec.models``: ``x_{l+1} = x_0 * (W (V x_l)) + x_l`` with ``V: Fd -> r``.
    """
    from tetrarec.models.config import ModelArch

    d = dlrm.embedding_dim
    bottom_flops, bottom_params = _mlp(max(dlrm.num_dense, 1), dlrm.bottom_mlp)
    f = num_tables + 1
    if dlrm.arch is ModelArch.DCN:
        width = f * d
        inter = dlrm.dcn_layers * 2 * (2 * width * dlrm.dcn_low_rank)
        inter_params = dlrm.dcn_layers * (2 * width * dlrm.dcn_low_rank + width)
        top_in = width
    else:
        inter, inter_params = 2 * f * f * d, 0
        top_in = d + f * (f - 1) // 2
    top_flops, top_params = _mlp(top_in, dlrm.top_mlp)
    return 3.0 * (bottom_flops + inter + top_flops), bottom_params + inter_params + top_params


def load_stats(source: str | Path | Mapping[str, Any]) -> dict[str, AccessStats]:
    """Per-feature statistics from ``tetrarec stats --json`` (a path or the parsed dict).

    Raises:
        ValueError: naming the feature and the field that is missing or out of range.
    """
    if isinstance(source, Mapping):
        data: Any = source
        where = "stats"
    else:
        where = str(source)
        try:
            data = json.loads(Path(source).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e}") from e
    features = data.get("features") if isinstance(data, Mapping) else None
    if not isinstance(features, Mapping):
        raise ValueError(f"{where}: needs a 'features' object")
    out: dict[str, AccessStats] = {}
    for name, entry in features.items():
        try:
            out[str(name)] = AccessStats(
                mean_pooling=float(entry.get("mean_pooling", 1.0)),
                hot_1pct=float(entry.get("hot_1pct", 0.01)),
                hot_5pct=float(entry.get("hot_5pct", 0.05)),
            )
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: feature {name!r}: {e}") from e
    return out


def inputs_from_config(
    config: RunConfig,
    topology: Topology,
    stats: str | Path | Mapping[str, Any] | None = None,
) -> PlannerInputs:
    """The planner's inputs for a run config on ``topology``.

    Tables are ``model_tables(config.model)`` (the embedding tables, then a first-order
    term's), the ``cached`` and ``ssd`` ones placed as the config says
    (``TableSpec.placement``); the optimizer is ``optim.sparse.kind`` (a first-order
    table's is its own, Adagrad);
    the batch is ``data.batch_size`` (global); features missing from ``stats`` get
    the defaults (pooling 1, uniform access).

    Raises:
        ValueError: on a bad stats file.
    """
    per_feature = load_stats(stats) if stats is not None else {}
    configs = model_tables(config.model)
    num_embedding_tables = len(build_tables(config.model))
    features = list(dict.fromkeys(f for t in configs for f in t.feature_names))
    missing = [f for f in features if f not in per_feature]
    if stats is not None and missing:
        logger.warning(
            "the stats file has no statistics for %d of the run's %d features (%s%s): they "
            "get the defaults (pooling 1, uniform access)%s",
            len(missing),
            len(features),
            ", ".join(missing[:5]),
            ", ..." if len(missing) > 5 else "",
            "; was it written for another config?" if len(missing) == len(features) else "",
        )
    kind = config.optim.sparse.kind
    dlrm = config.model.dlrm
    first_order = first_order_optimizer(
        lr=dlrm.first_order_lr, weight_decay=dlrm.first_order_weight_decay
    ).kind
    kinds = {t.name: kind for t in configs[:num_embedding_tables]}
    fixed = fixed_placements(config.model, kind)
    tables = tuple(
        TableSpec(
            name=t.name,
            rows=t.num_embeddings,
            dim=t.dim,
            features=t.feature_names,
            precision=t.precision,
            optimizer=kinds.get(t.name, first_order),
            stats=tuple(per_feature.get(f, AccessStats()) for f in t.feature_names),
            placement=fixed.get(t.name),
        )
        for t in configs
    )
    flops, params = dense_cost(config.model.dlrm, num_embedding_tables)
    return PlannerInputs(
        tables=tables,
        batch_size=config.data.batch_size,
        dense_flops_per_sample=flops,
        dense_params=params,
        topology=topology,
    )
