"""``FusedEmbeddingBagCollection``: table-batched lookup with the optimizer fused in backward.

A drop-in for the reference ``EmbeddingBagCollection`` (same protocol, same initial
weights for the same seed)::

    SparseFeatures (F, B, L[f][b])  ->  PooledEmbeddings (B, D_0 + D_1 + ...)

The tables live in flat row stores (one per precision, see ``layout.py``). Forward is
one ``tetrarec::tbe_forward`` call per store; backward is one
``tetrarec::tbe_backward_update`` call per store, which sums the gradient of each touched
row and applies the optimizer to that row and its state in place. No gradient the size
of a table ever exists and the trainer builds no sparse optimizer
(``fused_optimizer = True``). So every backward through a forward is one optimizer
step: a loss built from two forwards takes two steps (for Adagrad or Adam not the one
step of their summed gradient), and so does a backward run twice (``retain_graph``) or
``torch.autograd.grad`` through the output. ``model.eval()`` does not stop it;
``torch.no_grad()`` (no backward) does.

The module's state dict holds the rows; its optimizer (``fused_optimizer``, a
``FusedOptimizer`` with the ``torch.optim`` surface) holds the optimizer state. Both are
independent of the flat storage::

    module.state_dict()
      weights.<table>       FP32/FP16/BF16 tables: (rows, dim) in the stored dtype;
                            INT8/INT4 tables: packed rows (rows, row_bytes) uint8
                            (codes, then FP16 scale and bias; see quant.py)
      rounding              (seed, iteration) of the stochastic-rounding stream
    fused_optimizer.state_dict()["state"]
      <table>: {<name>: ...} FP32; (rows, dim) for per-element state, (rows,) for
                            per-row state (row-wise sums, Adam's step count)

Loading is the exact inverse (bitwise). ``table_weights()`` gives dequantized FP32.
Both state dicts return views into the flat storage (no copy); clone them if the
consumer needs separate storages. Stochastic rounding draws from a counter-based stream
of ``(seed, iteration, global row, global column)``, so a resumed run, and any sharded
layout of the same tables (``TableSlice``), rounds the same.

The collection answers ``LocalLookup`` (``lookup.py``: ``prepare`` keeps the features as
they are, then ``pooled_lookup`` and ``apply_gradients``), so the sharding code runs it
as it runs a cached collection; ``pool_ids``, ``update_ids`` and
``row_gradient_shares_of_ids`` are the same steps on key-major ids (what the cached
collection's parts call).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tetrarec.embedding import (
    SparseOptimizerSpec,
    TableConfig,
    TableSlice,
    draw_seed,
    feature_order,
    init_rows,
)
from tetrarec.embedding.report import UncachedWholeTables
from tetrarec.kernels import ops, reference
from tetrarec.kernels.fused_optim import FusedOptimizer
from tetrarec.kernels.layout import plan_stores
from tetrarec.kernels.lookup import LocalLookup, PreparedIds
from tetrarec.kernels.memory import host_buffer
from tetrarec.kernels.optim_rules import state_layout
from tetrarec.kernels.quant import decode_rows, encode_rows, row_width
from tetrarec.sparse import PooledEmbeddings, SparseFeatures, permute_keys
from tetrarec.types import PoolingMode, Precision

__all__ = ["FusedEmbeddingBagCollection"]

logger = logging.getLogger(__name__)


class _FusedLookup(torch.autograd.Function):
    """Forward: pooled lookup. Backward: fused row updates; grads only for psw."""

    @staticmethod
    def forward(
        ctx: Any,
        module: FusedEmbeddingBagCollection,
        values: torch.Tensor,
        lengths: torch.Tensor,
        psw: torch.Tensor | None,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.module = module
        ctx.save_for_backward(values, lengths, psw)
        return module.pool_ids(values, lengths, psw)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        values, lengths, psw = ctx.saved_tensors
        want_psw = psw is not None and ctx.needs_input_grad[3]
        psw_grad = ctx.module.update_ids(grad_out, values, lengths, psw, want_psw=want_psw)
        return None, None, None, psw_grad if want_psw else None, None


def load_table_rows(
    state_dict: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Copy each ``state_dict[key]`` into ``expected[key]`` (a table's row view, in place).

    A key absent from ``state_dict`` goes to ``missing_keys``; a tensor of another shape or
    dtype to ``error_msgs`` (``nn.Module._load_from_state_dict``'s protocol).

    Packed rows do not record their precision: an INT8 table of dim 4 and an INT4 table
    of dim 8 both store ``(rows, 8)`` uint8, so such a pair passes this check. Load rows
    into the tables they were saved from (tetrarec's checkpoints record the config).
    """
    for key, dst in expected.items():
        if key not in state_dict:
            missing_keys.append(key)
            continue
        src = state_dict[key]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            error_msgs.append(
                f"{key}: expected {tuple(dst.shape)} {dst.dtype}, "
                f"got {tuple(src.shape)} {src.dtype}"
            )
            continue
        with torch.no_grad():
            dst.copy_(src)


def _keeping_dtype(fn: Any) -> Any:
    """``fn`` (a tensor conversion of ``nn.Module._apply``) without its change of dtype.

    ``fn`` is tried on an empty tensor first, so a cast never converts (or copies) a
    table to learn where it goes.
    """

    def apply(t: torch.Tensor) -> torch.Tensor:
        probe = torch.empty(0, dtype=t.dtype, device=t.device)
        moved = fn(probe)
        if moved is probe or moved.dtype == t.dtype:
            return fn(t)  # type: ignore[no-any-return]  # fn is torch's converter
        return t.to(moved.device)

    return apply


class FusedEmbeddingBagCollection(UncachedWholeTables, nn.Module):
    """Table-batched embedding bags whose backward applies the sparse optimizer.

    Args:
        tables: the tables; each feature looks up exactly one table. Each table's
            ``precision`` (FP32, FP16, BF16, INT8, INT4) sets how its rows are stored;
            rows are always computed in FP32.
        optimizer: the rule applied in backward (SGD, Adagrad, row-wise Adagrad, Adam,
            row-wise Adam) with its starting hyperparameters. Optimizer state is FP32.
            ``fused_optimizer`` exposes it with the ``torch.optim`` surface: set its
            ``param_groups[0]["lr"]`` (or drive it with an LR scheduler) to change the
            next update.
        check_bounds: raise ``ValueError`` naming the feature, id and table size for an
            id outside its table (default). ``False`` skips the check for speed; an
            out-of-range id is then undefined behaviour (never clamped or zeroed): the
            backward refuses it before updating its row store, but the stores of other
            precisions (one per precision) may already have been updated.
        deterministic: bitwise-identical results across runs and thread counts. The
            compiled CPU kernel always sums duplicates in a fixed order (it costs
            nothing there); this switch selects between a stable sort and
            ``torch.unique`` in the portable path.
        stochastic_rounding: round updated FP16/BF16/INT8/INT4 rows stochastically
            (unbiased); ``False`` rounds to nearest.
        seed: seeds the initial weights (``init_rows``: the same rows as
            ``EmbeddingBagCollection(tables, seed=seed)``) and the stochastic rounding
            streams; ``None`` draws one from the global torch RNG.
        device: where the rows live (default CPU). ``.to(device)`` moves them; dtype
            casts of the module (``.half()``, ``.to(torch.float64)``) leave the rows at
            ``precision`` and the optimizer state in FP32.
        slices: for a shard, where each table sits in its global table (default: each
            table is a whole table). Initial rows and rounding follow the global cells.

    Raises:
        ValueError: for an unsupported precision or duplicate names.

    Example:
        >>> spec = SparseOptimizerSpec(kind=OptimizerKind.SGD, lr=0.1)
        >>> table = TableConfig(name="t", num_embeddings=10, dim=4)
        >>> ebc = FusedEmbeddingBagCollection([table], spec)
        >>> ebc(SparseFeatures.from_lists({"t": [[1, 2], [3]]})).values.shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: SparseOptimizerSpec,
        *,
        check_bounds: bool = True,
        deterministic: bool = True,
        stochastic_rounding: bool = True,
        seed: int | None = None,
        device: torch.device | str | None = None,
        slices: Sequence[TableSlice] | None = None,
    ) -> None:
        super().__init__()
        self.tables = tuple(tables)
        self.feature_names = feature_order(self.tables)
        self.feature_dims = tuple(t.dim for t in self.tables for _ in t.feature_names)
        self.slices = (
            tuple(slices) if slices is not None else tuple(TableSlice(table=t) for t in self.tables)
        )
        if len(self.slices) != len(self.tables):
            raise ValueError(f"{len(self.slices)} slices for {len(self.tables)} tables")
        self.optimizer_spec = optimizer
        self.check_bounds = check_bounds
        self.deterministic = deterministic
        self.stochastic_rounding = stochastic_rounding
        self.seed = draw_seed() if seed is None else seed
        self.iteration = 0
        self._has_mean = any(t.pooling is PoolingMode.MEAN for t in self.tables)
        self._stores = plan_stores(self.tables, optimizer.kind)
        self._where = {
            i: (s, k) for s, st in enumerate(self._stores) for k, i in enumerate(st.tables)
        }
        self._anchor = torch.empty(0, requires_grad=True)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        for s, store in enumerate(self._stores):
            w = host_buffer(store.numel, store.precision.torch_dtype, dev)
            self.register_buffer(f"_weights_{s}", w, persistent=False)
            for k, n in enumerate(store.state_numel):
                init = optimizer.initial_accumulator if store.state_names[k] == "sum" else 0.0
                st = host_buffer(n, torch.float32, dev, fill=init)
                self.register_buffer(f"_state_{s}_{k}", st, persistent=False)
        if dev.type != "meta":  # a meta module only describes the tables (to be sharded)
            self._init_weights()
        #: The optimizer object (``torch.optim`` surface) whose hyperparameters the
        #: backward reads. A sharded collection replaces it by its own, shared by all
        #: of its local modules.
        self.fused_optimizer: FusedOptimizer = FusedOptimizer(optimizer, self)

    def _apply(self, fn: Any, recurse: bool = True) -> FusedEmbeddingBagCollection:
        """``nn.Module``'s conversions, with every row store and state at its own dtype.

        Moves (``.to(device)``, ``.cpu()``, ``to_empty``, ``share_memory``) apply; casts
        (``.half()``, ``.double()``, ``.to(dtype)`` of a model holding this module) leave
        the rows at their configured precision and the optimizer state in FP32, which
        the kernels need, instead of converting them and failing at the next step.
        """
        moved: FusedEmbeddingBagCollection = super()._apply(  # type: ignore[no-untyped-call]  # torch leaves _apply unannotated
            _keeping_dtype(fn), recurse
        )
        return moved

    # -- layout helpers -----------------------------------------------------------------

    def _storage(self, s: int) -> torch.Tensor:
        weights = getattr(self, f"_weights_{s}")
        assert isinstance(weights, torch.Tensor)  # registered as a buffer in __init__
        return weights

    def _states(self, s: int) -> list[torch.Tensor]:
        return [getattr(self, f"_state_{s}_{k}") for k in range(len(self._stores[s].state_names))]

    def _table_rows(self, i: int) -> torch.Tensor:
        """``(rows, row_width)`` view of table ``i`` in its store."""
        s, k = self._where[i]
        t, store = self.tables[i], self._stores[s]
        width = row_width(t.precision, t.dim)
        start = store.w_offsets[k]
        return self._storage(s)[start : start + t.num_embeddings * width].view(-1, width)

    def _table_state(self, i: int) -> dict[str, torch.Tensor]:
        """``{name: (rows, width)}`` views of table ``i``'s optimizer state."""
        s, k = self._where[i]
        store, rows = self._stores[s], self.tables[i].num_embeddings
        out = {}
        for n, (name, flat) in enumerate(zip(store.state_names, self._states(s))):
            start = store.state_offsets[n][k]
            end = store.state_offsets[n][k + 1] if k + 1 < len(store.tables) else flat.numel()
            out[name] = flat[start:end].view(rows, -1)
        return out

    @torch.no_grad()
    def _init_weights(self, chunk_rows: int = 1 << 20) -> None:
        # The same rows as every other collection and layout with this seed (init_rows),
        # written chunk_rows at a time: each chunk is a temporary (chunk_rows, D) FP32
        # block (256 MB at 1M x 64), so a store on file asks for smaller chunks.
        step = chunk_rows
        for i, (t, sl) in enumerate(zip(self.tables, self.slices)):
            dst = self._table_rows(i)
            cols = (sl.col_start, sl.col_start + t.dim)
            for r in range(0, t.num_embeddings, step):
                stop = min(r + step, t.num_embeddings)
                chunk = init_rows(
                    sl.table, self.seed, sl.row_start + r, sl.row_start + stop, columns=cols
                )
                dst[r:stop] = encode_rows(chunk, t.precision, stochastic=False).to(dst.device)

    # -- the embedding-module protocol ----------------------------------------------------

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """Pool every feature; output columns follow ``self.feature_names``.

        Raises:
            ValueError: for an out-of-range id (when ``check_bounds``), or per-id
                weights on a mean-pooled collection.
        """
        if features.keys != self.feature_names:
            features = permute_keys(features, self.feature_names)
        sf = self.prepare(features, admit=False).features
        out = _FusedLookup.apply(  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
            self, sf.values, sf.lengths, sf.weights, self._anchor
        )
        return PooledEmbeddings(self.feature_names, self.feature_dims, out)

    # -- the local-lookup protocol (lookup.LocalLookup), in its call order ----------------

    def prepare(self, features: SparseFeatures, *, admit: bool) -> PreparedIds[None]:
        """The batch as it is: this module has no cache, so ``admit`` changes nothing.

        Raises:
            ValueError: for keys in another order than ``feature_names``, or per-id
                weights on a mean-pooled collection.
        """
        if features.keys != self.feature_names:
            raise ValueError(
                f"prepare: features {features.keys} must be keyed {self.feature_names} "
                "(permute_keys first)"
            )
        if features.weights is not None and self._has_mean:
            raise ValueError("per-id weights are supported with sum pooling only")
        return PreparedIds(features=features, route=None)

    def pooled_lookup(self, prepared: PreparedIds[None]) -> torch.Tensor:
        """``(B, sum D)`` pooled rows of a prepared batch (``pool_ids`` of its ids).

        Raises:
            ValueError: for an out-of-range id (when ``check_bounds``).
        """
        sf = prepared.features
        return self.pool_ids(sf.values, sf.lengths, sf.weights)

    def apply_gradients(
        self, grad_out: torch.Tensor, prepared: PreparedIds[None], *, want_psw: bool = False
    ) -> torch.Tensor | None:
        """The fused update of a prepared batch (``update_ids`` of its ids).

        Returns:
            ``(N,)`` gradient of the batch's per-id weights when ``want_psw``, else
            ``None``.
        """
        sf = prepared.features
        return self.update_ids(grad_out, sf.values, sf.lengths, sf.weights, want_psw=want_psw)

    def row_gradient_shares(
        self,
        table: int,
        grad_out: torch.Tensor,
        prepared: PreparedIds[None],
        weight_decay: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_gradient_shares_of_ids`` of a prepared batch's ids.

        Returns:
            ``(rows (U,) int64, sorted and unique; share (U,) FP32)``.
        """
        sf = prepared.features
        return self.row_gradient_shares_of_ids(
            table, grad_out, sf.values, sf.lengths, sf.weights, weight_decay
        )

    @torch.no_grad()
    def add_to_row_state_(
        self, table: int, key: str, rows: torch.Tensor, delta: torch.Tensor
    ) -> None:
        """Add ``delta[j]`` to the per-row optimizer state ``key`` of row ``rows[j]``.

        Args:
            table: the table's index in ``tables``.
            key: a per-row state (``sum`` of row-wise Adagrad, ``exp_avg_sq`` of
                row-wise Adam).
            rows: ``(n,)`` distinct rows of the table, on the rows' device.
            delta: ``(n,)`` FP32 amounts.

        Raises:
            ValueError: for a state that is not per row.
        """
        state = self._table_state(table)
        if key not in state or state[key].shape[1] != 1:
            per_row = sorted(n for n, v in state.items() if v.shape[1] == 1)
            raise ValueError(f"{key!r} is not a per-row optimizer state; per-row: {per_row}")
        state[key][:, 0].index_add_(0, rows, delta)

    # -- the same steps on key-major ids (the cached collection's parts call these) --------

    def pool_ids(
        self, values: torch.Tensor, lengths: torch.Tensor, psw: torch.Tensor | None
    ) -> torch.Tensor:
        """``(B, sum D)`` pooled rows of key-major ``values``/``lengths`` in feature order.

        The forward half of ``forward`` without autograd.

        Raises:
            ValueError: for an out-of-range id (when ``check_bounds``).
        """
        batch = lengths.numel() // len(self.feature_names)
        out = torch.empty(batch, sum(self.feature_dims), device=values.device)  # (B, sum D)
        for s, store in enumerate(self._stores):
            meta = self._meta(s)
            bad = ops.tbe_forward(
                self._storage(s), meta, values, lengths, psw, out,
                store.precision.value, self.check_bounds,
            )  # fmt: skip
            if self.check_bounds:
                self._raise_if_bad(bad)
        return out

    def _raise_if_bad(self, bad: torch.Tensor, note: str = "") -> None:
        f, bad_id = (int(x) for x in bad.tolist())
        if f < 0:
            return
        name = self.feature_names[f]
        table = next(t for t in self.tables if name in t.feature_names)
        raise ValueError(
            f"feature {name!r}: id {bad_id} is outside its table {table.name!r} of "
            f"{table.num_embeddings} rows (valid ids are 0..{table.num_embeddings - 1}){note}"
        )

    def _raise_named_bounds_error(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """Raise the forward's ``ValueError`` naming the feature, for an out-of-range id.

        Called after a failed backward, whose kernel message can only give the feature's
        index.
        """
        batch = lengths.numel() // len(self.feature_names)
        scratch = torch.empty(batch, sum(self.feature_dims), device=values.device)
        for s, store in enumerate(self._stores):
            bad = ops.tbe_forward(
                self._storage(s), self._meta(s), values, lengths, None, scratch,
                store.precision.value, True,
            )  # fmt: skip
            self._raise_if_bad(
                bad,
                note=" (found in backward: check_bounds is off; tables of other precisions "
                "may already have taken this step)"
                if len(self._stores) > 1
                else " (found in backward: check_bounds is off)",
            )

    def _meta(self, s: int) -> list[torch.Tensor]:
        return self._cached_meta(s)[0]

    def _cached_meta(self, s: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(meta, state offsets) tensors of store ``s`` on its device, built once."""
        cache: dict[tuple[int, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]]
        cache = self.__dict__.setdefault("_meta_cache", {})
        dev = self._storage(s).device
        if (s, dev) not in cache:
            store = self._stores[s]
            offs = [torch.tensor(x, dtype=torch.int64, device=dev) for x in store.state_offsets]
            cache[(s, dev)] = (store.meta(self.tables, self.slices, dev), offs)
        return cache[(s, dev)]

    def update_ids(
        self,
        grad_out: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        psw: torch.Tensor | None,
        *,
        want_psw: bool = False,
    ) -> torch.Tensor | None:
        """Update the rows of ``values`` with the gradient ``grad_out`` of their pooled bags.

        The backward half of ``forward``: sums each touched row's gradient (duplicates in
        position order) and applies ``fused_optimizer``'s rule in place.

        Args:
            grad_out: ``(B, sum D)`` gradient of the pooled output.
            values: the ids the output was pooled from (key-major).
            lengths: their bag lengths.
            psw: their per-id weights, if any.
            want_psw: also return the gradient of ``psw``.

        Returns:
            ``(N,)`` gradient of ``psw`` when ``want_psw``, else ``None``.
        """
        hparams = self.fused_optimizer.kernel_hparams()
        kind = self.optimizer_spec.kind
        flags = [
            int(self.stochastic_rounding), self.seed, self.iteration,
            int(self.deterministic), int(want_psw),
        ]  # fmt: skip
        psw_grad = None
        for s, store in enumerate(self._stores):
            meta, offs = self._cached_meta(s)
            try:
                g = ops.tbe_backward_update(
                    grad_out.contiguous(), self._storage(s), meta, values, lengths, psw,
                    self._states(s), offs,
                    kind.value, hparams, store.precision.value, flags,
                )  # fmt: skip
            except RuntimeError:
                self._raise_named_bounds_error(values, lengths)
                raise
            if want_psw:
                psw_grad = g if psw_grad is None else psw_grad + g
        self.iteration += 1
        return psw_grad

    def row_gradients(
        self,
        table: int,
        grad_out: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        psw: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the next ``update_ids`` would apply to table ``table``, without applying it.

        Args:
            table: the table's index in ``tables``.
            grad_out: ``(B, sum D)`` gradient of the pooled output.
            values: the ids (key-major, feature order).
            lengths: their bag lengths.
            psw: per-id weights, if any.

        Returns:
            ``(rows (U,), summed gradients (U, D), the rows' current values (U, D) FP32)``,
            rows sorted.
        """
        s, _ = self._where[table]
        store = self._stores[s]
        meta, _ = self._cached_meta(s)
        local = store.tables.index(table)
        uniq, grads = reference.summed_row_gradients(
            grad_out, self._storage(s), meta, local, values, lengths, psw, store.precision.value
        )
        t = self.tables[table]
        current = decode_rows(self._table_rows(table)[uniq], t.precision, t.dim)
        return uniq, grads, current

    def row_gradient_shares_of_ids(
        self,
        table: int,
        grad_out: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        psw: torch.Tensor | None,
        weight_decay: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per touched row of table ``table``: ``sum_d g'_d^2`` the next update would use.

        ``g' = g + weight_decay * w``, with ``g`` the summed gradient the next
        ``update_ids`` would apply to the row and ``w`` its current value: the sum
        a row-wise optimizer adds over the row's columns, which a column-split table's
        blocks share (``sharding/block_group.py``). One ``tetrarec::tbe_row_gradient_shares``
        call (compiled: the fused backward's sort and sums, nothing updated).

        Args:
            table: the table's index in ``tables``.
            grad_out: ``(B, sum D)`` gradient of the pooled output.
            values: the ids (key-major, feature order).
            lengths: their bag lengths.
            psw: per-id weights, if any.
            weight_decay: the optimizer's weight decay (``0.0``: none).

        Returns:
            ``(rows (U,) int64, sorted and unique; share (U,) FP32)``.

        Raises:
            ValueError: for an id of the table's features outside the table (when the
                kernel finds one), naming the feature and the id.
        """
        s, _ = self._where[table]
        store = self._stores[s]
        meta, _ = self._cached_meta(s)
        local = store.tables.index(table)
        try:
            rows, share = ops.tbe_row_gradient_shares(
                grad_out.contiguous(), self._storage(s), meta, values, lengths, psw,
                local, float(weight_decay), store.precision.value,
            )  # fmt: skip
        except RuntimeError:
            self._raise_named_bounds_error(values, lengths)
            raise
        return rows, share

    # -- what the trainer reads (embedding.HeldTables; layout, caches: the mixin) ----------

    def table_weights(self) -> dict[str, torch.Tensor]:
        """``{table name: (rows, dim) FP32}``, dequantized for low-precision tables.

        Copies at every precision: writing to one changes nothing, and a snapshot taken
        before a step stays as it was.
        """
        out = {}
        for i, t in enumerate(self.tables):
            w = decode_rows(self._table_rows(i), t.precision, t.dim)
            out[t.name] = w.clone() if t.precision is Precision.FP32 else w  # else: new
        return out

    # -- the fused optimizer's state (FusedState) -------------------------------------------

    def storages(self) -> list[torch.Tensor]:
        """The flat row storages, one per row store."""
        return [self._storage(s) for s in range(len(self._stores))]

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{table: {name: (rows, dim) or (rows,) FP32}}`` views of the optimizer state."""
        # Per-row state has width 1 whatever the dim (a dim-1 table's per-element state
        # stays (rows, 1)).
        per_row = {
            k for k, width in state_layout(self.optimizer_spec.kind, 2).items() if width == 1
        }
        out: dict[str, dict[str, torch.Tensor]] = {}
        for i, t in enumerate(self.tables):
            views = self._table_state(i)
            out[t.name] = {k: v.squeeze(1) if k in per_row else v for k, v in views.items()}
        return out

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy ``state`` (as ``optimizer_state`` returns it) into the module, bitwise.

        Raises:
            ValueError: for missing or unexpected tables or names, or another shape;
                raised before anything is copied (a refused load changes nothing).
        """
        mine = self.check_optimizer_state(state)
        with torch.no_grad():
            for table, names in mine.items():
                for name, dst in names.items():
                    dst.copy_(state[table][name])

    def check_optimizer_state(
        self, state: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Check that ``state`` fits this module; return the views it would be copied into.

        Raises:
            ValueError: as ``load_optimizer_state``.
        """
        mine = self.optimizer_state()
        if set(state) != set(mine):
            raise ValueError(
                f"optimizer state for tables {sorted(state)}, this module has {sorted(mine)}"
            )
        for table, names in mine.items():
            given = state[table]
            if set(given) != set(names):
                raise ValueError(
                    f"table {table!r}: optimizer state {sorted(given)}, expected {sorted(names)}"
                )
            for name, dst in names.items():
                if given[name].shape != dst.shape:
                    raise ValueError(
                        f"table {table!r} state {name!r}: expected {tuple(dst.shape)}, "
                        f"got {tuple(given[name].shape)}"
                    )
        return mine

    # -- state dict -----------------------------------------------------------------------

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        for i, t in enumerate(self.tables):
            rows = self._table_rows(i)
            destination[f"{prefix}weights.{t.name}"] = rows if keep_vars else rows.detach()
        # The stochastic-rounding stream position, so that a resumed run rounds the same.
        destination[f"{prefix}rounding"] = torch.tensor([self.seed, self.iteration])

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
        expected = {
            f"{prefix}weights.{t.name}": self._table_rows(i) for i, t in enumerate(self.tables)
        }
        load_table_rows(state_dict, expected, missing_keys, error_msgs)
        rounding = state_dict.get(f"{prefix}rounding")  # optional: weights-only loads
        if rounding is not None:
            self.seed, self.iteration = (int(x) for x in rounding.tolist())
        for key in state_dict:
            if key.startswith(prefix) and key not in expected and key != f"{prefix}rounding":
                unexpected_keys.append(key)


if TYPE_CHECKING:  # mypy checks that the collection answers the protocol
    _answers: type[LocalLookup[None]] = FusedEmbeddingBagCollection
