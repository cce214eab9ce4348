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
- ``torch``: PyTorch's own bags: the row-wise quantized ones
  (``quantized::embedding_bag_byte_rowwise_offsets`` and ``..._4bit_...``, FBGEMM's
  CPU kernels inside PyTorch) for INT8/INT4 tables, ``F.embedding_bag`` for FP32 ones,
  tetrarec's kernel for FP16/BF16 (PyTorch has no such bag that sums in FP32). Each run
  of consecutive features whose tables share a precision, dim and pooling is one call
  on their stacked rows (a copy in PyTorch's layout, made on first use);
- ``auto`` (the default): per precision, the path that measured faster
  (``TORCH_FASTER`` and ``TETRAREC_UP_TO_DIM``, from
  ``benchmarks/bench_inference_kernels.py``): PyTorch's bags for INT8 tables wider
  than 32, tetrarec's kernel for every other table.

All give the same sums up to the order of additions. ``InferenceEmbeddingBags.backend``
says which backend a model runs and ``lookup_paths`` which kernel each precision's
tables take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
    "TETRAREC_UP_TO_DIM",
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
        device = self.storage(0).device if self._stores else torch.device("cpu")
        on_torch = BACKENDS[self.backend].on_torch(self, device)
        return {
            t.precision: "torch" if t.precision in on_torch else "tetrarec" for t in self.tables
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
        backend = BACKENDS[self.backend]
        # Where tetrarec's kernel pools every table of an unpruned model, it checks the
        # ids itself, in the same pass (a remap or PyTorch's bags need them checked first):
        # the separate pass over the ids cost a third of a pooling-1 lookup.
        in_kernel = not self._remapped and not backend.on_torch(self, values.device)
        if not in_kernel:
            per_feature = lengths.view(len(self.feature_names), batch).sum(1)  # (F,)
            self._check_ids(values, per_feature)
            if self._remapped:
                values = self._remap_ids(values, per_feature)
        out = torch.empty(batch, sum(self.feature_dims), device=values.device)  # (B, sum D)
        bad = backend(self, values, lengths, features.weights, out, check=in_kernel)
        if bad:
            self._raise_bad_ids(torch.stack(bad))
        return PooledEmbeddings(self.feature_names, self.feature_dims, out)

    def _raise_bad_ids(self, reports: torch.Tensor) -> None:
        """Raise for the first feature's smallest bad id among the kernel's reports.

        ``reports``: ``(stores, 2)`` int64, each ``(feature, id)`` or ``(-1, -1)``; one
        host sync.
        """
        found = [(f, i) for f, i in reports.tolist() if f >= 0]
        if found:
            f, bad = min(found)
            name = self.feature_names[f]
            check_ids(name, torch.tensor([bad]), int(self._feature_rows(reports.device)[f]))

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
        """``values`` with each pruned table's ids replaced by their stored rows.

        A few passes over the ids, no host sync: the pruned features' id maps stand end to
        end in one tensor (``_joint_remap``), each value indexes it at its feature's base.
        """
        joint, base, pruned = self._joint_remap(values.device)
        feature = torch.arange(len(self.feature_names), device=values.device)
        feature = feature.repeat_interleave(per_feature, output_size=values.numel())
        # index_select, not tensor[index]: advanced indexing took 3x as long here
        mask = pruned.index_select(0, feature)
        index = torch.where(mask, values.long() + base.index_select(0, feature), 0)
        return torch.where(mask, joint.index_select(0, index), values.long())

    def _joint_remap(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(id maps end to end (int64), (F,) each feature's base in it, (F,) pruned?)``."""
        cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
        cache = self.__dict__.setdefault("_joint_cache", {})
        if device not in cache:
            table_of = {f: t.name for t in self.tables for f in t.feature_names}
            maps, base, pruned, n = [], [], [], 0
            for name in self.feature_names:
                remap = self.remap(table_of[name])
                base.append(n)
                pruned.append(remap is not None)
                if remap is not None:
                    maps.append(remap.long())
                    n += remap.numel()
            cache[device] = (
                torch.cat(maps).to(device),
                torch.tensor(base, dtype=torch.int64, device=device),
                torch.tensor(pruned, dtype=torch.bool, device=device),
            )
        return cache[device]

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
    check: bool,
) -> list[torch.Tensor]:
    """Tetrarec's kernel, one call per store (precision) not in ``skip``.

    Returns:
        With ``check``, each call's ``(feature, id)`` report of the first bad id (the
        kernel skips it), else nothing.
    """
    reports = []
    for s, store in enumerate(module.stores):
        if store.precision not in skip:
            bad = ops.tbe_forward(
                module.storage(s), module.meta(s), values, lengths, weights, out,
                store.precision.value, check,
            )  # fmt: skip
            if check:
                reports.append(bad)
    return reports


@dataclass(frozen=True)
class _Run:
    """Consecutive features (key-major) whose tables PyTorch pools in one call.

    Their tables share a precision, a dim and a pooling; ``table_rows`` is the stacked
    rows of the run's distinct tables (in PyTorch's layout) and ``row_offsets`` each
    feature's first row in it.
    """

    first: int  # first feature of the run
    stop: int  # one past its last
    col: int  # its first output column
    dim: int
    precision: Precision
    mean: bool
    key: str  # the stacked rows' cache key
    tables: tuple[str, ...]  # each feature's table


def _torch_runs(module: InferenceEmbeddingBags, precisions: frozenset[Precision]) -> list[_Run]:
    """The runs of consecutive features whose tables run on PyTorch (built once)."""
    cache: dict[frozenset[Precision], list[_Run]] = module.__dict__.setdefault("_runs", {})
    if precisions in cache:
        return cache[precisions]
    table_of = {f: t for t in module.tables for f in t.feature_names}
    runs: list[_Run] = []
    col = 0
    for f, name in enumerate(module.feature_names):
        t = table_of[name]
        kind = (t.precision, t.dim, t.pooling)
        last = runs[-1] if runs else None
        if t.precision in precisions:
            if (
                last is not None
                and last.stop == f
                and (
                    (last.precision, last.dim, PoolingMode.MEAN if last.mean else PoolingMode.SUM)
                    == kind
                )
            ):
                runs[-1] = dataclasses.replace(last, stop=f + 1, tables=(*last.tables, t.name))
            else:
                runs.append(
                    _Run(
                        first=f, stop=f + 1, col=col, dim=t.dim, precision=t.precision,
                        mean=t.pooling is PoolingMode.MEAN, key="", tables=(t.name,),
                    )
                )  # fmt: skip
        col += t.dim
    runs = [dataclasses.replace(r, key="|".join(dict.fromkeys(r.tables))) for r in runs]
    cache[precisions] = runs
    return runs


def _run_rows(
    module: InferenceEmbeddingBags, run: _Run, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stacked rows, (features,) first row of each feature's table)``, built once."""
    cache: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]]
    cache = module.__dict__.setdefault("_torch_rows", {})
    if (run.key, device) not in cache:
        distinct = list(dict.fromkeys(run.tables))
        parts, first, n = [], {}, 0
        for name in distinct:
            rows = module.table_rows(name)
            if run.precision.is_integer:
                rows = torch_packed_rows(rows, run.precision, run.dim)
            parts.append(rows)
            first[name] = n
            n += rows.shape[0]
        offsets = torch.tensor([first[t] for t in run.tables], dtype=torch.int64, device=device)
        cache[(run.key, device)] = (torch.cat(parts).to(device), offsets)
    return cache[(run.key, device)]


def _torch_tables(
    module: InferenceEmbeddingBags,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    out: torch.Tensor,
    precisions: frozenset[Precision],
) -> None:
    """PyTorch's bags for every feature of a table in ``precisions``: one call per run.

    A run of consecutive features with tables of one precision, dim and pooling is one
    call on their stacked rows (ids shifted to their table's first row), its output
    ``(features * B, D)`` written into ``out``'s columns by one copy.
    """
    runs = _torch_runs(module, precisions)
    if not runs:
        return
    batch = out.shape[0]
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    starts = offsets[::batch].tolist()  # (F + 1,): one host sync
    counts = lengths.view(-1, batch).sum(1)  # (F,)
    for run in runs:
        rows, first_rows = _run_rows(module, run, values.device)
        lo, hi = starts[run.first], starts[run.stop]
        ids = values[lo:hi].long() + first_rows.repeat_interleave(
            counts[run.first : run.stop], output_size=hi - lo
        )
        bags = offsets[run.first * batch : run.stop * batch + 1] - lo
        w = None if weights is None else weights[lo:hi].float()
        pooled = _POOL[run.precision](rows, ids, bags, w)  # (features * B, D)
        if run.mean:
            lens = lengths[run.first * batch : run.stop * batch]
            pooled = pooled / lens.clamp(min=1).to(pooled.dtype)[:, None]
        n = run.stop - run.first
        block = out[:, run.col : run.col + n * run.dim].view(batch, n, run.dim)
        block.copy_(pooled.view(n, batch, run.dim).transpose(0, 1))


def _pool_fp32(
    rows: torch.Tensor, ids: torch.Tensor, bags: torch.Tensor, w: torch.Tensor | None
) -> torch.Tensor:
    return F.embedding_bag(
        ids, rows, bags, mode="sum", per_sample_weights=w, include_last_offset=True
    )


def _quantized_pool(
    op: str,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    def pool(
        rows: torch.Tensor, ids: torch.Tensor, bags: torch.Tensor, w: torch.Tensor | None
    ) -> torch.Tensor:
        # mode 0 (sum): PyTorch's quantized bags ignore mode=1 and sum anyway (torch
        # 2.13); a mean is the sum divided by the bag length (_torch_tables).
        out: torch.Tensor = getattr(torch.ops.quantized, op)(
            rows, ids, bags, False, 0, False, w, None, True
        )
        return out

    return pool


#: How PyTorch pools a run of each precision (FP32: ``F.embedding_bag``; INT8/INT4: its
#: row-wise quantized bags, FBGEMM's CPU kernels).
_POOL = {
    Precision.FP32: _pool_fp32,
    **{p: _quantized_pool(op) for p, op in _TORCH_QUANT_OPS.items()},
}


@dataclass(frozen=True)
class LookupBackend:
    """A lookup path per precision: PyTorch's bags for ``torch_precisions``, else tetrarec's.

    ``torch_precisions`` is a subset of FP32 (``F.embedding_bag``), INT8 and INT4
    (PyTorch's row-wise quantized bags; it has no FP16/BF16 bag that sums in FP32);
    every other precision runs tetrarec's kernel. Called as
    ``backend(module, key-major ids, lengths, per-id weights or None, out (B, sum D),
    check=...)``: fills ``out`` with every feature's pooled rows.
    """

    torch_precisions: frozenset[Precision]
    #: Keep a precision on tetrarec's kernel where none of its tables is wider than this
    #: (``None``: no such rule).
    tetrarec_up_to_dim: int | None = None

    def on_torch(
        self, module: InferenceEmbeddingBags, device: torch.device
    ) -> frozenset[Precision]:
        """The precisions of ``module``'s tables that PyTorch pools on ``device``.

        None off the CPU (PyTorch's quantized bags are CPU kernels), and a precision
        only where PyTorch takes every one of its tables: its 4-bit bag reads an odd
        dim as one more column, so a module with an odd-dim INT4 table (a first-order
        term's dim-1 table) pools its INT4 tables with tetrarec's kernel. With
        ``tetrarec_up_to_dim``, a precision whose tables are all that narrow stays on
        tetrarec's kernel. Worked out once per module and device kind: it is asked twice
        a lookup, and each time walked every table.
        """
        cache: dict[tuple[LookupBackend, str], frozenset[Precision]]
        cache = module.__dict__.setdefault("_on_torch", {})
        key = (self, device.type)
        if key not in cache:
            cache[key] = self._on_torch(module, device)
        return cache[key]

    def _on_torch(
        self, module: InferenceEmbeddingBags, device: torch.device
    ) -> frozenset[Precision]:
        if device.type != "cpu":
            return frozenset()
        present = {t.precision for t in module.tables}
        odd_int4 = any(t.precision is Precision.INT4 and t.dim % 2 for t in module.tables)
        keep = {Precision.INT4} if odd_int4 else set()
        if self.tetrarec_up_to_dim is not None:
            widest: dict[Precision, int] = {}
            for t in module.tables:
                widest[t.precision] = max(widest.get(t.precision, 0), t.dim)
            keep |= {p for p, d in widest.items() if d <= self.tetrarec_up_to_dim}
        return (self.torch_precisions & present) - keep

    def path(self, precision: Precision, dim: int) -> str:
        """``"torch"`` or ``"tetrarec"``: which kernel pools a table on the CPU.

        For a table of ``precision`` and ``dim``, where no other table of its precision
        is wider.
        """
        narrow = self.tetrarec_up_to_dim is not None and dim <= self.tetrarec_up_to_dim
        return "torch" if precision in self.torch_precisions and not narrow else "tetrarec"

    def __call__(
        self,
        module: InferenceEmbeddingBags,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        out: torch.Tensor,
        *,
        check: bool = False,
    ) -> list[torch.Tensor]:
        """Pool every feature into ``out``.

        PyTorch's quantized bags have CPU kernels only: on another device (CUDA) every
        table runs tetrarec's kernel (its portable path there).

        Returns:
            With ``check`` (only where tetrarec's kernel pools every table), each kernel
            call's ``(feature, id)`` report of the first id outside its table, or
            ``(-1, -1)``; the bad ids were skipped. Without, an empty list.
        """
        on_torch = self.on_torch(module, values.device)
        if check and on_torch:
            raise ValueError("the kernel checks ids only where it pools every table")
        reports = _tetrarec_stores(module, values, lengths, weights, out, on_torch, check)
        _torch_tables(module, values, lengths, weights, out, on_torch)
        return reports


#: The precisions whose PyTorch bags can be faster than tetrarec's kernel, and the widest
#: dim at which tetrarec's measured faster all the same (batch 2048, 26 tables;
#: ``benchmarks/bench_inference_kernels.py --only tables [--threads 1]``, results in
#: benchmarks/results/inference_kernels.md): INT8 only. At dim 64, pooling 20, PyTorch's
#: INT8 bag took 0.89x tetrarec's time on 1 thread (1.02x on 2); at dim 16, pooling 1,
#: 1.6-1.7x. INT4 (1.3-2.5x), FP32 (1.06-1.36x) and FP16 (PyTorch has no FP16 bag) are
#: tetrarec's. ``auto`` runs INT8 on PyTorch's bags unless none of the model's INT8
#: tables is wider than ``TETRAREC_UP_TO_DIM``.
TORCH_FASTER: frozenset[Precision] = frozenset({Precision.INT8})
TETRAREC_UP_TO_DIM = 32


#: The lookup backends, by name (the only dispatch on them).
BACKENDS: dict[str, LookupBackend] = {
    "tetrarec": LookupBackend(frozenset()),
    "torch": LookupBackend(frozenset(_POOL)),
    "auto": LookupBackend(TORCH_FASTER, TETRAREC_UP_TO_DIM),
}
#: The backend a model loads with: the faster path per precision, as measured.
DEFAULT_BACKEND = "auto"
