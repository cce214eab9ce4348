"""``ShardedEmbeddingBagCollection``: the collection's tables over ranks, by a plan.

A drop-in for the unsharded collections (same protocol: ``feature_names``,
``feature_dims``, called on this rank's ``SparseFeatures``, returns its samples'
``PooledEmbeddings``). Inputs and outputs are data-parallel: each rank passes its own
samples and gets their embeddings. In between, per group of tables that move alike::

    1. input_dist  of every group started (ids travel to the ranks holding them)
    2. lookup      of every group, as its ids arrive (the local fused kernels)
    3. output_dist of every group started, then waited (pooled rows come back)
    4. the groups' columns put in feature order

Backward mirrors it; each rank's rows are updated by the fused optimizer during
backward. ``fused_optimizer`` is one ``FusedOptimizer`` for every local kernel, with the
``torch.optim`` surface; its state dict holds this rank's shards, keyed by local table
name (see ``shard_layout`` for which block of which table each one is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from tetrarec.cache import CacheStats
from tetrarec.comm import Handle
from tetrarec.embedding import TableConfig, feature_order
from tetrarec.kernels import FusedOptimizer, LocalLookup
from tetrarec.sharding.env import ShardingEnv
from tetrarec.sharding.group import LookupOptions, ShardedGroup
from tetrarec.sharding.plan import ShardingPlan, TablePlan
from tetrarec.sharding.routing import BlockColumns, place_columns
from tetrarec.sharding.strategy import GROUPS, strategy_of
from tetrarec.sparse import PooledEmbeddings, SparseFeatures, permute_keys
from tetrarec.types import Placement

__all__ = ["ShardedEmbeddingBagCollection"]


def _check_placements(plan: ShardingPlan, env: ShardingEnv, tables: Sequence[TableConfig]) -> None:
    """Refuse placements the shards cannot honour.

    Rows live in the rank's own memory (host memory on a CPU rank, device memory on an
    accelerator) at the table's configured precision; a shard may also be ``cached`` or
    ``ssd`` (``tetrarec.cache``: each rank caches its own shards, in device memory on an
    accelerator with the backing rows in host memory; the replicas of a data-parallel
    table all run the global batch's policy step; column blocks of a row-wise optimizer
    share their rows' state wherever it lives, slot or backing store).

    Raises:
        ValueError: naming the tables and their placements.
    """
    precision = {t.name: t.precision for t in tables}
    changed = [
        f"{tp.table} ({precision[tp.table].value} -> {tp.placement.precision.value})"
        for tp in plan
        if tp.placement is not None and tp.placement.precision is not precision[tp.table]
    ]
    if changed:
        raise ValueError(
            f"the sharding plan stores tables {', '.join(changed)} at another precision than "
            "the config's model.precision: set model.precision to the plan's (one precision "
            "for every table), or plan again from this config (tetrarec plan --config ...)"
        )
    on_cpu = env.device.type in ("cpu", "meta")
    here = Placement.HOST if on_cpu else Placement.DEVICE
    allowed = {here, Placement.CACHED, Placement.SSD}
    bad = []
    for tp in plan:
        where = tp.placement
        if where is None or where.placement is here:
            continue
        if where.placement not in allowed:
            bad.append(f"{tp.table} ({tp.sharding.value}, {where.describe()})")
    if bad:
        raise ValueError(
            f"the sharding plan places tables {', '.join(bad)} where their shards cannot "
            f"live: a sharded table's rows stay in this rank's {here.value} memory, or "
            "cached / on SSD (tetrarec.cache): plan those tables otherwise"
        )


class ShardedEmbeddingBagCollection(nn.Module):
    """Tables sharded over the ranks of ``env`` as ``plan`` says.

    Args:
        tables: the (global) tables, in collection order.
        plan: where each table's blocks live; checked against ``tables`` and the world.
        env: the process group, topology and device.
        options: the fused optimizer, seed and kernel settings (the same as the
            unsharded ``FusedEmbeddingBagCollection`` takes).

    Raises:
        ValueError: if the plan does not fit the tables or the world.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        env: ShardingEnv,
        options: LookupOptions,
    ) -> None:
        super().__init__()
        self.tables = tuple(tables)
        plan.validate(self.tables)
        plan.check_world(env.world_size, env.local_world_size)
        _check_placements(plan, env, self.tables)
        self.plan, self.env, self.options = plan, env, options
        self.feature_names = feature_order(self.tables)
        self.feature_dims = tuple(t.dim for t in self.tables for _ in t.feature_names)
        by_key: dict[str, list[tuple[TableConfig, TablePlan]]] = {}
        for t in self.tables:
            tp = plan.table(t.name)
            by_key.setdefault(strategy_of(tp.sharding, t.name).group, []).append((t, tp))
        self.groups = nn.ModuleList(
            GROUPS[key](env, members, options) for key, members in by_key.items()
        )
        # The groups' output columns, side by side, put back in feature order.
        start, col = {}, 0
        for f, d in zip(self.feature_names, self.feature_dims):
            start[f] = col
            col += d
        self._placement = tuple(
            BlockColumns.from_columns(
                [start[f] + c for f, d in zip(g.feature_names, g.feature_dims) for c in range(d)]
            )
            for g in self._groups()
        )
        self._identity = len(self._placement) == 1 and self._placement[0].runs == (
            (0, 0, sum(self.feature_dims)),
        )
        self.fused_optimizer = FusedOptimizer(options.optimizer, self)
        for g in self._groups():
            g.use_optimizer(self.fused_optimizer)

    def _groups(self) -> list[ShardedGroup]:
        return [g for g in self.groups if isinstance(g, ShardedGroup)]

    def _locals(self) -> list[LocalLookup[Any]]:
        return [g.local for g in self._groups() if g.local is not None]

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """Pool this rank's samples (see the module docstring for the stages)."""
        return self.start(features).wait()

    def start(self, features: SparseFeatures) -> Handle[PooledEmbeddings]:
        """Run the input dists and lookups, start the output dists; wait for the result.

        A model that has other work (its bottom MLP) runs it between ``start`` and
        ``wait()``, while the pooled rows travel. Backward then overlaps the same way:
        the gradients' all-to-all starts before that work's backward and is waited after
        it (autograd runs the later-created nodes first).
        """
        if features.keys != self.feature_names:
            features = permute_keys(features, self.feature_names)
        groups = self._groups()
        with record_function("tetrarec/input_dist"):
            routed = [g.input_dist(permute_keys(features, g.feature_names)) for g in groups]
        with record_function("tetrarec/lookup"):
            pooled = [g.lookup(r.wait()) for g, r in zip(groups, routed)]
        with record_function("tetrarec/output_dist"):
            outs = [g.output_dist(p, r.wait()) for g, p, r in zip(groups, pooled, routed)]
        batch = features.batch_size

        def finish() -> PooledEmbeddings:
            with record_function("tetrarec/output_dist_wait"):
                parts = [o.wait() for o in outs]  # (B, D_g) each
                if self._identity:
                    values = parts[0]
                else:
                    flat = torch.cat([p.reshape(-1) for p in parts])
                    values = place_columns(flat, batch, self._placement, sum(self.feature_dims))
            return PooledEmbeddings(self.feature_names, self.feature_dims, values)

        return Handle(finish)

    # -- what the rank holds --------------------------------------------------------------

    def shard_layout(self) -> list[dict[str, Any]]:
        """This rank's local tables: name, global table, rows and columns."""
        return [entry for g in self._groups() for entry in g.shard_layout()]

    def table_weights(self) -> dict[str, torch.Tensor]:
        """``{local table name: (rows, cols) FP32}`` of this rank's blocks."""
        out: dict[str, torch.Tensor] = {}
        for local in self._locals():
            out.update(local.table_weights())
        return out

    def cache_stats(self) -> dict[str, CacheStats]:
        """``{local table name: CacheStats}`` of this rank's cached shards.

        A whole table (table-wise, or a data-parallel replica, whose policy step runs on
        the global batch) counts what the one-process cache counts; a row block counts
        its own rows' lookups.
        """
        out: dict[str, CacheStats] = {}
        for local in self._locals():
            out.update(local.cache_stats())  # {} from a module without a cache
        return out

    def counted_cache_stats(self) -> dict[str, CacheStats]:
        """``cache_stats`` of the shards that count their rows' lookups for the world.

        Summed over the ranks, these give each table's lookups once, as one process
        counts them: a data-parallel table's replicas each see the global batch, and a
        column block looks up every row of the table for its columns, so only the
        replica on the lowest rank and the first column block (``cols[0] == 0``) of a
        row range count. Row blocks count their own rows.
        """
        stats = self.cache_stats()
        out: dict[str, CacheStats] = {}
        for entry in self.shard_layout():
            name, rows, cols = entry["name"], entry["rows"], entry["cols"]
            if name not in stats or cols[0] != 0:
                continue
            same = [
                s.rank
                for s in self.plan.table(entry["table"]).shards
                if list(s.rows) == rows and list(s.cols) == cols
            ]
            if self.env.rank == min(same, default=self.env.rank):
                out[name] = stats[name]
        return out

    def cached_rows(self) -> dict[str, torch.Tensor]:
        """``{local table name: rows in its cache, ascending}`` of this rank's cached shards.

        Row ids are local to the shard (``shard_layout`` gives its first global row).
        """
        out: dict[str, torch.Tensor] = {}
        for local in self._locals():
            out.update(local.cached_rows())  # {} from a module without a cache
        return out

    # -- FusedState -----------------------------------------------------------------------

    def storages(self) -> list[torch.Tensor]:
        """Every local kernel's flat row storages."""
        return [s for local in self._locals() for s in local.storages()]

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{local table name: {state name: tensor}}`` of this rank's blocks."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for local in self._locals():
            out.update(local.optimizer_state())
        return out

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy ``state`` (as ``optimizer_state`` returns it) into the local kernels.

        Raises:
            ValueError: for missing or unexpected local tables, or other shapes; raised
                before anything is copied.
        """
        mine = self.optimizer_state()
        if set(state) != set(mine):
            raise ValueError(
                f"rank {self.env.rank}: optimizer state for {sorted(state)}, this rank holds "
                f"{sorted(mine)}"
            )
        given = [(local, {t.name: state[t.name] for t in local.tables}) for local in self._locals()]
        for local, part in given:
            local.check_optimizer_state(part)
        for local, part in given:
            local.load_optimizer_state(part)
