"""The ``tetrarec::`` ops: the only entry points the rest of the code calls.

Each op is defined once with ``torch.library.custom_op``; its default implementation is
the portable one in ``reference.py`` (any device), and the CPU kernel is the compiled
one from ``csrc/`` when it builds (see ``_build.py``). Callers never branch on device.

Arguments shared by both ops, for one row store (the tables of one precision)::

    weights  (sum_t rows_t * width_t,)  flat rows; table t starts at w_offsets[t]
    meta     7 int64 tensors on the weights' device:
             w_offsets (T,)  first storage element of each table
             dims      (T,)  embedding dim of each table
             num_rows  (T,)  rows of each table
             row_offsets (T,) first row of each table in the store's row numbering
             feat_table (F,) table of each feature, -1 if in another store
             feat_cols (F,)  first output column of each feature
             feat_mean (F,)  1 for mean pooling, 0 for sum
    values   (N,) ids, key-major;  lengths (F*B,) bag lengths, key-major
    per_sample_weights  optional (N,) float
    precision  "fp32" | "fp16" | "bf16" | "int8" | "int4"
"""

from __future__ import annotations

import torch

from tetrarec.kernels import reference
from tetrarec.kernels._build import compiled_cpu_kernels

__all__ = ["tbe_backward_update", "tbe_forward"]


@torch.library.custom_op("tetrarec::tbe_forward", mutates_args=("out",))
def tbe_forward(
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
        ``[-1, -1]``; ids are checked only when ``check_bounds``.
    """
    return reference.pooled_forward(
        weights, meta, values, lengths, per_sample_weights, out, precision, check_bounds
    ).cpu()


@tbe_forward.register_kernel("cpu")
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
    impl = ext.tbe_forward if ext is not None else reference.pooled_forward
    return impl(weights, meta, values, lengths, per_sample_weights, out, precision, check_bounds)


@tbe_forward.register_fake
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
def tbe_backward_update(
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
    return reference.backward_update(
        grad_out, weights, meta, values, lengths, per_sample_weights, states, state_offsets,
        optimizer, hparams, precision, flags,
    )  # fmt: skip


@tbe_backward_update.register_kernel("cpu")
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
    impl = ext.tbe_backward_update if ext is not None else reference.backward_update
    return impl(
        grad_out, weights, meta, values, lengths, per_sample_weights, states, state_offsets,
        optimizer, hparams, precision, flags,
    )  # fmt: skip


@tbe_backward_update.register_fake
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
