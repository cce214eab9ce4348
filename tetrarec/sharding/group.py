"""``ShardedGroup``: the tables of one sharding kind on this rank, in three named stages.

A sharded collection holds one group per kind of placement in its plan (whole tables and
column blocks, row blocks, replicated tables). Each group runs::

    input_dist(features)  -> Handle[Routed]     send each rank the ids its shards pool
    lookup(routed)        -> (sum B_s, D_me)    the local fused kernels over this rank's
                                                shards (rows updated in their backward)
    output_dist(pooled, routed) -> Handle[(B, sum D_f)]
                                                pooled rows back to their samples' owner,
                                                columns in ``feature_names`` order

Backward mirrors forward through the autograd-aware collectives. On every rank a group
builds the same autograd graph, even where it holds no shard (its lookup is then an
empty leaf): the collectives of backward are then issued in the same order everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec
from tetrarec.comm import Handle
from tetrarec.embedding import SparseOptimizerSpec, TableConfig, TableSlice
from tetrarec.kernels import FusedEmbeddingBagCollection, FusedOptimizer, LocalLookup
from tetrarec.sharding.env import ShardingEnv
from tetrarec.sharding.plan import TablePlacement, TablePlan
from tetrarec.sharding.routing import Routed
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Placement, PoolingMode

__all__ = ["LocalShard", "LookupOptions", "ShardedGroup", "build_local_lookup", "select_features"]


@dataclass(frozen=True, kw_only=True)
class LookupOptions:
    """How the local fused kernels of every group are built.

    Args:
        optimizer: the fused rule and its starting hyperparameters.
        seed: the collection's seed (initial rows, rounding streams).
        deterministic: bitwise-reproducible backward.
        stochastic_rounding: round low-precision rows stochastically.
        check_bounds: check ids (done once, before they are sent).
        cache: the policy and SSD directory of the shards whose plan placement is
            ``cached`` or ``ssd`` (default: LRU); their size is the plan's fraction
            (this spec's own size is not used).
        static_counts: ``{global table name: (rows,) id counts}`` of a data sample,
            for the ``static`` policy (``tetrarec.cache.count_ids``); each cached shard
            pins the hottest of its own rows by its rows' counts.
    """

    optimizer: SparseOptimizerSpec
    seed: int
    deterministic: bool = True
    stochastic_rounding: bool = True
    check_bounds: bool = True
    cache: CacheSpec | None = None
    static_counts: Mapping[str, torch.Tensor] | None = None


@dataclass(frozen=True, kw_only=True)
class LocalShard:
    """One local table of this rank: a block of a global table.

    Args:
        name: the local table's name (the global name for a whole table).
        table: the global table.
        rows: its global rows.
        cols: its global columns.
        feature_names: the local names of the features that look it up.
        pooling: the pooling the local kernel applies (row blocks always sum).
    """

    name: str
    table: TableConfig
    rows: tuple[int, int]
    cols: tuple[int, int]
    feature_names: tuple[str, ...]
    pooling: PoolingMode = field(default=PoolingMode.SUM)

    def config(self) -> TableConfig:
        """The local table."""
        return TableConfig(
            name=self.name,
            num_embeddings=self.rows[1] - self.rows[0],
            dim=self.cols[1] - self.cols[0],
            feature_names=self.feature_names,
            pooling=self.pooling,
            precision=self.table.precision,
        )

    def slice(self) -> TableSlice:
        """Where it sits in the global table."""
        return TableSlice(table=self.table, row_start=self.rows[0], col_start=self.cols[0])


def select_features(
    sf: SparseFeatures, index: Sequence[int], keys: Sequence[str]
) -> SparseFeatures:
    """Features ``sf.keys[index[i]]`` renamed ``keys[i]`` (an index may repeat).

    Raises:
        ValueError: if ``index`` and ``keys`` differ in length.
    """
    if len(index) != len(keys):
        raise ValueError(f"{len(index)} indices for {len(keys)} keys")
    if list(index) == list(range(sf.num_keys)):
        return SparseFeatures(
            tuple(keys), sf.values, sf.lengths, sf.batch_size, sf.weights, sf.value_counts
        )
    counts = sf.value_counts_host()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    vals = [sf.values[starts[i] : starts[i + 1]] for i in index]
    lens = sf.lengths_2d()[list(index)].reshape(-1)
    w = None
    if sf.weights is not None:
        pieces = [sf.weights[starts[i] : starts[i + 1]] for i in index]
        w = torch.cat(pieces) if pieces else sf.weights[:0]
    values = torch.cat(vals) if vals else sf.values[:0]
    return SparseFeatures(
        tuple(keys), values, lens, sf.batch_size, w, tuple(counts[i] for i in index)
    )


def _shard_counts(
    shards: Sequence[LocalShard], counts: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    """Each shard's rows' counts out of its global table's (``LookupOptions.static_counts``)."""
    if counts is None:
        return None
    return {
        s.name: counts[s.table.name][s.rows[0] : s.rows[1]]
        for s in shards
        if s.table.name in counts
    }


def build_local_lookup(
    shards: Sequence[LocalShard],
    placed: Mapping[str, TablePlacement | None],
    options: LookupOptions,
    device: torch.device,
) -> LocalLookup[Any] | None:
    """The local lookup module over ``shards`` (``None`` without any shard).

    A ``CachedEmbeddingBagCollection`` when a shard's table is placed ``cached`` or
    ``ssd``, else a ``FusedEmbeddingBagCollection``; ids are checked once, on the
    sending rank (``ShardedGroup.bad_id``), so neither checks them again.

    Args:
        shards: this rank's shards of a group.
        placed: ``{global table name: its plan placement}``.
        options: how the modules are built.
        device: the rank's device.
    """
    if not shards:
        return None
    configs, slices = [s.config() for s in shards], [s.slice() for s in shards]
    cached = {
        s.name: where
        for s in shards
        if (where := placed[s.table.name]) is not None
        and where.placement in (Placement.CACHED, Placement.SSD)
    }
    if not cached:
        return FusedEmbeddingBagCollection(
            configs,
            options.optimizer,
            check_bounds=False,
            deterministic=options.deterministic,
            stochastic_rounding=options.stochastic_rounding,
            seed=options.seed,
            device=device,
            slices=slices,
        )
    # each rank caches its own shards, at the plan's fraction of their rows (the only
    # size: a byte budget is the config's for the tables together, turned into
    # fractions by the run, not this group's); on an accelerator the slots live in its
    # memory and the backing rows in host memory, and the uncached shards stay in its
    # memory ("device")
    fractions = {n: w.cache_fraction for n, w in cached.items()}
    given = options.cache or CacheSpec(fraction=0.0)
    on_cpu = device.type in ("cpu", "meta")
    uncached = Placement.HOST if on_cpu else Placement.DEVICE
    return CachedEmbeddingBagCollection(
        configs,
        options.optimizer,
        dataclasses.replace(given, fraction=0.0, bytes=None),
        placements={
            s.name: cached[s.name].placement if s.name in cached else uncached for s in shards
        },
        fractions={n: f for n, f in fractions.items() if f > 0},
        check_bounds=False,
        deterministic=options.deterministic,
        stochastic_rounding=options.stochastic_rounding,
        seed=options.seed,
        slices=slices,
        static_counts=_shard_counts(shards, options.static_counts),
        device=None if on_cpu else device,
    )


class ShardedGroup(nn.Module):
    """Base of the groups (see the module docstring).

    Args:
        env: where it runs.
        tables: the group's tables and their plans, in collection order.
        local: this rank's shards of them.
        options: how the local kernels are built.

    Attributes:
        feature_names: the global features this group pools, in its output order.
        feature_dims: their dims.
        local: the local lookup module over this rank's shards (``None`` without
            any; ``build_local_lookup``).
    """

    def __init__(
        self,
        env: ShardingEnv,
        tables: Sequence[tuple[TableConfig, TablePlan]],
        local: Sequence[LocalShard],
        options: LookupOptions,
    ) -> None:
        super().__init__()
        self.env = env
        self.tables = tuple(t for t, _ in tables)
        self.plans = tuple(p for _, p in tables)
        self.feature_names = tuple(f for t in self.tables for f in t.feature_names)
        self.feature_dims = tuple(t.dim for t in self.tables for _ in t.feature_names)
        self.shards = tuple(local)
        #: The local lookup module over this rank's shards (``None`` without any): run
        #: through ``LocalLookup`` only, whichever collection ``build_local_lookup`` chose.
        self.local: LocalLookup[Any] | None = build_local_lookup(
            self.shards, {t.name: p.placement for t, p in tables}, options, env.device
        )
        self.check_bounds = options.check_bounds

    @property
    def local_dim(self) -> int:
        """Columns this rank's lookup produces."""
        return sum(self.local.feature_dims) if self.local is not None else 0

    def use_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Make the local kernels read their hyperparameters from ``optimizer``."""
        if self.local is not None:
            self.local.fused_optimizer = optimizer

    def bad_id(self, features: SparseFeatures) -> tuple[int, int] | None:
        """The first out-of-range id of the group's features (when ``check_bounds``)."""
        from tetrarec.sharding.routing import bad_id

        if not self.check_bounds:
            return None
        rows = [t.num_embeddings for t in self.tables for _ in t.feature_names]
        return bad_id(features, rows)

    # -- the three stages -----------------------------------------------------------------

    def input_dist(self, features: SparseFeatures) -> Handle[Routed]:
        """Start sending each rank the ids its shards pool (``features``: the group's)."""
        raise NotImplementedError

    def lookup(self, routed: Routed) -> torch.Tensor:
        """``(sum B_s, local_dim)`` pooled rows of the received ids, source-major.

        Where this rank holds no shard, an empty leaf that still takes part in backward.
        """
        if self.local is None:
            out = torch.zeros(routed.features.batch_size, 0, device=self.env.device)
            out.requires_grad_(torch.is_grad_enabled())
            weights = routed.features.weights
            if weights is not None and weights.requires_grad:
                # Keep the received weights in the graph, so that their all-to-all runs
                # backward here too, as on the ranks whose kernels use them.
                out = out + 0.0 * weights.sum()
            return out
        pooled: torch.Tensor = self.local(self.local_features(routed.features)).values
        return pooled

    def local_features(self, received: SparseFeatures) -> SparseFeatures:
        """The received features as the local kernels name them (default: as received)."""
        return received

    def output_dist(self, pooled: torch.Tensor, routed: Routed) -> Handle[torch.Tensor]:
        """Start sending pooled rows back; the handle gives ``(B, sum feature_dims)``."""
        raise NotImplementedError

    def forward(self, features: SparseFeatures) -> torch.Tensor:
        """The three stages in a row (``features``: this group's, this rank's samples)."""
        routed = self.input_dist(features).wait()
        return self.output_dist(self.lookup(routed), routed).wait()

    # -- layout ---------------------------------------------------------------------------

    def shard_layout(self) -> list[dict[str, object]]:
        """Each local table: its name, global table, rows and columns (for checkpoints)."""
        return [
            {"name": s.name, "table": s.table.name, "rows": list(s.rows), "cols": list(s.cols)}
            for s in self.shards
        ]
