"""The ``tetrarec::`` ops: the only entry points the rest of the code calls.

Each op is defined once with ``torch.library.custom_op``; its default implementation is
the portable one (any device: ``reference_batched.py`` for the table-batched forward and
backward + update, with no host reads in a step; ``reference.py`` for the rest), and the
CPU kernel is the compiled one from ``csrc/`` when it builds (see ``_build.py``), else
the portable path ``_CPU_PORTABLE`` names for the ``TETRAREC_KERNELS`` mode: the
per-table loop in ``reference.py`` (the definition, and 2-2.5x faster than the batched
path on a CPU), or with ``TETRAREC_KERNELS=batched`` what a GPU runs. Callers never
branch on device.
The names exported here wrap each op (``_eager_cpu_path``): a plain eager call on CPU
tensors runs the CPU kernel without the custom op's Python layers (about 90 us a call);
tracing, fake tensors, other devices and autograd go through the op itself
(``_<name>_op``).

The ops: ``tbe_forward``, ``tbe_backward_update`` and ``tbe_row_gradient_shares``
(table-batched embedding), three of the dense path, ``dot_interaction``
(differentiable), ``dot_interaction_bf16`` (inference: BF16 products, FP32 sums; no
gradient) and ``round_to_bf16_out`` (the BF16 emulation's rounding), which use
the compiled kernel for contiguous FP32 tensors only, and ``copy_row_runs`` (how
sharded collections move column blocks; any dtype), and ``load_rows`` / ``store_rows``
(rows decoded from / encoded into a row store by index: the mixed-precision cache's
admissions and write-backs).

Arguments shared by the table-batched ops, for one row store (the tables of one
precision)::

    weights  (sum_t rows_t * width_t,)  flat rows; table t starts at w_offsets[t]
    meta     9 int64 tensors on the weights' device:
             w_offsets (T,)  first storage element of each table
             dims      (T,)  embedding dim of each table
             num_rows  (T,)  rows of each table
             row_offsets (T,) first row of each table in the store's row numbering
             feat_table (F,) table of each feature, -1 if in another store
             feat_cols (F,)  first output column of each feature
             feat_mean (F,)  1 for mean pooling, 0 for sum
             row_keys  (T,)  stochastic-rounding key of each table's row 0 (row r
                             rounds with key row_keys[t] + r: the global row's key)
             col_starts (T,) global column of each table's column 0 (a shard's offset)
    values   (N,) ids, key-major;  lengths (F*B,) bag lengths, key-major
    per_sample_weights  optional (N,) float
    precision  "fp32" | "fp16" | "bf16" | "int8" | "int4"
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any, ParamSpec, TypeVar

import torch

from tetrarec.kernels import reference, reference_batched
from tetrarec.kernels._build import compiled_cpu_kernels, kernel_mode

__all__ = [
    "copy_row_runs",
    "dot_interaction",
    "dot_interaction_bf16",
    "load_rows",
    "round_to_bf16_out",
    "store_rows",
    "tbe_backward_update",
    "tbe_forward",
    "tbe_row_gradient_shares",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")

# Private torch hooks, each with a safe answer where a later torch drops it: the number
# of active dispatch modes (fake tensors, FlopCounterMode, ...), whether a
# __torch_function__ mode is active, whether the profiler records (missing: assume yes).
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_function_modes: Callable[[], bool] = getattr(
    torch._C, "_is_torch_function_mode_enabled", lambda: True
)
_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)
# The innermost active torch.func transform (vmap, grad, ...), None outside them.
_func_transform: Callable[[], object] = getattr(
    torch._C._functorch, "peek_interpreter_stack", lambda: True
)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no __torch_function__ of their own

#: The portable table-batched forward and backward + update the CPU runs when the
#: compiled kernel does not, by ``TETRAREC_KERNELS`` mode (``_build.kernel_mode``): the
#: per-table loop, or with ``batched`` what every other device runs (the same bits).
_CPU_PORTABLE: dict[str, ModuleType] = {
    "auto": reference,
    "compiled": reference,
    "reference": reference,
    "batched": reference_batched,
}


def _cpu_portable() -> ModuleType:
    """The portable module the CPU runs in this ``TETRAREC_KERNELS`` mode (read now)."""
    return _CPU_PORTABLE[kernel_mode()]


def _plain_eager_cpu(args: tuple[Any, ...]) -> bool:
    """Whether a call with ``args`` may run its CPU kernel without the dispatcher.

    Only plain eager code qualifies: no ``torch.compile``/export tracing, no dispatch or
    ``__torch_function__`` mode (fake tensors, flop counters, ...), no ``torch.func``
    transform (vmap, grad), every tensor (also inside list or tuple arguments) a plain
    CPU tensor, and none needing a gradient. About 2 us for the backward's 25 tensors.
    """
    # Tracing first: dynamo folds it to True and never reaches the private hooks, which
    # it cannot trace (fullgraph=True failed on them), so a compiled graph keeps the op.
    if torch.compiler.is_compiling() or _dispatch_modes() or _function_modes():
        return False
    if _func_transform() is not None:  # vmap's batched tensors have no storage to hand on
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and (
                type(t) not in _PLAIN or not t.is_cpu or (grad and t.requires_grad)
            ):
                return False
    return True


def _eager_cpu_path(
    op: Callable[_P, _R], cpu_kernel: Callable[_P, _R], *, mutates: tuple[str, ...] = ()
) -> Callable[_P, _R]:
    """``op`` as callers see it: plain eager CPU calls go straight to ``cpu_kernel``.

    A ``torch.library.custom_op`` call passes through Python layers (autograd,
    ADInplaceOrView, the kernel lookup) before its CPU kernel: about 90 us for each of
    the two table-batched ops, which made a training step of 8 tables at batch 512 take
    1.6x as long as its two kernels did (``benchmarks/bench_embedding.py``). A call that
    nothing else needs to see (``_plain_eager_cpu``) runs ``cpu_kernel`` directly,
    bumping the version counters of the tensors it mutates as the op does, and under a
    ``torch.profiler`` run inside a ``record_function`` of the op's name. Every other
    call (tracing, fake tensors, other devices, autograd) goes through ``op``.
    """
    params = list(inspect.signature(cpu_kernel).parameters)
    where = [params.index(name) for name in mutates]
    name = "tetrarec::" + cpu_kernel.__name__.removeprefix("_").removesuffix("_cpu")

    @functools.wraps(getattr(op, "_init_fn", cpu_kernel))
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if kwargs or not _plain_eager_cpu(args):
            return op(*args, **kwargs)
        for i in where:
            mutated = args[i]
            for t in mutated if isinstance(mutated, (list, tuple)) else (mutated,):
                torch.autograd.graph.increment_version(t)
        if _profiling():
            with torch.autograd.profiler.record_function(name):
                return cpu_kernel(*args, **kwargs)
        return cpu_kernel(*args, **kwargs)

    call.__name__ = call.__qualname__ = name.removeprefix("tetrarec::")
    return call


@torch.library.custom_op("tetrarec::tbe_forward", mutates_args=("out",))
def _tbe_forward_op(
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    out: torch.Tensor,
    precision: str,
    check_bounds: bool,
) -> torch.Tensor:
    """Pool this store's features into their columns of ``out`` ``(B, sum dims)``.

    Returns:
        ``(2,)`` int64 CPU tensor ``[feature, id]`` of an out-of-range id, or
        ``[-1, -1]``; ids are checked only when ``check_bounds``. The portable path
        builds it on the host from its one host read
        (``reference_batched.HOST_SYNCS_PER_CALL``).
    """
    return reference_batched.pooled_forward(
        weights, meta, values, lengths, per_sample_weights, out, precision, check_bounds
    )


@_tbe_forward_op.register_kernel("cpu")
def _tbe_forward_cpu(
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    out: torch.Tensor,
    precision: str,
    check_bounds: bool,
) -> torch.Tensor:
    ext = compiled_cpu_kernels()
    impl: Callable[..., torch.Tensor] = (
        ext.tbe_forward if ext is not None else _cpu_portable().pooled_forward
    )
    return impl(weights, meta, values, lengths, per_sample_weights, out, precision, check_bounds)


@_tbe_forward_op.register_fake
def _tbe_forward_fake(
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    out: torch.Tensor,
    precision: str,
    check_bounds: bool,
) -> torch.Tensor:
    return torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("tetrarec::tbe_backward_update", mutates_args=("weights", "states"))
def _tbe_backward_update_op(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    states: list[torch.Tensor],
    state_offsets: list[torch.Tensor],
    optimizer: str,
    hparams: list[float],
    precision: str,
    flags: list[int],
) -> torch.Tensor:
    """Turn ``grad_out`` (B, sum dims) into row updates applied in place.

    Args:
        grad_out: gradient of the pooled output.
        weights: the store's flat rows (updated in place).
        meta: see the module docstring.
        values: ids.
        lengths: bag lengths.
        per_sample_weights: optional per-id weights.
        states: flat FP32 optimizer state, one tensor per name of
            ``optim_rules.state_layout`` in its order (updated in place).
        state_offsets: ``(T,)`` first element of each table in each state tensor.
        optimizer: an ``OptimizerKind`` value.
        hparams: ``[lr, eps, beta1, beta2, weight_decay]``.
        precision: the row precision.
        flags: ``[stochastic_rounding, seed, iteration, deterministic, want_psw_grad]``.

    Returns:
        ``(N,)`` gradient w.r.t. ``per_sample_weights``, or an empty tensor.
    """
    return reference_batched.backward_update(
        grad_out, weights, meta, values, lengths, per_sample_weights, states, state_offsets,
        optimizer, hparams, precision, flags,
    )  # fmt: skip


@_tbe_backward_update_op.register_kernel("cpu")
def _tbe_backward_update_cpu(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    states: list[torch.Tensor],
    state_offsets: list[torch.Tensor],
    optimizer: str,
    hparams: list[float],
    precision: str,
    flags: list[int],
) -> torch.Tensor:
    ext = compiled_cpu_kernels()
    impl: Callable[..., torch.Tensor] = (
        ext.tbe_backward_update if ext is not None else _cpu_portable().backward_update
    )
    return impl(
        grad_out, weights, meta, values, lengths, per_sample_weights, states, state_offsets,
        optimizer, hparams, precision, flags,
    )  # fmt: skip


@_tbe_backward_update_op.register_fake
def _tbe_backward_update_fake(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    states: list[torch.Tensor],
    state_offsets: list[torch.Tensor],
    optimizer: str,
    hparams: list[float],
    precision: str,
    flags: list[int],
) -> torch.Tensor:
    n = values.numel() if per_sample_weights is not None and flags[4] else 0
    return grad_out.new_empty(n)


@torch.library.custom_op("tetrarec::tbe_row_gradient_shares", mutates_args=())
def _tbe_row_gradient_shares_op(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    table: int,
    weight_decay: float,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One table's touched rows and per-row sums of squared gradients; updates nothing.

    What a row-wise optimizer (row-wise Adagrad, row-wise Adam) sums over a row's
    columns: ``sum_d g'_d^2`` with ``g' = g + weight_decay * w``, ``g`` the row's summed
    gradient exactly as ``tbe_backward_update`` sums it (mean pooling and per-id weights
    included, duplicates in position order) and ``w`` the row's current value. A
    column-split table's blocks exchange these shares (``sharding/block_group.py``).
    The squares are added in column order: the compiled kernel's result is bitwise
    equal to ``reference.row_gradient_shares`` and to the sum its own row-wise update
    adds, and deterministic across thread counts.

    Args:
        grad_out: ``(B, sum dims)`` gradient of the pooled output.
        weights: the store's flat rows (read only: for weight decay).
        meta: see the module docstring.
        values: ids.
        lengths: bag lengths.
        per_sample_weights: optional per-id weights.
        table: the table's index in the store (``0 .. T-1``); only its features count.
        weight_decay: added to the gradient as ``weight_decay * w`` when non-zero.
        precision: the row precision.

    Returns:
        ``(rows, share)``: ``(U,)`` int64 touched rows of the table (sorted, unique,
        table-local) and ``(U,)`` FP32 sums of squares.

    Raises:
        RuntimeError: for ``table`` outside the store, or an id of the table's features
            outside the table (naming the feature's index and the id).
    """
    return reference.row_gradient_shares(
        grad_out, weights, meta, table, values, lengths, per_sample_weights,
        weight_decay, precision,
    )  # fmt: skip


@_tbe_row_gradient_shares_op.register_kernel("cpu")
def _tbe_row_gradient_shares_cpu(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    table: int,
    weight_decay: float,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    ext = compiled_cpu_kernels()
    if ext is None:
        return reference.row_gradient_shares(
            grad_out, weights, meta, table, values, lengths, per_sample_weights,
            weight_decay, precision,
        )  # fmt: skip
    shares: tuple[torch.Tensor, torch.Tensor] = ext.tbe_row_gradient_shares(
        grad_out, weights, meta, values, lengths, per_sample_weights,
        table, weight_decay, precision,
    )  # fmt: skip
    return shares


@_tbe_row_gradient_shares_op.register_fake
def _tbe_row_gradient_shares_fake(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    table: int,
    weight_decay: float,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    touched = torch.library.get_ctx().new_dynamic_size()  # data-dependent: unique ids
    return values.new_empty(touched, dtype=torch.int64), grad_out.new_empty(touched)


# -- DLRM dot interaction ---------------------------------------------------------------


@torch.library.custom_op("tetrarec::dot_interaction", mutates_args=())
def _dot_interaction_op(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """``[dense | <C_i, C_j> for i > j]`` with rows ``C = (dense, e_0, ..., e_{F-1})``.

    Args:
        dense: ``(B, D)`` bottom-MLP output.
        embeddings: ``(B, F*D)`` pooled embeddings, feature-major per sample.

    Returns:
        ``(B, D + F(F+1)/2)``; differentiable (``dot_interaction_backward``).
    """
    return reference.dot_interaction_forward(dense, embeddings)


def _compiled_dense_kernels(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled kernels, if they exist and take these tensors (contiguous FP32).

    For the dense-path ops (interaction, BF16 rounding), which take FP32 only.
    """
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return None
    return compiled_cpu_kernels()


@_dot_interaction_op.register_kernel("cpu")
def _dot_interaction_cpu(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    ext = _compiled_dense_kernels(dense, embeddings)
    if ext is None:
        return reference.dot_interaction_forward(dense, embeddings)
    out: torch.Tensor = ext.dot_interaction_forward(dense, embeddings)
    return out


@_dot_interaction_op.register_fake
def _dot_interaction_fake(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    b, d = dense.shape
    n = embeddings.shape[1] // d + 1
    return dense.new_empty(b, d + n * (n - 1) // 2)


@torch.library.custom_op("tetrarec::dot_interaction_backward", mutates_args=())
def _dot_interaction_backward_op(
    grad_out: torch.Tensor, dense: torch.Tensor, embeddings: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad dense, grad embeddings)`` of ``dot_interaction`` for ``grad_out``."""
    return reference.dot_interaction_backward(grad_out, dense, embeddings)


@_dot_interaction_backward_op.register_kernel("cpu")
def _dot_interaction_backward_cpu(
    grad_out: torch.Tensor, dense: torch.Tensor, embeddings: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ext = _compiled_dense_kernels(grad_out, dense, embeddings)
    if ext is None:
        return reference.dot_interaction_backward(grad_out, dense, embeddings)
    grads: tuple[torch.Tensor, torch.Tensor] = ext.dot_interaction_backward(
        grad_out, dense, embeddings
    )
    return grads


@_dot_interaction_backward_op.register_fake
def _dot_interaction_backward_fake(
    grad_out: torch.Tensor, dense: torch.Tensor, embeddings: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(dense), torch.empty_like(embeddings)


def _dot_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _dot_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dense, embeddings = ctx.saved_tensors
    grads: tuple[torch.Tensor, torch.Tensor] = dot_interaction_backward(
        grad_out.contiguous(), dense, embeddings
    )
    return grads


_dot_interaction_op.register_autograd(_dot_backward, setup_context=_dot_setup_context)


@torch.library.custom_op("tetrarec::dot_interaction_bf16", mutates_args=())
def _dot_interaction_bf16_op(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """``dot_interaction``'s output with BF16 products: for inference (no gradient).

    The rows ``C = (dense, e_0, ..., e_{F-1})`` are rounded to BF16 and their pairwise
    products summed in FP32; ``dense`` is copied out as it is. The portable path
    (``reference.dot_interaction_bf16_forward``) is the definition; the compiled CPU
    kernel (``_mm512_dpbf16_ps`` where the CPU has AVX512_BF16) sums the same exact
    products in another order, within the bound stated there, and treats FP32
    subnormal inputs (``|x| < 2^-126``) as zero.

    Args:
        dense: ``(B, D)`` bottom-MLP output, FP32.
        embeddings: ``(B, F*D)`` pooled embeddings, feature-major per sample, FP32.

    Returns:
        ``(B, D + F(F+1)/2)`` FP32.
    """
    return reference.dot_interaction_bf16_forward(dense, embeddings)


@_dot_interaction_bf16_op.register_kernel("cpu")
def _dot_interaction_bf16_cpu(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    ext = _compiled_dense_kernels(dense, embeddings)
    if ext is None:
        return reference.dot_interaction_bf16_forward(dense, embeddings)
    out: torch.Tensor = ext.dot_interaction_bf16_forward(dense, embeddings, True)
    return out


@_dot_interaction_bf16_op.register_fake
def _dot_interaction_bf16_fake(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    b, d = dense.shape
    n = embeddings.shape[1] // d + 1
    return dense.new_empty(b, d + n * (n - 1) // 2, dtype=torch.float32)


# -- BF16 rounding (the dense path's BF16 emulation) ---------------------------------------


@torch.library.custom_op("tetrarec::round_to_bf16_out", mutates_args=("out",))
def _round_to_bf16_out_op(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x`` rounded to the nearest BF16 value (ties to even), in ``x``'s dtype.

    ``out`` may be ``x`` (in place). The CPU kernel does it in one pass over FP32.
    """
    out.copy_(x.to(torch.bfloat16))


@_round_to_bf16_out_op.register_kernel("cpu")
def _round_to_bf16_out_cpu(x: torch.Tensor, out: torch.Tensor) -> None:
    ext = _compiled_dense_kernels(x, out)
    if ext is None:
        out.copy_(x.to(torch.bfloat16))
    else:
        ext.round_to_bf16_out(x, out)


@_round_to_bf16_out_op.register_fake
def _round_to_bf16_out_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


@torch.library.custom_op("tetrarec::copy_row_runs", mutates_args=("dst",))
def _copy_row_runs_op(src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor, rows: int) -> None:
    """Copy column runs row by row between flat row-major buffers of one dtype.

    For every row ``b < rows`` and run ``(src_offset, src_row_stride, dst_offset,
    dst_row_stride, length)`` of ``runs`` ((R, 5) int64, on the CPU, in elements)::

        dst[dst_offset + b * dst_row_stride :][:length] =
            src[src_offset + b * src_row_stride :][:length]

    Example (two rows; the 2-column run of a (2, 3) block goes to columns 1-2 of a
    (2, 4) output): ``runs = [[1, 3, 1, 4, 2]]`` copies ``src[1:3] -> dst[1:3]`` and
    ``src[4:6] -> dst[5:7]``.
    """
    _copy_row_runs_portable(src, dst, runs, rows)


def _copy_row_runs_portable(
    src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor, rows: int
) -> None:
    # as_strided's offset counts from the start of the storage, not of the tensor: a
    # view that starts inside its storage (a slice of a larger buffer) adds its own.
    s0, d0 = src.storage_offset(), dst.storage_offset()
    for so, ss, do, ds, n in runs.tolist():
        if n and rows:
            dst.as_strided((rows, n), (ds, 1), d0 + do).copy_(
                src.as_strided((rows, n), (ss, 1), s0 + so)
            )


@_copy_row_runs_op.register_kernel("cpu")
def _copy_row_runs_cpu(src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor, rows: int) -> None:
    ext = compiled_cpu_kernels() if src.is_contiguous() and dst.is_contiguous() else None
    if ext is None:
        _copy_row_runs_portable(src, dst, runs, rows)
    else:
        ext.copy_row_runs(src, dst, runs, rows)


@_copy_row_runs_op.register_fake
def _copy_row_runs_fake(
    src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor, rows: int
) -> None:
    return None


# -- rows between FP32 buffers and row stores (the mixed-precision cache) ------------------


@torch.library.custom_op("tetrarec::load_rows", mutates_args=("dst",))
def _load_rows_op(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
) -> None:
    """``dst[dst_index[j]] = decode(src[src_index[j]])``: stored rows into FP32 rows.

    The compiled kernel decodes each row with the fused kernels' codecs, bitwise equal
    to ``reference.load_rows``.

    Args:
        src: ``(E, row_width)`` contiguous rows in ``precision``.
        src_index: ``(n,)`` int64 rows of ``src``.
        dst: ``(S, D)`` contiguous FP32 rows, written in place.
        dst_index: ``(n,)`` int64 distinct rows of ``dst``.
        precision: the rows' precision (``"fp32"`` ... ``"int4"``).

    Raises:
        RuntimeError: (compiled kernel) for an index outside its buffer, another dtype or
            row width; nothing is written then.
    """
    reference.load_rows(src, src_index, dst, dst_index, precision)


@_load_rows_op.register_kernel("cpu")
def _load_rows_cpu(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
) -> None:
    ext = compiled_cpu_kernels() if src.is_contiguous() and dst.is_contiguous() else None
    if ext is None:
        reference.load_rows(src, src_index, dst, dst_index, precision)
    else:
        ext.load_rows(src, src_index, dst, dst_index, precision)


@_load_rows_op.register_fake
def _load_rows_fake(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
) -> None:
    return None


@torch.library.custom_op("tetrarec::store_rows", mutates_args=("dst",))
def _store_rows_op(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
    flags: list[int],
) -> None:
    """``dst[dst_index[j]] = encode(src[src_index[j]])``: FP32 rows into stored rows.

    Stochastic rounding draws exactly what ``tbe_backward_update`` would draw for row
    ``row_key + dst_index[j]`` at ``(seed, iteration)``; the compiled kernel encodes each
    row with the fused kernels' codecs, bitwise equal to ``reference.store_rows``.

    Args:
        src: ``(S, D)`` contiguous FP32 rows.
        src_index: ``(n,)`` int64 rows of ``src``.
        dst: ``(E, row_width)`` contiguous rows in ``precision``, written in place.
        dst_index: ``(n,)`` int64 distinct rows of ``dst``.
        precision: the stored rows' precision.
        flags: ``[stochastic, seed, iteration, row_key, col_start]``.

    Raises:
        RuntimeError: (compiled kernel) for an index outside its buffer, another dtype or
            row width; nothing is written then.
    """
    reference.store_rows(src, src_index, dst, dst_index, precision, flags)


@_store_rows_op.register_kernel("cpu")
def _store_rows_cpu(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
    flags: list[int],
) -> None:
    ext = compiled_cpu_kernels() if src.is_contiguous() and dst.is_contiguous() else None
    if ext is None:
        reference.store_rows(src, src_index, dst, dst_index, precision, flags)
    else:
        ext.store_rows(src, src_index, dst, dst_index, precision, flags)


@_store_rows_op.register_fake
def _store_rows_fake(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
    flags: list[int],
) -> None:
    return None


# -- the entry points: each op, run directly for plain eager CPU calls (_eager_cpu_path) --

tbe_forward = _eager_cpu_path(_tbe_forward_op, _tbe_forward_cpu, mutates=("out",))
tbe_backward_update = _eager_cpu_path(
    _tbe_backward_update_op, _tbe_backward_update_cpu, mutates=("weights", "states")
)
tbe_row_gradient_shares = _eager_cpu_path(_tbe_row_gradient_shares_op, _tbe_row_gradient_shares_cpu)
dot_interaction = _eager_cpu_path(_dot_interaction_op, _dot_interaction_cpu)
dot_interaction_backward = _eager_cpu_path(
    _dot_interaction_backward_op, _dot_interaction_backward_cpu
)
dot_interaction_bf16 = _eager_cpu_path(_dot_interaction_bf16_op, _dot_interaction_bf16_cpu)
round_to_bf16_out = _eager_cpu_path(_round_to_bf16_out_op, _round_to_bf16_out_cpu, mutates=("out",))
copy_row_runs = _eager_cpu_path(_copy_row_runs_op, _copy_row_runs_cpu, mutates=("dst",))
load_rows = _eager_cpu_path(_load_rows_op, _load_rows_cpu, mutates=("dst",))
store_rows = _eager_cpu_path(_store_rows_op, _store_rows_cpu, mutates=("dst",))
