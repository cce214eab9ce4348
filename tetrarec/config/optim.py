"""``[optim]``: the dense and sparse optimizers and the learning-rate schedule."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from tetrarec.embedding import SparseOptimizerSpec

__all__ = ["DecayKind", "DenseOptimizerKind", "OptimConfig"]


class DenseOptimizerKind(enum.Enum):
    """The ``torch.optim`` optimizer of the dense (MLP) parameters."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAM = "adam"


class DecayKind(enum.Enum):
    """The learning-rate decay after warm-up (see ``tetrarec.train.schedule``)."""

    NONE = "none"
    LINEAR = "linear"
    COSINE = "cosine"


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Dense and sparse optimizers and the learning-rate schedule.

    Args:
        dense: the dense optimizer.
        dense_lr: its base learning rate.
        dense_eps: its epsilon (Adagrad, Adam).
        dense_weight_decay: its L2 penalty.
        sparse: the embedding optimizer (its ``lr`` is the sparse base learning rate).
        warmup_steps: steps of linear warm-up from ``1/warmup_steps`` to 1.
        decay: the decay shape after ``decay_start``.
        decay_start: the 0-based step where decay starts from the full rate: its scale
            is still 1 (``lr_scale``), so the first step with a lower rate is
            ``decay_start + 1``.
        decay_steps: steps from ``decay_start`` to ``min_lr_scale`` (first reached at
            step ``decay_start + decay_steps``).
        min_lr_scale: the final fraction of the base learning rates.

    Raises:
        ValueError: on negative settings.
    """

    dense: DenseOptimizerKind = DenseOptimizerKind.ADAGRAD
    dense_lr: float = 0.01
    dense_eps: float = 1e-8
    dense_weight_decay: float = 0.0
    sparse: SparseOptimizerSpec = field(default_factory=SparseOptimizerSpec)
    warmup_steps: int = 0
    decay: DecayKind = DecayKind.NONE
    decay_start: int = 0
    decay_steps: int = 0
    min_lr_scale: float = 0.0

    def __post_init__(self) -> None:
        bad = {
            k: getattr(self, k)
            for k in ("dense_lr", "dense_weight_decay", "warmup_steps", "decay_start")
            if not 0 <= getattr(self, k) < math.inf  # nan and inf too
        }
        if not 0 < self.dense_eps < math.inf:
            bad["dense_eps"] = self.dense_eps
        if self.decay is not DecayKind.NONE and self.decay_steps <= 0:
            bad["decay_steps"] = self.decay_steps
        if not 0.0 <= self.min_lr_scale <= 1.0:
            bad["min_lr_scale"] = self.min_lr_scale
        if bad:
            rules = {
                "dense_eps": "dense_eps > 0 and finite",
                "decay_steps": f"decay = {self.decay.value} needs decay_steps > 0",
                "min_lr_scale": "min_lr_scale in [0, 1]",
            }
            why = "; ".join(dict.fromkeys(rules.get(k, f"{k} >= 0") for k in bad))
            raise ValueError(f"bad optim settings {bad} ({why})")
