"""``CachedEmbeddingBagCollection``: FP32 caches of hot rows in front of low-precision tables.

The mixed-precision-embedding recipe: most rows are stored and trained in the table's
``precision`` (FP16, BF16, INT8, INT4); a few hot rows are copied into an FP32 cache,
where they are looked up and trained in FP32. The same protocol as
``FusedEmbeddingBagCollection`` (forward, ``fused_optimizer``, state dicts keyed by table
and row, the same initial rows for the same seed), built from unchanged fused
collections, its "parts" (``parts.py``): "cache" (the FP32 slots, on the run device),
"ram" (backing rows in process memory), "ssd" (backing rows in memory-mapped files) and,
on a GPU, "device" (uncached ``device`` tables). Placements: ``host`` = in "ram", no
cache (exactly ``FusedEmbeddingBagCollection``); ``cached`` = cache + "ram"; ``ssd`` =
cache + "ssd".

A training batch flows as::

    1. per cached table (on the host): unique ids; hits and misses counted; the policy
       (``policy.py``, ``slot_map.py``) admits misses, evicting idle victims: a victim
       updated since its admission is written back (FP32 -> stored precision,
       stochastic rounding drawn as the kernel would for that row at this iteration;
       state copied back); an admitted row is decoded into its slot with its state
       (``movement.py``)
    2. each id goes to one part (``route.py``): its slot in "cache" (hit) or its row in
       its backing part; a part's bag holds its share of the bag's ids
    3. each part pools its ids (``tbe_forward``, as sum); the outputs add up column by
       column, backing parts first; mean-pooled columns are divided by the bag length
    4. backward: the output gradient (mean columns divided by the bag length) goes to
       every part's ``tbe_backward_update``: cached rows train in FP32 in their slots,
       uncached rows in their stored precision; the cached rows become dirty

``forward`` runs these as the three steps of ``tetrarec.kernels.LocalLookup``, the
protocol the fused collection answers too, for callers that split them (replicas of a
data-parallel table prepare the global batch and pool their own samples,
``sharding/data_parallel.py``): ``prepare`` (1-2: ``PreparedIds`` holding the batch and
its ``CacheRoute``; in forward, with ``admit`` for a training batch), ``pooled_lookup``
(3) and ``apply_gradients`` (4, in backward, with the forward's ``PreparedIds``). Column
blocks of a row-wise optimizer also read ``row_gradient_shares`` and write
``add_to_row_state_`` (``sharding/block_group.py``). The steps' code lives beside this
module by concept: routing in ``route.py``, the policy step's row movement in
``maintenance.py``, the backward in ``gradients.py``, counters in ``stats.py``, the
state dict and optimizer state in ``checkpoint.py``.

On a GPU (``device=``, issue 11) the slots live in device memory and everything else on
the host: the batch's ids come to the host once, the policy and routing run there, the
cache part's ids go back once; admissions and write-backs move their rows through host
staging buffers (``movement.StagedRows``, bitwise the CPU cache's stored rows); the host
parts' pooled rows and gradients cross once each, and not at all when every id of the
batch is cached. ``force_staged_copies=True`` runs that path on the CPU (the tests).

Host syncs: the policy step decides on the host (``torch.unique``, counts, the bounds
check). On a device that costs one sync for the batch's ids (their copy to the host)
and one per table's write-back (the copy of its victims), besides the portable
kernels' own (``tbe_forward`` hands its bounds result to the host).

Optimizer state follows the row: the slot's state is live while the row is cached, the
backing state otherwise. A row is in exactly one part during a batch, so each row gets
exactly one update per step. Deterministic: the policy's ties are broken by row id, the
kernels are deterministic, and write-back rounding is a function of ``(seed,
iteration, row, column)``.

Checkpoints: ``state_dict()`` and ``fused_optimizer.state_dict()`` first ``flush()``:
dirty cached rows are written back (rounded copies) and cached state copied back, so
``weights.<table>`` is the complete table in its stored precision, in exactly the
layout ``FusedEmbeddingBagCollection`` saves. Flushing does not change training (the
FP32 rows stay cached and dirty). The state dict also holds ``cache.<table>.*`` (slot
map, FP32 cached rows, policy state, counters), so a resumed run equals an
uninterrupted one bitwise; without them the caches start empty (``static``: re-pinned).
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tetrarec.cache.checkpoint import (
    check_optimizer_state,
    load_optimizer_state,
    load_state,
    optimizer_state,
    save_state,
)
from tetrarec.cache.config import CacheSpec
from tetrarec.cache.gradients import (
    add_to_row_state,
    apply_part_gradients,
    part_row_gradient_shares,
)
from tetrarec.cache.maintenance import admit, evict, fill, flush, pin_static, write_back
from tetrarec.cache.movement import InPlaceRows, RowMover, StagedRows
from tetrarec.cache.parts import (
    CACHE,
    Part,
    build_parts,
    resolve_capacities,
    resolve_placements,
)
from tetrarec.cache.policy import CachePolicy
from tetrarec.cache.route import CacheRoute, route_batch
from tetrarec.cache.slot_map import SlotMap
from tetrarec.cache.stats import CacheMemory, CacheStats, cache_memory, cache_stats
from tetrarec.embedding import (
    SparseOptimizerSpec,
    TableConfig,
    TableSlice,
    draw_seed,
    feature_order,
)
from tetrarec.embedding.report import whole_tables_layout
from tetrarec.kernels import FusedEmbeddingBagCollection, FusedOptimizer, LocalLookup, PreparedIds
from tetrarec.kernels.quant import decode_rows
from tetrarec.sparse import PooledEmbeddings, SparseFeatures, permute_keys
from tetrarec.types import Placement, PoolingMode, Precision

__all__ = ["CacheRoute", "CachedEmbeddingBagCollection"]


class _CachedLookup(torch.autograd.Function):
    """Forward: every part's pooled lookup, summed. Backward: every part's fused update."""

    @staticmethod
    def forward(
        ctx: Any,
        module: CachedEmbeddingBagCollection,
        prepared: PreparedIds[CacheRoute],
        psw: torch.Tensor | None,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.module, ctx.prepared = module, prepared
        return module.pooled_lookup(prepared)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        prepared: PreparedIds[CacheRoute] = ctx.prepared
        want_psw = prepared.features.weights is not None and ctx.needs_input_grad[2]
        psw_grad = ctx.module.apply_gradients(grad_out, prepared, want_psw=want_psw)
        return None, None, psw_grad, None


class CachedEmbeddingBagCollection(nn.Module):
    """Embedding bags whose hot rows are cached and trained in FP32 (module docstring).

    Args:
        tables: the tables; ``precision`` is the backing store's.
        optimizer: the fused rule, applied to cached rows in FP32 and to the others in
            their stored precision.
        cache: policy, size and SSD directory.
        placements: ``{table name: placement}`` (``host``, ``cached`` or ``ssd``; and
            ``device`` when ``device`` is not the CPU: uncached rows in device memory);
            tables not named are ``cached``. ``host`` tables are uncached, in host
            memory, on any ``device``.
        static_counts: ``{table name: (rows,) counts}`` from a data sample
            (``count_ids``); required by the ``static`` policy for every cached table.
        check_bounds: raise ``ValueError`` for an id outside its table.
        deterministic: passed to the fused parts.
        stochastic_rounding: round updates and write-backs of low-precision rows
            stochastically.
        seed: initial rows and rounding streams, as in ``FusedEmbeddingBagCollection``.
        slices: for a shard, where each table sits in its global table (initial rows
            and rounding follow the global cells, as in ``FusedEmbeddingBagCollection``).
        fractions: ``{table name: fraction}``: slots of the named cached tables as a
            fraction of their rows, instead of ``cache``'s size (a plan's per-table
            choice).
        device: the run device (default CPU). The FP32 slots and their optimizer state
            (part "cache") are built there, and lookups return there; the backing rows,
            the slot maps and the policy stay in host memory (issue 11's device cache:
            ``docs/design/cache.md``, "On a GPU").
        force_staged_copies: move rows between slots and backing rows through host
            staging buffers, as a device cache must, even when ``device`` is the CPU
            (bitwise the same results as the in-place CPU path). For tests: it runs the
            device cache's code on a machine without a GPU. Not a run-config setting.

    Raises:
        ValueError: for an unknown placement or table name, ``device`` placement on the
            CPU, a ``meta`` device, or missing static counts.

    Example:
        >>> spec = SparseOptimizerSpec(kind="sgd", lr=0.1)
        >>> table = TableConfig(name="t", num_embeddings=10, dim=4, precision="int8")
        >>> ebc = CachedEmbeddingBagCollection([table], spec, CacheSpec(fraction=0.2))
        >>> ebc(SparseFeatures.from_lists({"t": [[1, 2], [3]]})).values.shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: SparseOptimizerSpec,
        cache: CacheSpec,
        *,
        placements: Mapping[str, Placement | str] | None = None,
        static_counts: Mapping[str, torch.Tensor] | None = None,
        check_bounds: bool = True,
        deterministic: bool = True,
        stochastic_rounding: bool = True,
        seed: int | None = None,
        slices: Sequence[TableSlice] | None = None,
        fractions: Mapping[str, float] | None = None,
        device: torch.device | str | None = None,
        force_staged_copies: bool = False,
    ) -> None:
        super().__init__()
        self.tables = tuple(tables)
        self.slices = (
            tuple(slices) if slices is not None else tuple(TableSlice(table=t) for t in self.tables)
        )
        if len(self.slices) != len(self.tables):
            raise ValueError(f"{len(self.slices)} slices for {len(self.tables)} tables")
        self.feature_names = feature_order(self.tables)
        self.feature_dims = tuple(t.dim for t in self.tables for _ in t.feature_names)
        self.optimizer_spec = optimizer
        self.cache_spec = cache
        self.check_bounds = check_bounds
        self.seed = draw_seed() if seed is None else seed
        #: The run device: the FP32 slots (part "cache") and the output live there.
        self.device = torch.device("cpu") if device is None else torch.device(device)
        if self.device.type == "meta":
            raise ValueError("device: a cached collection holds rows; 'meta' is not a device")
        self.placements = resolve_placements(self.tables, placements or {}, self.device)
        capacity = resolve_capacities(
            self.tables, self.placements, cache, optimizer, fractions or {}
        )
        self._caches = {
            i: SlotMap(capacity[t.name], t.num_embeddings, cache.policy)
            for i, t in enumerate(self.tables)
            if t.name in capacity
        }
        self._means = tuple(t.pooling is PoolingMode.MEAN for t in self.tables)
        self._anchor = torch.empty(0, requires_grad=True)
        #: Pages of SSD tables asked for ahead of their reads (``files.prefetch_rows``).
        self.prefetched_pages = 0
        fused = {
            "check_bounds": check_bounds,
            "deterministic": deterministic,
            "stochastic_rounding": stochastic_rounding,
            "seed": self.seed,
        }
        staged = force_staged_copies or self.device.type != "cpu"
        self._mover: RowMover = StagedRows(self.device) if staged else InPlaceRows()
        layout = build_parts(
            self.tables,
            self.slices,
            self.placements,
            {i: c.capacity for i, c in self._caches.items()},
            optimizer,
            cache.directory,
            fused,
            self.device,
        )
        self._parts: list[Part] = layout.parts
        self._home = layout.home  # table -> (backing part, local index)
        self._slot_home = layout.slot_home  # table -> local index in the cache part
        self._ssd_dir = layout.ssd_dir
        if self._ssd_dir is not None:
            # scratch space, deleted with this module (a checkpoint holds the rows)
            weakref.finalize(self, shutil.rmtree, self._ssd_dir, True)
        #: The ``torch.optim`` surface; every part reads its hyperparameters.
        self.fused_optimizer = FusedOptimizer(optimizer, self)
        if cache.policy is CachePolicy.STATIC:
            pin_static(self, static_counts)

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The ``torch.optim``-surface object every part's fused backward reads.

        A sharded collection sets its own, shared by all of its local modules.
        """
        return self._fused_optimizer

    @fused_optimizer.setter
    def fused_optimizer(self, optimizer: FusedOptimizer) -> None:
        self._fused_optimizer = optimizer
        for part in getattr(self, "_parts", ()):
            part.module.fused_optimizer = optimizer

    # -- views ----------------------------------------------------------------------------

    def _backing(self, i: int) -> tuple[FusedEmbeddingBagCollection, int]:
        p, k = self._home[i]
        return self._parts[p].module, k

    def _slots(self) -> FusedEmbeddingBagCollection:
        assert self._parts[0].kind == CACHE  # only called for tables with slots
        return self._parts[0].module

    @property
    def iteration(self) -> int:
        """Backward passes so far (the stochastic-rounding stream position)."""
        return self._parts[0].module.iteration

    def ssd_files(self) -> tuple[Path, ...]:
        """The memory-mapped files of the ``ssd`` tables (rows, then state), sorted."""
        if self._ssd_dir is None:
            return ()
        return tuple(sorted(self._ssd_dir.iterdir()))

    # -- cache maintenance (maintenance.py; one method per step the benchmark times) -------

    def _fill(self, i: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        fill(self, i, rows, slots)

    def _write_back(self, i: int, slots: torch.Tensor) -> None:
        write_back(self, i, slots)

    def _evict(self, i: int, victims: torch.Tensor) -> None:
        evict(self, i, victims)

    def _admit(self, i: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return admit(self, i, ids)

    def flush(self) -> None:
        """Write every dirty cached row back (rounded copy) and copy cached state back.

        The cache is unchanged (rows stay cached, FP32 and dirty), so training goes on
        exactly as without the flush; afterwards the backing stores hold the complete
        tables (what ``state_dict`` saves).
        """
        flush(self)

    # -- the local-lookup protocol (tetrarec.kernels.LocalLookup), in its call order -----

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """Pool every feature; output columns follow ``self.feature_names``.

        In a training forward (``training`` and grad enabled) the caches admit and
        evict first; otherwise they are only read.

        Raises:
            ValueError: for an out-of-range id (when ``check_bounds``), or per-id
                weights on a mean-pooled collection.
        """
        if features.keys != self.feature_names:
            features = permute_keys(features, self.feature_names)
        prepared = self.prepare(features, admit=self.training and torch.is_grad_enabled())
        out = _CachedLookup.apply(  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
            self, prepared, features.weights, self._anchor
        )
        return PooledEmbeddings(self.feature_names, self.feature_dims, out)

    def prepare(self, features: SparseFeatures, *, admit: bool) -> PreparedIds[CacheRoute]:
        """Route a batch over the parts: each id to its slot (hit) or its backing row.

        The first step of every lookup, for ``forward`` and for callers that pool and
        update in separate steps (data-parallel replicas run the policy step on the
        global batch in forward, then pool their own samples through the same slots)::

            every = ebc.prepare(global_batch, admit=True)   # policy step, whole batch
            mine = ebc.prepare(own, admit=False)            # read-only: the same slots
            pooled = ebc.pooled_lookup(mine)
            ...                                             # backward:
            ebc.apply_gradients(grad_of_global_batch, every)

        Args:
            features: the batch, keys in ``feature_names`` order.
            admit: run the policy step first (a training batch): count hits and misses,
                evict and write back, admit misses. ``False`` only reads the slot maps.

        Returns:
            The batch and its ``CacheRoute``, for ``pooled_lookup`` and ``apply_gradients``.

        Syncs:
            Once per cached table with ``admit`` (the policy decides on the host), and
            for the value counts of ``features`` if it does not carry them.

        Raises:
            ValueError: for keys in another order than ``feature_names``, per-id weights
                with mean pooling, or an out-of-range id (when ``check_bounds``).
        """
        if features.keys != self.feature_names:
            raise ValueError(
                f"prepare: features {features.keys} must be keyed {self.feature_names} "
                "(permute_keys first)"
            )
        if features.weights is not None and any(self._means):
            raise ValueError("per-id weights are supported with sum pooling only")
        return PreparedIds(features=features, route=self._route(features, admit=admit))

    def _route(self, features: SparseFeatures, *, admit: bool) -> CacheRoute:
        return route_batch(self, features, admit=admit)

    def pooled_lookup(self, prepared: PreparedIds[CacheRoute]) -> torch.Tensor:
        """The pooled rows of a prepared batch: the forward, without autograd.

        Args:
            prepared: the batch and its route (``prepare``).

        Returns:
            ``(B, sum D)`` pooled rows, columns in ``feature_names`` order.
        """
        route, psw = prepared.route, prepared.features.weights
        out = torch.zeros(route.batch, sum(self.feature_dims), device=self.device)  # (B, sum D)
        # Backing parts first, then the cache: an all-cached (or all-uncached) bag is
        # 0 + its one part's sum, exactly what the uncached collection computes. A part
        # with no id in this batch adds only zeros: skipped (on a device cache, a batch
        # that hits or admits every id never touches the host parts).
        for p in sorted(range(len(self._parts)), key=lambda p: self._parts[p].kind == CACHE):
            part = self._parts[p]
            if not route.values[p].numel():
                continue
            w = route.part_weights(psw, p, part.device)
            pooled = part.module.pool_ids(route.values[p], route.lengths[p], w)
            # a host part's pooled rows go to the device in one copy
            out.index_add_(1, part.columns, pooled.to(self.device, non_blocking=True))
        if route.divisor is not None:
            out.div_(route.divisor)  # the kernel's mean: the sum divided by the length
        return out

    def apply_gradients(
        self,
        grad_out: torch.Tensor,
        prepared: PreparedIds[CacheRoute],
        *,
        want_psw: bool = False,
    ) -> torch.Tensor | None:
        """Every part's fused update for the gradient ``grad_out`` of a prepared batch.

        Args:
            grad_out: ``(B, sum D)`` gradient of the batch's pooled rows.
            prepared: the batch as it was prepared for its lookup; with ``admit=True``
                for a training batch, so that its admitted slots are checked and marked
                dirty (``gradients.apply_part_gradients``).
            want_psw: also return the gradient of the batch's per-id weights.

        Returns:
            ``(N,)`` gradient of the per-id weights when ``want_psw``, else ``None``.

        Raises:
            RuntimeError: if a later training forward moved rows this batch used in or
                out of the cache (run each backward before the next training forward).
        """
        return apply_part_gradients(
            self, grad_out, prepared.route, prepared.features.weights, want_psw
        )

    def row_gradient_shares(
        self,
        table: int,
        grad_out: torch.Tensor,
        prepared: PreparedIds[CacheRoute],
        weight_decay: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per touched row of table ``table``: ``sum_d g'_d^2`` the next update would use.

        ``FusedEmbeddingBagCollection.row_gradient_shares`` for a routed batch: each part
        reports the rows it holds (a cached row from its FP32 slot, ``w`` in
        ``g' = g + weight_decay * w`` being the slot's row), bitwise the sum its own
        row-wise update of the row adds. Column blocks of a row-wise optimizer share
        these (``sharding/block_group.py``).

        Args:
            table: the table's index in ``tables``.
            grad_out: ``(B, sum D)`` gradient of the batch's pooled rows.
            prepared: the batch and its route (the slot map the update will use).
            weight_decay: the optimizer's weight decay (``0.0``: none).

        Returns:
            ``(rows (U,) int64 ascending and unique; share (U,) FP32)``.
        """
        return part_row_gradient_shares(
            self, table, grad_out, prepared.route, prepared.features.weights, weight_decay
        )

    def add_to_row_state_(
        self, table: int, key: str, rows: torch.Tensor, delta: torch.Tensor
    ) -> None:
        """Add ``delta[j]`` to the per-row optimizer state ``key`` of row ``rows[j]``.

        Where the row's state lives now: its slot while it is cached, else the backing
        store (the state a write-back or flush copies back).

        Args:
            table: the table's index in ``tables``.
            key: a per-row state (``sum`` of row-wise Adagrad, ``exp_avg_sq`` of
                row-wise Adam).
            rows: ``(n,)`` distinct rows of the table.
            delta: ``(n,)`` FP32 amounts.

        Raises:
            ValueError: for a state that is not per row.
        """
        add_to_row_state(self, table, key, rows, delta)

    # -- what the trainer reads (tetrarec.embedding.HeldTables) ---------------------------

    def shard_layout(self) -> list[dict[str, Any]]:
        """Every table, whole (``tetrarec.embedding.report.whole_tables_layout``)."""
        return whole_tables_layout(self.tables)

    def cache_stats(self) -> dict[str, CacheStats]:
        """``{table: CacheStats}`` for every cached table (``CacheStats.total`` sums them)."""
        return cache_stats(self)

    def counted_cache_stats(self) -> dict[str, CacheStats]:
        """``cache_stats``: one process counts every lookup once."""
        return cache_stats(self)

    def cached_rows(self) -> dict[str, torch.Tensor]:
        """``{table: rows its cache holds, ascending}`` for every cached table.

        Under the ``static`` policy, the pinned rows.
        """
        return {
            self.tables[i].name: torch.sort(c.rows_in(c.occupied())).values
            for i, c in self._caches.items()
        }

    def memory(self) -> CacheMemory:
        """Bytes by tier (rows in their stored precision, FP32 state, metadata)."""
        return cache_memory(self)

    def table_weights(self) -> dict[str, torch.Tensor]:
        """``{table: (rows, dim) FP32}``: the backing rows, cached rows from the cache.

        On the host (cached rows copied from the device), but for ``device`` tables,
        whose rows stay on the device. Copies: writing to one changes nothing.
        """
        out = {}
        for i, t in enumerate(self.tables):
            backing, k = self._backing(i)
            w = decode_rows(backing._table_rows(k), t.precision, t.dim)
            if t.precision is Precision.FP32:  # decoded FP32 rows are the store itself
                w = w.clone()
            c = self._caches.get(i)
            if c is not None and c.capacity:
                slots = c.occupied()
                rows = self._slots()._table_rows(self._slot_home[i])
                w[c.rows_in(slots)] = rows[slots.to(rows.device)].to(w.device)
            out[t.name] = w
        return out

    # -- the fused optimizer's state (FusedState; checkpoint.py) -----------------------------

    def storages(self) -> list[torch.Tensor]:
        """The flat row storages of every part (cache slots and backing stores)."""
        return [w for part in self._parts for w in part.module.storages()]

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{table: {name: (rows, ...) FP32}}``: complete (cached state copied back first)."""
        return optimizer_state(self)

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy ``state`` (``optimizer_state``'s form) into backing stores and slots, bitwise.

        Raises:
            ValueError: for missing or unexpected tables or names, or another shape;
                raised before anything is copied.
        """
        load_optimizer_state(self, state)

    def check_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Check that ``state`` fits this module, copying nothing.

        Raises:
            ValueError: as ``load_optimizer_state``.
        """
        check_optimizer_state(self, state)

    def _backing_modules(self) -> list[FusedEmbeddingBagCollection]:
        return [p.module for p in self._parts if p.kind != CACHE]

    # -- state dict (checkpoint.py) ------------------------------------------------------

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        save_state(self, destination, prefix)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        load_state(self, state_dict, prefix, missing_keys, unexpected_keys, error_msgs)


if TYPE_CHECKING:  # mypy checks that the collection answers the protocol
    _answers: type[LocalLookup[CacheRoute]] = CachedEmbeddingBagCollection
