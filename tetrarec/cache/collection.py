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

``forward`` runs these as three public steps, for callers that split them (replicas of
a data-parallel table route the global batch and pool their own samples,
``sharding/data_parallel.py``): ``route`` (1-2, a ``CacheRoute``), ``pooled_lookup``
(3) and ``apply_gradients`` (4). Column blocks of a row-wise optimizer also read
``row_gradient_shares`` and write ``add_to_row_state_`` (``sharding/block_group.py``).

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
from typing import Any

import torch
from torch import nn

from tetrarec.cache.checkpoint import load_state, save_state
from tetrarec.cache.config import CacheSpec
from tetrarec.cache.files import prefetch_rows
from tetrarec.cache.movement import InPlaceRows, RowMover, StagedRows, TableRows
from tetrarec.cache.parts import (
    CACHE,
    DEV,
    HOME_KIND,
    RAM,
    SSD,
    Part,
    build_parts,
    resolve_capacities,
    resolve_placements,
)
from tetrarec.cache.policy import CachePolicy, hot_rows
from tetrarec.cache.route import CacheRoute, bag_divisor, check_table_ids, split_over_parts
from tetrarec.cache.slot_map import SlotMap, unique_rows
from tetrarec.cache.stats import CacheMemory, CacheStats
from tetrarec.embedding import (
    SparseOptimizerSpec,
    TableConfig,
    TableSlice,
    draw_seed,
    feature_order,
)
from tetrarec.kernels import FusedEmbeddingBagCollection, FusedOptimizer
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
        route: CacheRoute,
        psw: torch.Tensor | None,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.module, ctx.route = module, route
        ctx.save_for_backward(psw)
        return module.pooled_lookup(route, psw)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (psw,) = ctx.saved_tensors
        want_psw = psw is not None and ctx.needs_input_grad[2]
        psw_grad = ctx.module.apply_gradients(grad_out, ctx.route, psw, want_psw=want_psw)
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
            self._pin_static(static_counts)

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

    # -- construction ---------------------------------------------------------------------

    def _pin_static(self, counts: Mapping[str, torch.Tensor] | None) -> None:
        for i, c in self._caches.items():
            name = self.tables[i].name
            if counts is None or name not in counts:
                raise ValueError(
                    f"cache policy 'static' needs static_counts for table {name!r} "
                    "(count_ids over a data sample)"
                )
            if c.capacity:
                rows = hot_rows(counts[name].long(), c.capacity)
                self._fill(i, rows, torch.arange(rows.numel()))

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

    # -- cache maintenance ----------------------------------------------------------------

    def _slot_rows(self, i: int) -> TableRows:
        """Table ``i``'s FP32 slots and their state (part "cache")."""
        cache, k = self._slots(), self._slot_home[i]
        return TableRows(cache._table_rows(k), cache._table_state(k), Precision.FP32)

    def _backing_rows(self, i: int) -> TableRows:
        """Table ``i``'s backing rows and their state."""
        backing, k = self._backing(i)
        return TableRows(backing._table_rows(k), backing._table_state(k), self.tables[i].precision)

    @torch.no_grad()
    def _fill(self, i: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Admit ``rows`` into ``slots`` (free): decode rows, copy their state."""
        rows, slots = rows.long().contiguous(), slots.long().contiguous()
        self._mover.load(self._backing_rows(i), rows, self._slot_rows(i), slots)
        self._caches[i].filled(rows, slots)

    @torch.no_grad()
    def _write_back(self, i: int, slots: torch.Tensor) -> None:
        """Store the FP32 rows of ``slots`` into the backing store; copy their state."""
        t, c = self.tables[i], self._caches[i]
        slots = slots.long().contiguous()
        rows = c.slot_rows.index_select(0, slots)
        backing, k = self._backing(i)
        # The draws the kernel would make for these rows at this iteration (the kernel
        # itself never updates them at this iteration: they are idle).
        sl = backing.slices[k]
        stochastic = backing.stochastic_rounding and t.precision is not Precision.FP32
        flags = [int(stochastic), backing.seed, backing.iteration, sl.row_key(), sl.col_start]
        self._mover.store(self._slot_rows(i), slots, self._backing_rows(i), rows, flags)

    def _evict(self, i: int, victims: torch.Tensor) -> None:
        c = self._caches[i]
        dirty = c.dirty_among(victims)
        if dirty.numel():
            self._write_back(i, dirty)
        c.evicted(victims, dirty.numel())

    def _admit(self, i: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch's policy step for table ``i``; its unique rows and slots."""
        c = self._caches[i]
        fits = self.check_bounds and self.tables[i].num_embeddings <= 2**31
        uniq, counts = unique_rows(ids, fits_int32=fits)
        slots, plan = c.plan_batch(ids, uniq, counts)
        if self.placements[i] is Placement.SSD:
            # every backing row this step reads or writes: the misses (admitted ones are
            # read now, the others by the kernels) and the dirty victims' rows
            dirty = c.dirty_among(plan.victims)
            misses = uniq.masked_select(slots < 0)
            self._prefetch(i, torch.cat([misses, c.slot_rows[dirty]]))
        if plan.victims.numel():
            self._evict(i, plan.victims)
        if plan.rows.numel():
            self._fill(i, plan.rows, plan.slots)
            slots = c.slots_of(uniq)
        c.used(slots)
        return uniq, slots

    def _prefetch(self, i: int, rows: torch.Tensor) -> None:
        """Start reading ``rows``' pages of an SSD table (weights and state) at once."""
        backing, k = self._backing(i)
        pages = prefetch_rows(backing._table_rows(k), rows)
        for state in backing._table_state(k).values():
            pages += prefetch_rows(state, rows)
        self.prefetched_pages += pages

    def flush(self) -> None:
        """Write every dirty cached row back (rounded copy) and copy cached state back.

        The cache is unchanged (rows stay cached, FP32 and dirty), so training goes on
        exactly as without the flush; afterwards the backing stores hold the complete
        tables (what ``state_dict`` saves).
        """
        for i, c in self._caches.items():
            occupied = c.occupied()
            dirty = occupied[c.dirty[occupied]]
            if dirty.numel():
                self._write_back(i, dirty)  # also copies the state of these slots
            clean = occupied[~c.dirty[occupied]]
            if clean.numel():
                self._copy_state_back(i, clean)

    @torch.no_grad()
    def _copy_state_back(self, i: int, slots: torch.Tensor) -> None:
        rows = self._caches[i].slot_rows[slots]
        self._mover.copy_state_back(self._slot_rows(i), slots, self._backing_rows(i), rows)

    @torch.no_grad()
    def _refresh_cached_state(self) -> None:
        """Copy the backing state of every cached row into its slot (after a load)."""
        for i, c in self._caches.items():
            slots = c.occupied()
            if not slots.numel():
                continue
            rows = c.slot_rows[slots]
            self._mover.refresh_state(self._backing_rows(i), rows, self._slot_rows(i), slots)

    # -- the embedding-module protocol ----------------------------------------------------

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
        route = self.route(features, admit=self.training and torch.is_grad_enabled())
        out = _CachedLookup.apply(  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
            self, route, features.weights, self._anchor
        )
        return PooledEmbeddings(self.feature_names, self.feature_dims, out)

    def route(self, features: SparseFeatures, *, admit: bool) -> CacheRoute:
        """Split a batch over the parts: each id to its slot (hit) or its backing row.

        The first stage of every lookup, for ``forward`` and for callers that pool and
        update in separate steps (data-parallel replicas run the policy step on the
        global batch, then route their own samples through the same slot map)::

            route = ebc.route(every, admit=True)   # policy step on the whole batch
            mine = ebc.route(own, admit=False)     # read-only: the same slots
            pooled = ebc.pooled_lookup(mine, own.weights)
            ...
            ebc.apply_gradients(grad_every, route, every.weights)

        Args:
            features: the batch, keys in ``feature_names`` order.
            admit: run the policy step first (a training batch): count hits and misses,
                evict and write back, admit misses. ``False`` only reads the slot maps.

        Returns:
            The ``CacheRoute`` for ``pooled_lookup`` and ``apply_gradients``.

        Syncs:
            Once per cached table with ``admit`` (the policy decides on the host), and
            for the value counts of ``features`` if it does not carry them.

        Raises:
            ValueError: for keys in another order than ``feature_names``, per-id weights
                with mean pooling, or an out-of-range id (when ``check_bounds``).
        """
        if features.keys != self.feature_names:
            raise ValueError(
                f"route: features {features.keys} must be keyed {self.feature_names} "
                "(permute_keys first)"
            )
        if features.weights is not None and any(self._means):
            raise ValueError("per-id weights are supported with sum pooling only")
        return self._route(features, admit=admit)

    def _route(self, features: SparseFeatures, *, admit: bool) -> CacheRoute:
        # The policy and the routing run on the host: the batch's ids and lengths come
        # over once (no copy on the CPU), the parts' ids go back once per device part.
        batch, lengths = features.batch_size, features.lengths.cpu().long()
        local = features.values.cpu().long().clone()  # (N,) becomes slot or row per id
        dest = torch.full_like(local, RAM, dtype=torch.int8)
        starts = [0]
        for n in features.value_counts_host():
            starts.append(starts[-1] + n)
        touched = []
        f = 0
        for i, t in enumerate(self.tables):
            f0, f = f, f + len(t.feature_names)
            seg = slice(starts[f0], starts[f])
            home = HOME_KIND[self.placements[i]]
            dest[seg] = home
            if i not in self._caches:
                continue
            ids = local[seg]
            if self.check_bounds:
                check_table_ids(t, ids, range(f0, f), starts, self.feature_names)
            if admit:
                rows, slots = self._admit(i, ids)
                touched.append((i, rows, slots.to(torch.int32)))
            slot = self._caches[i].row_slot[ids].long()
            hit = slot >= 0
            dest[seg] = torch.where(hit, CACHE, home).to(torch.int8)
            local[seg] = torch.where(hit, slot, ids)
        nf = len(self.feature_names)
        values, part_lengths, masks = split_over_parts(self._parts, local, dest, lengths, nf, batch)
        divisor = bag_divisor(self.tables, self._means, lengths, batch)
        return CacheRoute(
            batch=batch,
            values=[v.to(part.device) for v, part in zip(values, self._parts)],
            lengths=[n.to(part.device) for n, part in zip(part_lengths, self._parts)],
            masks=masks,
            divisor=divisor.to(self.device) if divisor is not None else None,
            touched=touched,
        )

    def _part_weights(
        self, psw: torch.Tensor | None, route: CacheRoute, p: int
    ) -> torch.Tensor | None:
        """Part ``p``'s share of the per-id weights, on its device (``None``: unweighted)."""
        if psw is None:
            return None
        dev = self._parts[p].device
        return psw.to(dev)[route.masks[p].to(dev, non_blocking=True)]

    def pooled_lookup(self, route: CacheRoute, psw: torch.Tensor | None) -> torch.Tensor:
        """The pooled rows of a routed batch: the forward, without autograd.

        Args:
            route: the batch's ``CacheRoute`` (``route``).
            psw: ``(N,)`` per-id weights of that batch, or ``None``.

        Returns:
            ``(B, sum D)`` pooled rows, columns in ``feature_names`` order.
        """
        out = torch.zeros(route.batch, sum(self.feature_dims), device=self.device)  # (B, sum D)
        # Backing parts first, then the cache: an all-cached (or all-uncached) bag is
        # 0 + its one part's sum, exactly what the uncached collection computes. A part
        # with no id in this batch adds only zeros: skipped (on a device cache, a batch
        # that hits or admits every id never touches the host parts).
        for p in sorted(range(len(self._parts)), key=lambda p: self._parts[p].kind == CACHE):
            part = self._parts[p]
            if not route.values[p].numel():
                continue
            w = self._part_weights(psw, route, p)
            pooled = part.module.pooled_lookup(route.values[p], route.lengths[p], w)
            # a host part's pooled rows go to the device in one copy
            out.index_add_(1, part.columns, pooled.to(self.device, non_blocking=True))
        if route.divisor is not None:
            out.div_(route.divisor)  # the kernel's mean: the sum divided by the length
        return out

    def apply_gradients(
        self,
        grad_out: torch.Tensor,
        route: CacheRoute,
        psw: torch.Tensor | None,
        *,
        want_psw: bool = False,
    ) -> torch.Tensor | None:
        """Every part's fused update for the gradient ``grad_out`` of a routed batch.

        Args:
            grad_out: ``(B, sum D)`` gradient of the batch's pooled rows.
            route: the route the batch took; built with ``admit=True`` for a training
                batch, so that its admitted slots are checked and marked dirty.
            psw: ``(N,)`` per-id weights of that batch, or ``None``.
            want_psw: also return the gradient of ``psw``.

        Returns:
            ``(N,)`` gradient of ``psw`` when ``want_psw``, else ``None``.

        Raises:
            RuntimeError: if a later training forward moved rows this batch used in or
                out of the cache (run each backward before the next training forward).
        """
        for i, rows, slots in route.touched:
            if not torch.equal(self._caches[i].row_slot[rows], slots):
                raise RuntimeError(
                    f"table {self.tables[i].name!r}: rows this batch used left or entered "
                    "the cache before its backward; run each training forward's backward "
                    "before the next training forward"
                )
        g = grad_out.contiguous()
        if route.divisor is not None:
            g = g / route.divisor  # the kernel's mean backward: gradient over the length
        psw_grad = torch.zeros_like(psw) if psw is not None and want_psw else None
        for p, part in enumerate(self._parts):
            if not route.values[p].numel():
                # nothing to update; the rounding stream still advances, as the
                # kernel's own call would advance it
                part.module.iteration += 1
                continue
            w = self._part_weights(psw, route, p)
            out = part.module.apply_gradients(
                g.index_select(1, part.columns).to(part.device), route.values[p],
                route.lengths[p], w, want_psw=psw_grad is not None,
            )  # fmt: skip
            if psw_grad is not None and out is not None:
                mask = route.masks[p].to(psw_grad.device, non_blocking=True)
                psw_grad[mask] = out.to(psw_grad.device)
        for i, _, slots in route.touched:
            self._caches[i].dirty[slots[slots >= 0].long()] = True
        return psw_grad

    def row_gradient_shares(
        self,
        table: int,
        grad_out: torch.Tensor,
        route: CacheRoute,
        psw: torch.Tensor | None,
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
            route: the batch's route (the slot map the update will use).
            psw: ``(N,)`` per-id weights, if any.
            weight_decay: the optimizer's weight decay (``0.0``: none).

        Returns:
            ``(rows (U,) int64 ascending and unique; share (U,) FP32)``.
        """
        g = grad_out.contiguous()
        if route.divisor is not None:
            g = g / route.divisor  # as apply_gradients divides it
        rows, shares = [], []
        for p, part in enumerate(self._parts):
            if part.kind == CACHE:
                if table not in self._slot_home:
                    continue
                k = self._slot_home[table]
            else:
                home, k = self._home[table]
                if home != p:
                    continue
            w = self._part_weights(psw, route, p)
            got, share = part.module.row_gradient_shares(
                k, g.index_select(1, part.columns).to(part.device), route.values[p],
                route.lengths[p], w, weight_decay,
            )  # fmt: skip
            got, share = got.cpu(), share.cpu()
            if part.kind == CACHE:
                got = self._caches[table].slot_rows[got]  # slots -> their rows
            rows.append(got)
            shares.append(share)
        every = torch.cat(rows)
        order = torch.argsort(every)  # a row is in one part: unique
        out = grad_out.device
        return every[order].to(out), torch.cat(shares)[order].to(out)

    @torch.no_grad()
    def add_to_row_state_(
        self, table: int, name: str, rows: torch.Tensor, delta: torch.Tensor
    ) -> None:
        """Add ``delta[j]`` to the per-row optimizer state ``name`` of row ``rows[j]``.

        Where the row's state lives now: its slot while it is cached, else the backing
        store (the state a write-back or flush copies back).

        Args:
            table: the table's index in ``tables``.
            name: a per-row state (``sum`` of row-wise Adagrad, ``exp_avg_sq`` of
                row-wise Adam).
            rows: ``(n,)`` distinct rows of the table.
            delta: ``(n,)`` FP32 amounts.

        Raises:
            ValueError: for a state that is not per row.
        """
        backing, k = self._backing(table)
        state = backing._table_state(k)
        if name not in state or state[name].shape[1] != 1:
            per_row = sorted(n for n, v in state.items() if v.shape[1] == 1)
            raise ValueError(f"{name!r} is not a per-row optimizer state; per-row: {per_row}")
        rows, delta = rows.cpu(), delta.cpu()  # the slot map is on the host
        c = self._caches.get(table)
        slots = c.row_slot[rows].long() if c is not None else torch.full_like(rows, -1)
        hit = slots >= 0
        if bool(hit.any()):
            cached = self._slots()._table_state(self._slot_home[table])[name]
            dev = cached.device
            cached[:, 0].index_add_(0, slots[hit].to(dev), delta[hit].to(dev))
        dev = state[name].device  # the host, but for a `device` table
        state[name][:, 0].index_add_(0, rows[~hit].to(dev), delta[~hit].to(dev))

    # -- what the trainer reads -------------------------------------------------------------

    def cache_stats(self) -> dict[str, CacheStats]:
        """``{table: CacheStats}`` for every cached table (``CacheStats.total`` sums them)."""
        out = {}
        for i, c in self._caches.items():
            _, hits, misses, evictions, write_backs = c.counters
            out[self.tables[i].name] = CacheStats(
                table=self.tables[i].name,
                capacity=c.capacity,
                occupied=int((c.slot_rows >= 0).sum()),
                hits=hits,
                misses=misses,
                evictions=evictions,
                write_backs=write_backs,
            )
        return out

    def cached_rows(self) -> dict[str, torch.Tensor]:
        """``{table: rows its cache holds, ascending}`` for every cached table.

        Under the ``static`` policy, the pinned rows.
        """
        return {
            self.tables[i].name: torch.sort(c.slot_rows[c.slot_rows >= 0]).values
            for i, c in self._caches.items()
        }

    def memory(self) -> CacheMemory:
        """Bytes by tier (rows in their stored precision, FP32 state, metadata)."""
        sizes = {CACHE: [0, 0], RAM: [0, 0], SSD: [0, 0], DEV: [0, 0]}
        for part in self._parts:
            m = part.module
            sizes[part.kind][0] += sum(w.numel() * w.element_size() for w in m.storages())
            sizes[part.kind][1] += sum(
                s.numel() * 4 for st in range(len(m._stores)) for s in m._states(st)
            )
        return CacheMemory(
            backing_ram=sizes[RAM][0],
            backing_ssd=sizes[SSD][0],
            backing_state_ram=sizes[RAM][1],
            backing_state_ssd=sizes[SSD][1],
            cache_rows=sizes[CACHE][0],
            cache_state=sizes[CACHE][1],
            metadata=sum(c.metadata_bytes() for c in self._caches.values()),
            backing_device=sizes[DEV][0],
            backing_state_device=sizes[DEV][1],
            cache_device=self.device.type,
        )

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
                w[c.slot_rows[slots]] = rows[slots.to(rows.device)].to(w.device)
            out[t.name] = w
        return out

    # -- the fused optimizer's state (FusedState) -------------------------------------------

    def storages(self) -> list[torch.Tensor]:
        """The flat row storages of every part (cache slots and backing stores)."""
        return [w for part in self._parts for w in part.module.storages()]

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{table: {name: (rows, ...) FP32}}``: complete (cached state copied back first)."""
        for i, c in self._caches.items():
            slots = torch.nonzero(c.slot_rows >= 0).flatten()
            if slots.numel():
                self._copy_state_back(i, slots)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for part in self._parts:
            if part.kind != CACHE:
                out.update(part.module.optimizer_state())
        return {t.name: out[t.name] for t in self.tables}

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy ``state`` (``optimizer_state``'s form) into backing stores and slots, bitwise.

        Raises:
            ValueError: for missing or unexpected tables or names, or another shape;
                raised before anything is copied.
        """
        self.check_optimizer_state(state)
        for module in self._backing_modules():
            module.load_optimizer_state({t.name: state[t.name] for t in module.tables})
        self._refresh_cached_state()

    def check_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Check that ``state`` fits this module, copying nothing.

        Raises:
            ValueError: as ``load_optimizer_state``.
        """
        names = {t.name for t in self.tables}
        if set(state) != names:
            raise ValueError(
                f"optimizer state for tables {sorted(state)}, this module has {sorted(names)}"
            )
        for module in self._backing_modules():
            module.check_optimizer_state({t.name: state[t.name] for t in module.tables})

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
