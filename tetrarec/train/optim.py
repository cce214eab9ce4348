"""Optimizers: dense (``torch.optim``) and sparse for the reference embedding collection.

The reference ``EmbeddingBagCollection`` produces sparse row gradients; these builders
turn a ``SparseOptimizerSpec`` into a ``torch.optim.Optimizer`` that accepts them:

=================  ==========================================================
kind               optimizer
=================  ==========================================================
sgd                ``torch.optim.SGD``
adagrad            ``torch.optim.Adagrad``
adam               ``RowRuleOptimizer`` (below): the fused rule, each row's own
                   step count in the bias correction (``torch.optim.SparseAdam``
                   counts the table's steps)
rowwise_adagrad    ``RowWiseAdagrad`` (below): one accumulator value per row
rowwise_adam       ``RowRuleOptimizer``: the fused rule, one second moment per row
=================  ==========================================================

A fused embedding module updates its rows in backward and brings its own optimizer
object (``fused_optimizer``, see ``tetrarec.kernels.FusedOptimizer``); it gets none from
here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from tetrarec.config import DenseOptimizerKind, OptimConfig
from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.kernels.optim_rules import OPTIM_RULES, state_layout
from tetrarec.types import OptimizerKind

__all__ = [
    "DENSE_OPTIMIZERS",
    "SPARSE_OPTIMIZERS",
    "RowWiseAdagrad",
    "build_dense_optimizer",
    "build_sparse_optimizer",
    "set_learning_rate",
]


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    """``torch.optim``'s closure protocol: the loss it returns, with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _touched_rows(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``(U,)`` a step touches and their gradient ``(U, D)``.

    A sparse gradient is coalesced (duplicate rows summed, row ids sorted); a dense
    one touches every row.
    """
    grad = p.grad
    assert grad is not None
    if grad.is_sparse:
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()
    return torch.arange(p.shape[0], device=p.device), grad


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for 2-D parameters, with sparse or dense gradients.

    For every touched row ``r`` with gradient ``g_r`` (duplicates summed first)::

        g_r   <- g_r + weight_decay * w_r
        s_r   <- s_r + mean(g_r ** 2)              # one state value per row
        w_r   <- w_r - lr * g_r / (sqrt(s_r) + eps)

    Rows absent from a sparse gradient are left unchanged (weight decay included).
    A dense gradient touches every row.

    Args:
        params: ``(rows, dim)`` parameters.
        lr: learning rate.
        eps: added to the denominator.
        weight_decay: L2 penalty on the touched rows.
        initial_accumulator: the starting value of ``s``.

    Raises:
        ValueError: on a negative setting or a parameter that is not 2-D.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        lr: float = 0.01,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        initial_accumulator: float = 0.0,
    ) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0 or initial_accumulator < 0:
            raise ValueError(
                f"RowWiseAdagrad: bad settings lr={lr} eps={eps} "
                f"weight_decay={weight_decay} initial_accumulator={initial_accumulator}"
            )
        defaults = {
            "lr": lr,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator": initial_accumulator,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"RowWiseAdagrad needs 2-D parameters, got {tuple(p.shape)}")
                self.state[p]["sum"] = torch.full(
                    (p.shape[0],), float(group["initial_accumulator"]), dtype=p.dtype
                ).to(p.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's overloads
        """Apply one update to every parameter that has a gradient."""
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, float]) -> None:
        rows, g = _touched_rows(p)
        if group["weight_decay"] != 0:
            g = g + group["weight_decay"] * p.index_select(0, rows)
        acc = self.state[p]["sum"]
        acc.index_add_(0, rows, g.pow(2).mean(dim=1))
        std = acc.index_select(0, rows).sqrt_().add_(group["eps"])  # (U,)
        p.index_add_(0, rows, g / std.unsqueeze(1), alpha=-group["lr"])


class RowRuleOptimizer(torch.optim.Optimizer):
    """A fused embedding's update rule (``kernels.optim_rules``) as a ``torch.optim``.

    For 2-D parameters with sparse or dense gradients: the reference embedding's oracle
    for the rules torch has no equal of. Adam as the fused embedding applies it ("lazy"
    Adam, whose bias correction counts each row's own steps; ``torch.optim.SparseAdam``
    counts the table's, so a row that had skipped steps took another step size), and
    row-wise Adam. The same function updates the touched rows here and in the fused
    module's portable kernel, so the two paths train the same rows. Weight decay is the
    rules' lazy L2.

    Args:
        params: ``(rows, dim)`` parameters.
        spec: the rule and its settings; the learning rate is the group's ``lr``
            (``set_learning_rate``), the other settings the group's too.

    Raises:
        ValueError: if a parameter is not 2-D.
    """

    def __init__(self, params: Iterable[nn.Parameter], spec: SparseOptimizerSpec) -> None:
        settings = dataclasses.asdict(spec)
        self.kind = OptimizerKind(settings.pop("kind"))
        super().__init__(params, settings)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"{self.kind.value} needs 2-D parameters, got {tuple(p.shape)}"
                    )
                for name, width in state_layout(self.kind, p.shape[1]).items():
                    self.state[p][name] = torch.zeros(
                        p.shape[0], width, dtype=torch.float32, device=p.device
                    )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a saved state, refusing one of another layout.

        Raises:
            ValueError: if a parameter's saved state is not this rule's (names and
                shapes): for example ``torch.optim.SparseAdam``'s, which the reference
                embedding's Adam used before, with one step count for the table.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, saved_ids, strict=True):
            want = {k: (p.shape[0], w) for k, w in state_layout(self.kind, p.shape[1]).items()}
            saved = state_dict["state"].get(i, {})
            got = {k: tuple(getattr(v, "shape", ())) for k, v in saved.items()}
            if got != want:
                raise ValueError(
                    f"the saved {self.kind.value} state does not fit this optimizer (got {got}, "
                    f"expected {want}): it was written by another optimizer (the reference "
                    "embedding's Adam was torch.optim.SparseAdam before), so start a new run"
                )
        super().load_state_dict(state_dict)
        # torch leaves a state named "step" where and as it was loaded (its own is a
        # scalar count kept on the host); this rule's "step" is a per-row FP32 column like
        # the moments, so it joins its parameter's device: a resume on CUDA indexed a
        # host copy with the device's row ids.
        for p in params:
            for k, v in self.state[p].items():
                self.state[p][k] = v.to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's overloads
        """Apply one update to the touched rows of every parameter with a gradient."""
        loss = _closure_loss(closure)
        rule = OPTIM_RULES[self.kind]
        for group in self.param_groups:
            spec = SparseOptimizerSpec(
                kind=self.kind, **{k: v for k, v in group.items() if k != "params"}
            )
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, g = _touched_rows(p)
                g, w = g.float(), p.index_select(0, rows).float()
                state = {k: v.index_select(0, rows) for k, v in self.state[p].items()}
                rule(w, g, state, spec, spec.lr)
                p.index_copy_(0, rows, w.to(p.dtype))
                for k, v in state.items():
                    self.state[p][k].index_copy_(0, rows, v)
        return loss


def _sgd(params: Sequence[nn.Parameter], spec: SparseOptimizerSpec) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec.lr)


def _adagrad(params: Sequence[nn.Parameter], spec: SparseOptimizerSpec) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(
        params, lr=spec.lr, eps=spec.eps, initial_accumulator_value=spec.initial_accumulator
    )


def _row_rule(params: Sequence[nn.Parameter], spec: SparseOptimizerSpec) -> torch.optim.Optimizer:
    return RowRuleOptimizer(params, spec)


def _rowwise_adagrad(
    params: Sequence[nn.Parameter], spec: SparseOptimizerSpec
) -> torch.optim.Optimizer:
    return RowWiseAdagrad(
        params,
        lr=spec.lr,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        initial_accumulator=spec.initial_accumulator,
    )


SparseBuilder = Callable[[Sequence[nn.Parameter], SparseOptimizerSpec], torch.optim.Optimizer]

SPARSE_OPTIMIZERS: dict[OptimizerKind, SparseBuilder] = {
    OptimizerKind.SGD: _sgd,
    OptimizerKind.ADAGRAD: _adagrad,
    OptimizerKind.ADAM: _row_rule,
    OptimizerKind.ROWWISE_ADAGRAD: _rowwise_adagrad,
    OptimizerKind.ROWWISE_ADAM: _row_rule,
}

# torch's sparse-gradient optimizers reject weight decay; only our own rules apply it.
_SPARSE_WEIGHT_DECAY = frozenset(
    {OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM, OptimizerKind.ROWWISE_ADAM}
)


def build_sparse_optimizer(
    spec: SparseOptimizerSpec, params: Sequence[nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer for the sparse-gradient embedding ``params`` described by ``spec``.

    Raises:
        ValueError: if ``spec.kind`` has no sparse-gradient implementation, or asks for
            weight decay that the implementation cannot apply.
    """
    builder = SPARSE_OPTIMIZERS.get(spec.kind)
    if builder is None:
        valid = ", ".join(k.value for k in SPARSE_OPTIMIZERS)
        raise ValueError(
            f"sparse optimizer {spec.kind.value!r} is not available for the reference "
            f"embedding (valid: {valid}); use model.embedding = 'fused'"
        )
    if spec.weight_decay and spec.kind not in _SPARSE_WEIGHT_DECAY:
        raise ValueError(
            f"sparse optimizer {spec.kind.value!r} on the reference embedding cannot apply "
            f"weight_decay={spec.weight_decay}; use rowwise_adagrad or the fused embedding"
        )
    return builder(params, spec)


DenseBuilder = Callable[[Sequence[nn.Parameter], OptimConfig], torch.optim.Optimizer]

DENSE_OPTIMIZERS: dict[DenseOptimizerKind, DenseBuilder] = {
    DenseOptimizerKind.SGD: lambda ps, c: torch.optim.SGD(
        ps, lr=c.dense_lr, weight_decay=c.dense_weight_decay
    ),
    DenseOptimizerKind.ADAGRAD: lambda ps, c: torch.optim.Adagrad(
        ps, lr=c.dense_lr, eps=c.dense_eps, weight_decay=c.dense_weight_decay
    ),
    DenseOptimizerKind.ADAM: lambda ps, c: torch.optim.Adam(
        ps, lr=c.dense_lr, eps=c.dense_eps, weight_decay=c.dense_weight_decay
    ),
}


def build_dense_optimizer(
    config: OptimConfig, params: Sequence[nn.Parameter]
) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer for the dense (MLP) ``params``."""
    return DENSE_OPTIMIZERS[config.dense](params, config)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of ``optimizer``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
