"""``InferenceEmbeddingBags``: an exported model's tables, each in its own precision.

::

    SparseFeatures (F, B, L[f][b])  ->  PooledEmbeddings (B, D_0 + D_1 + ...)

Forward only: no optimizer state, no gradient, no stochastic rounding. Each table's rows
are stored in FP32, FP16, BF16, INT8 or INT4 (the packed row-wise layout of
``tetrarec.kernels.quant``: codes, then an FP16 scale and bias per row) and pooled in
FP32. A table may be pruned: only its ``stored`` rows are kept, and ``remap`` (one int32
per id the table answers) sends each id to its stored row, or to the last stored row,
which is all zeros, for an id that was pruned (it adds nothing to a sum; a mean still
counts it).

Lookups run through a backend of ``BACKENDS`` (a registry, the only dispatch):

- ``tetrarec``: the compiled table-batched kernel ``tetrarec::tbe_forward`` (or its
  portable PyTorch path), one call per precision for all of its tables;
- ``torch``: PyTorch's own row-wise quantized embedding bags
  (``quantized::embedding_bag_byte_rowwise_offsets`` and ``..._4bit_...``, FBGEMM's
  CPU kernels inside PyTorch) for INT8/INT4 tables (a copy of their rows in PyTorch's
  layout is made on first use), tetrarec's kernel for float ones (PyTorch has no
  FP16/BF16 bag that accumulates in FP32);
- ``auto`` (the default): per precision, the path that measured faster
  (``TORCH_FASTER``, from ``benchmarks/bench_inference_kernels.py``).

All give the same sums up to the order of additions. ``InferenceEmbeddingBags.backend``
says which backend a model runs and ``lookup_paths`` which kernel each precision's
tables take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tetrarec.embedding import TableConfig, TableSlice, feature_order
from tetrarec.embedding.collection import check_ids
from tetrarec.kernels import ops, row_width
from tetrarec.kernels.layout import RowStore, plan_stores
from tetrarec.sparse import PooledEmbeddings, SparseFeatures, permute_keys
from tetrarec.types import OptimizerKind, PoolingMode, Precision

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "TORCH_FASTER",
    "InferenceEmbeddingBags",
    "LookupBackend",
    "torch_packed_rows",
]


class InferenceEmbeddingBags(nn.Module):
    """Tables stored in their own precisions, pooled for inference.

    Args:
        tables: every table; ``num_embeddings`` is the number of *stored* rows
            (a pruned table's kept rows plus its zero row), ``precision`` how they are
            stored.
        rows: ``{table: stored rows}``: ``(stored, dim)`` in the table's float dtype,
            or ``(stored, row_bytes)`` uint8 packed rows for INT8/INT4.
        remaps: ``{table: (ids,) int32}`` for pruned tables: the stored row of each id.
        backend: a name in ``BACKENDS`` (default ``auto``, ``DEFAULT_BACKEND``).

    Raises:
        ValueError: for rows of another shape or dtype than their table's precision
            asks, a remap that points outside the stored rows, or an unknown backend.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        rows: Mapping[str, torch.Tensor],
        *,
        remaps: Mapping[str, torch.Tensor] | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown lookup backend {backend!r}; valid: {sorted(BACKENDS)}")
        self.tables = tuple(tables)
        self.feature_names = feature_order(self.tables)
        self.feature_dims = tuple(t.dim for t in self.tables for _ in t.feature_names)
        self.backend = backend
        remaps = dict(remaps or {})
        unknown = sorted(set(remaps) - {t.name for t in self.tables})
        if unknown:
            raise ValueError(f"remaps for tables that are not in the collection: {unknown}")
        self._stores = plan_stores(self.tables, OptimizerKind.SGD)
        for s, store in enumerate(self._stores):
            parts = []
            for i in store.tables:
                t = self.tables[i]
                r = rows[t.name]
                width = row_width(t.precision, t.dim)
                want = torch.uint8 if t.precision.is_integer else t.precision.torch_dtype
                if r.shape != (t.num_embeddings, width) or r.dtype != want:
                    raise ValueError(
                        f"table {t.name!r} ({t.precision.value}, dim {t.dim}): rows "
                        f"{tuple(r.shape)} {r.dtype}, expected ({t.num_embeddings}, {width}) "
                        f"{want}"
                    )
                parts.append(r.reshape(-1))
            self.register_buffer(f"_weights_{s}", torch.cat(parts), persistent=False)
        #: ``{table: ids it answers}``: the stored rows, or a pruned table's remap length.
        self.id_rows: dict[str, int] = {t.name: t.num_embeddings for t in self.tables}
        for name, remap in remaps.items():
            table = self._table(name)
            if remap.dim() != 1 or remap.dtype != torch.int32:
                raise ValueError(f"table {name!r}: remap must be 1-D int32, got {remap.dtype}")
            if remap.numel() and (int(remap.min()) < 0 or int(remap.max()) >= table.num_embeddings):
                raise ValueError(f"table {name!r}: remap points outside its stored rows")
            self.register_buffer(f"_remap_{name}", remap.clone(), persistent=False)
            self.id_rows[name] = remap.numel()
        self._remapped = tuple(remaps)

    def _table(self, name: str) -> TableConfig:
        return next(t for t in self.tables if t.name == name)

    @property
    def stores(self) -> tuple[RowStore, ...]:
        """The row stores, one per precision (``tetrarec.kernels.layout``)."""
        return self._stores

    def storage(self, s: int) -> torch.Tensor:
        """The flat rows of store ``s``."""
        weights = getattr(self, f"_weights_{s}")
        assert isinstance(weights, torch.Tensor)  # registered in __init__
        return weights

    def table_rows(self, name: str) -> torch.Tensor:
        """``(stored, row width)`` view of table ``name``'s stored rows."""
        i = next(k for k, t in enumerate(self.tables) if t.name == name)
        s, store = next((s, st) for s, st in enumerate(self._stores) if i in st.tables)
        t = self.tables[i]
        width = row_width(t.precision, t.dim)
        start = store.w_offsets[store.tables.index(i)]
        return self.storage(s)[start : start + t.num_embeddings * width].view(-1, width)

    def remap(self, name: str) -> torch.Tensor | None:
        """Table ``name``'s id map, or ``None`` if it is not pruned."""
        if name not in self._remapped:
            return None
        remap = getattr(self, f"_remap_{name}")
        assert isinstance(remap, torch.Tensor)
        return remap

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """``{"tables.<t>.rows": rows, "tables.<t>.remap": ids}``, as a model file holds them."""
        out = {f"tables.{t.name}.rows": self.table_rows(t.name) for t in self.tables}
        for name in self._remapped:
            remap = self.remap(name)
            assert remap is not None
            out[f"tables.{name}.remap"] = remap
        return out

    @property
    def lookup_paths(self) -> dict[Precision, str]:
        """``{precision: "tetrarec" | "torch"}``: which kernel pools each precision's tables.

        (PyTorch's quantized bags are CPU kernels: on another device every table runs
        tetrarec's portable path.)
        """
        backend = BACKENDS[self.backend]
        on_cpu = self.storage(0).device.type == "cpu" if self._stores else True
        return {
            t.precision: backend.path(t.precision) if on_cpu else "tetrarec" for t in self.tables
        }

    def nbytes(self) -> int:
        """Bytes of every stored row and id map."""
        return sum(v.numel() * v.element_size() for v in self.stored_tensors().values())

    def meta(self, s: int) -> list[torch.Tensor]:
        """The kernel's layout tensors of store ``s`` on its device, built once."""
        cache: dict[tuple[int, torch.device], list[torch.Tensor]]
        cache = self.__dict__.setdefault("_meta_cache", {})
        dev = self.storage(s).device
        if (s, dev) not in cache:
            slices = [TableSlice(table=t) for t in self.tables]
            cache[(s, dev)] = self._stores[s].meta(self.tables, slices, dev)
        return cache[(s, dev)]

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """Pool every feature; output columns follow ``self.feature_names``.

        Raises:
            ValueError: naming the feature and the id, for an id outside the rows its
                table answers.
        """
        if features.keys != self.feature_names:
            features = permute_keys(features, self.feature_names)
        values, lengths = features.values, features.lengths
        batch = features.batch_size
        per_feature = lengths.view(len(self.feature_names), batch).sum(1)  # (F,)
        self._check_ids(values, per_feature)
        if self._remapped:
            values = self._remap_ids(values, per_feature)
        out = torch.empty(batch, sum(self.feature_dims), device=values.device)  # (B, sum D)
        BACKENDS[self.backend](self, values, lengths, features.weights, out)
        return PooledEmbeddings(self.feature_names, self.feature_dims, out)

    def _feature_rows(self, device: torch.device) -> torch.Tensor:
        """``(F,)`` int64: the ids each feature's table answers, on ``device`` (built once)."""
        cache: dict[torch.device, torch.Tensor] = self.__dict__.setdefault("_rows_cache", {})
        if device not in cache:
            table_of = {f: t.name for t in self.tables for f in t.feature_names}
            rows = [self.id_rows[table_of[f]] for f in self.feature_names]
            cache[device] = torch.tensor(rows, dtype=torch.int64, device=device)
        return cache[device]

    def _check_ids(self, values: torch.Tensor, per_feature: torch.Tensor) -> None:
        """Raise naming the feature and the id, for an id outside its table's rows.

        One pass over every id and one host sync (``check_ids`` per feature took two
        syncs per feature: a millisecond a batch on 52 features).
        """
        if values.numel() == 0:
            return
        rows = self._feature_rows(values.device)
        limit = rows.repeat_interleave(per_feature, output_size=values.numel())
        bad = (values < 0) | (values >= limit)
        if not bool(bad.any()):
            return
        first = int(torch.nonzero(bad)[0, 0])
        feature = int(torch.searchsorted(per_feature.cumsum(0), first, right=True))
        name = self.feature_names[feature]
        check_ids(name, values[first : first + 1], int(rows[feature]))

    def _remap_ids(self, values: torch.Tensor, per_feature: torch.Tensor) -> torch.Tensor:
        """``values`` with each pruned table's ids replaced by their stored rows."""
        starts = [0, *per_feature.cumsum(0).tolist()]
        table_of = {f: t.name for t in self.tables for f in t.feature_names}
        mapped = values.to(torch.int64, copy=True)
        for f, name in enumerate(self.feature_names):
            remap = self.remap(table_of[name])
            if remap is not None:
                lo, hi = starts[f], starts[f + 1]
                mapped[lo:hi] = remap[values[lo:hi].long()].long()
        return mapped

    def _apply(self, fn: Any, recurse: bool = True) -> InferenceEmbeddingBags:
        """Moves apply; casts leave each table at its stored dtype (as the fused module)."""

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            moved = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            return t if moved.device == t.device else t.to(moved.device)

        out: InferenceEmbeddingBags = super()._apply(keep_dtype, recurse)  # type: ignore[no-untyped-call]  # torch leaves _apply unannotated
        return out


_TORCH_QUANT_OPS: dict[Precision, str] = {
    Precision.INT8: "embedding_bag_byte_rowwise_offsets",
    Precision.INT4: "embedding_bag_4bit_rowwise_offsets",
}


def torch_packed_rows(rows: torch.Tensor, precision: Precision, dim: int) -> torch.Tensor:
    """Table rows in the layout of PyTorch's quantized embedding bags.

    INT8: ``dim`` codes, then FP32 scale and bias (tetrarec keeps FP16 ones: widened
    exactly). INT4: ``ceil(dim/2)`` bytes of codes (low nibble first, as tetrarec), then
    FP16 scale and bias, without tetrarec's alignment padding.
    """
    n = rows.shape[0]
    if precision is Precision.INT8:
        codes = rows[:, :dim]
        scale_bias = rows[:, dim : dim + 4].contiguous().view(torch.float16).float()
        return torch.cat([codes, scale_bias.view(torch.uint8).view(n, 8)], dim=1)
    packed = (dim + 1) // 2
    return rows[:, : packed + 4].contiguous()


def _tetrarec_stores(
    module: InferenceEmbeddingBags,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    out: torch.Tensor,
    skip: frozenset[Precision],
) -> None:
    """Tetrarec's kernel, one call per store (precision) not in ``skip``."""
    for s, store in enumerate(module.stores):
        if store.precision not in skip:
            ops.tbe_forward(
                module.storage(s), module.meta(s), values, lengths, weights, out,
                store.precision.value, False,
            )  # fmt: skip


def _torch_tables(
    module: InferenceEmbeddingBags,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    out: torch.Tensor,
    precisions: frozenset[Precision],
) -> None:
    """PyTorch's row-wise quantized bags for every feature of a table in ``precisions``."""
    if not any(t.precision in precisions for t in module.tables):
        return
    cache: dict[str, torch.Tensor] = module.__dict__.setdefault("_torch_rows", {})
    batch = out.shape[0]
    # One cumsum for every feature's bags; feature f's are offsets[f*B : (f+1)*B + 1],
    # shifted to its own ids (PyTorch's INT4 bag wants its last offset = its ids' count).
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    starts = offsets[::batch].tolist()  # (F + 1,): one host sync
    ids = values.long()
    psw = None if weights is None else weights.float()
    col = 0
    for f, name in enumerate(module.feature_names):
        t = next(t for t in module.tables if name in t.feature_names)
        if t.precision in precisions:
            key = f"{t.name}@{values.device}"
            if key not in cache:
                rows = module.table_rows(t.name)
                cache[key] = torch_packed_rows(rows, t.precision, t.dim).to(values.device)
            op = getattr(torch.ops.quantized, _TORCH_QUANT_OPS[t.precision])
            lo, hi = starts[f], starts[f + 1]
            bags = offsets[f * batch : (f + 1) * batch + 1] - lo
            w = None if psw is None else psw[lo:hi]
            # mode 0 (sum): PyTorch's quantized bags ignore mode=1 and sum anyway (torch
            # 2.13), so a mean is the sum divided here by the bag length, as tetrarec's.
            pooled = op(cache[key], ids[lo:hi], bags, False, 0, False, w, None, True)
            if t.pooling is PoolingMode.MEAN:
                lens = lengths[f * batch : (f + 1) * batch]
                pooled = pooled / lens.clamp(min=1).to(pooled.dtype)[:, None]
            out[:, col : col + t.dim] = pooled
        col += t.dim


@dataclass(frozen=True)
class LookupBackend:
    """A lookup path per precision: PyTorch's bags for ``torch_precisions``, else tetrarec's.

    ``torch_precisions`` is a subset of INT8 and INT4 (PyTorch has no other row-wise
    bag); every other precision runs tetrarec's kernel. Called as
    ``backend(module, key-major ids, lengths, per-id weights or None, out (B, sum D))``:
    fills ``out`` with every feature's pooled rows.
    """

    torch_precisions: frozenset[Precision]

    def path(self, precision: Precision) -> str:
        """``"torch"`` or ``"tetrarec"``: which kernel pools tables of ``precision``."""
        return "torch" if precision in self.torch_precisions else "tetrarec"

    def __call__(
        self,
        module: InferenceEmbeddingBags,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """Pool every feature into ``out``.

        PyTorch's quantized bags have CPU kernels only: on another device (CUDA) every
        table runs tetrarec's kernel (its portable path there).
        """
        on_torch = self.torch_precisions if values.device.type == "cpu" else frozenset()
        _tetrarec_stores(module, values, lengths, weights, out, on_torch)
        _torch_tables(module, values, lengths, weights, out, on_torch)


#: The precisions whose PyTorch bags measured faster than tetrarec's kernel at batch
#: 2048 on both shapes of ``benchmarks/bench_inference_kernels.py`` (see
#: benchmarks/results/inference_kernels.md); ``auto`` runs those on PyTorch's ops.
TORCH_FASTER: frozenset[Precision] = frozenset({Precision.INT8})


#: The lookup backends, by name (the only dispatch on them).
BACKENDS: dict[str, LookupBackend] = {
    "tetrarec": LookupBackend(frozenset()),
    "torch": LookupBackend(frozenset(_TORCH_QUANT_OPS)),
    "auto": LookupBackend(TORCH_FASTER),
}
#: The backend a model loads with: the faster path per precision, as measured.
DEFAULT_BACKEND = "auto"
