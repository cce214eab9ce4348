r"""Learning-rate schedule: linear warm-up, then optional linear or cosine decay.

The schedule is a pure function of the step, so a resumed run recomputes it exactly::

    scale
    1.0 |      ________
        |     /        \__            warmup_steps = 4, decay_start = 8,
        |    /             \__         decay_steps = 8, min_lr_scale = 0.25
   0.25 |   /                  \______
        +---+---+-------+-------+------ step
            0   4       8       16

The learning rate at step ``s`` (0-based) is ``base_lr * lr_scale(s, config)``; it
applies to the dense and the sparse optimizer alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tetrarec.config import DecayKind, OptimConfig

__all__ = ["DECAYS", "lr_scale"]


def _no_decay(progress: float, floor: float) -> float:
    return 1.0


def _linear(progress: float, floor: float) -> float:
    return 1.0 - (1.0 - floor) * progress


def _cosine(progress: float, floor: float) -> float:
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


DECAYS: dict[DecayKind, Callable[[float, float], float]] = {
    DecayKind.NONE: _no_decay,
    DecayKind.LINEAR: _linear,
    DecayKind.COSINE: _cosine,
}


def lr_scale(step: int, config: OptimConfig) -> float:
    """The factor on the base learning rates for 0-based ``step``.

    Warm-up: ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps.
    Decay: from 1 at ``decay_start`` (so step ``decay_start + 1`` is the first one
    lowered) over ``decay_steps`` steps down to ``min_lr_scale``, reached at step
    ``decay_start + decay_steps`` and kept. The two multiply if they overlap.
    """
    scale = 1.0
    if step < config.warmup_steps:
        scale = (step + 1) / config.warmup_steps
    if config.decay is not DecayKind.NONE and step >= config.decay_start:
        span = max(config.decay_steps, 1)
        progress = min(1.0, (step - config.decay_start) / span)
        scale *= DECAYS[config.decay](progress, config.min_lr_scale)
    return scale
