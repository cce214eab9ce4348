"""Fused sparse optimizer rules as pure functions on the touched rows.

Each rule updates ``U`` unique rows in place, given their summed gradient::

    w      (U, D) FP32 rows (decoded), updated in place
    g      (U, D) FP32 gradient, duplicates of an id already summed
    state  {name: (U, width)} FP32 state of those rows, updated in place
           (widths from ``state_layout``; "step" is the per-row step count)

Weight decay is L2, added to the gradient as in ``torch.optim``: ``g' = g + wd * w``.
The rules are the published ones: SGD, Adagrad (Duchi et al.), Adam (Kingma and Ba),
and FBGEMM's row-wise variants, which keep one second-moment value per row (the mean of
``g'^2`` over the row). Adam's bias correction uses the row's own step count, so a
row's first update is always corrected as a first step ("lazy" Adam); on a table
whose rows are all touched every step this is exactly ``torch.optim.Adam``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.types import OptimizerKind

__all__ = ["OPTIM_RULES", "OptimRule", "state_layout"]

OptimRule = Callable[
    [torch.Tensor, torch.Tensor, dict[str, torch.Tensor], SparseOptimizerSpec, float], None
]


def state_layout(kind: OptimizerKind, dim: int) -> dict[str, int]:
    """State names and widths per row, including ``"step"`` for rules that count steps.

    >>> state_layout(OptimizerKind.ROWWISE_ADAM, 8)
    {'exp_avg': 8, 'exp_avg_sq': 1, 'step': 1}
    """
    layout = dict(kind.state_layout(dim))
    if kind.counts_steps:
        layout["step"] = 1
    return layout


def _decayed(w: torch.Tensor, g: torch.Tensor, spec: SparseOptimizerSpec) -> torch.Tensor:
    return g + spec.weight_decay * w if spec.weight_decay else g


def _sgd(
    w: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    spec: SparseOptimizerSpec,
    lr: float,
) -> None:
    w.add_(_decayed(w, g, spec), alpha=-lr)


def _adagrad(
    w: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    spec: SparseOptimizerSpec,
    lr: float,
) -> None:
    g = _decayed(w, g, spec)
    acc = state["sum"]  # (U, D)
    acc.addcmul_(g, g)
    w.addcdiv_(g, acc.sqrt().add_(spec.eps), value=-lr)


def _rowwise_adagrad(
    w: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    spec: SparseOptimizerSpec,
    lr: float,
) -> None:
    g = _decayed(w, g, spec)
    acc = state["sum"]  # (U, 1)
    acc.add_((g * g).mean(dim=1, keepdim=True))
    w.sub_(g * (lr / (acc.sqrt() + spec.eps)))


def _adam_moments(
    w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], spec: SparseOptimizerSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advance step and moments; return (exp_avg, exp_avg_sq, bc1, sqrt(bc2)), (U, 1) bcs."""
    g = _decayed(w, g, spec)
    step = state["step"]  # (U, 1)
    step.add_(1)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(g, 1 - spec.beta1)
    g2 = g * g if v.shape[1] == g.shape[1] else (g * g).mean(dim=1, keepdim=True)
    v.mul_(spec.beta2).add_(g2, alpha=1 - spec.beta2)
    bc1 = 1 - torch.pow(spec.beta1, step.double())
    bc2_sqrt = (1 - torch.pow(spec.beta2, step.double())).sqrt()
    return m, v, bc1, bc2_sqrt


def _adam(
    w: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    spec: SparseOptimizerSpec,
    lr: float,
) -> None:
    m, v, bc1, bc2_sqrt = _adam_moments(w, g, state, spec)
    denom = (v.sqrt() / bc2_sqrt.float()).add_(spec.eps)
    w.sub_(m / denom * (lr / bc1).float())


OPTIM_RULES: dict[OptimizerKind, OptimRule] = {
    OptimizerKind.SGD: _sgd,
    OptimizerKind.ADAGRAD: _adagrad,
    OptimizerKind.ROWWISE_ADAGRAD: _rowwise_adagrad,
    OptimizerKind.ADAM: _adam,
    # The row-wise variant shares the rule: exp_avg_sq is (U, 1) and broadcasts.
    OptimizerKind.ROWWISE_ADAM: _adam,
}
