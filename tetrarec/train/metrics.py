"""Exact evaluation metrics for click-through-rate models.

Every metric is computed over the whole evaluated set in float64 (no sampling, no
binning), from logits ``z`` and labels ``y`` in {0, 1}:

- ``auc``: the probability that a random positive scores above a random negative,
  ties counted half (Mann-Whitney U from mid-ranks). Ranked by logit, so two logits
  that round to the same float32 probability still count as distinct.
- ``log_loss``: mean of ``-[y log p + (1 - y) log(1 - p)]`` with ``p = sigmoid(z)``,
  computed as ``log(1 + exp(-z))`` for a positive and ``log(1 + exp(z))`` for a
  negative, so that saturated logits stay exact (an infinite logit on the right side
  costs 0, on the wrong side ``inf``).
- ``ne``: normalized entropy, ``log_loss / H(ctr)`` where ``ctr = mean(y)`` and
  ``H(c) = -[c log c + (1 - c) log(1 - c)]``.
- ``calibration``: ``mean(p) / mean(y)``.
- ``accuracy``: the fraction with ``(p >= 0.5) == y``, i.e. ``z >= 0``.

Metrics that a one-class set leaves undefined (AUC, NE, calibration) are ``nan``. A
``nan`` logit (a model whose output overflowed) makes every metric but ``num_samples``
and ``ctr`` ``nan``, with a warning: a ranking or a loss over undefined predictions
means nothing (sorted naively, the ``nan`` rows would rank above every other and could
score an AUC of 1).

Calibration is well within ``CALIBRATION_BOUNDS`` = [0.8, 1.25] for a model whose
average prediction is within 20-25% of the observed CTR (the bounds are symmetric in
ratio: 1/1.25 = 0.8). Outside them ``miscalibration`` says in which direction, and the
training loop and ``tetrarec eval`` log it as a warning: a model can rank well (high AUC)
and still predict CTRs far from the observed ones, which matters wherever the
probabilities themselves are used (bidding, expected-value ranking).

``BestEval`` follows the best evaluation of a run by one metric (``train.keep_best``):
AUC higher is better, log loss lower is better, a tie is not an improvement (the
earlier evaluation stays best), and ``nan`` never improves.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from tetrarec.config import BestMetric

__all__ = [
    "CALIBRATION_BOUNDS",
    "BestEval",
    "MetricAccumulator",
    "Metrics",
    "compute_metrics",
    "is_improvement",
    "miscalibration",
]

logger = logging.getLogger(__name__)

# Calibration outside [low, high] is reported as miscalibrated (see the module docstring).
CALIBRATION_BOUNDS = (0.8, 1.25)


@dataclass(frozen=True, kw_only=True)
class Metrics:
    """Metrics of one evaluation (see the module docstring for the formulas).

    Args:
        auc: area under the ROC curve.
        ne: normalized entropy.
        log_loss: mean binary cross-entropy (natural log).
        calibration: mean predicted CTR over observed CTR.
        accuracy: fraction classified right at threshold 0.5.
        num_samples: samples evaluated.
        ctr: observed CTR (mean label).
    """

    auc: float
    ne: float
    log_loss: float
    calibration: float
    accuracy: float
    num_samples: int
    ctr: float

    def to_dict(self) -> dict[str, float | int]:
        """Plain ``{name: value}`` for JSON and logs."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Metrics:
        """Inverse of ``to_dict``; a ``null`` metric is ``nan``.

        JSON has no NaN: the files tetrarec writes hold a NaN metric (the AUC of
        evaluation rows with one label) as ``null`` (``tetrarec.jsonio``).

        Raises:
            ValueError: if a metric is missing or unknown.
        """
        try:
            plain: dict[str, Any] = {k: math.nan if v is None else v for k, v in values.items()}
            return cls(**plain)
        except (TypeError, AttributeError) as e:  # not a dict, or a key missing or unknown
            raise ValueError(f"not a Metrics dict ({e}): {values}") from e

    def summary(self) -> str:
        """One line: ``AUC 0.7512  NE 0.8731  log loss 0.4810 ...``."""
        return (
            f"AUC {self.auc:.4f}  NE {self.ne:.4f}  log loss {self.log_loss:.4f}  "
            f"calibration {self.calibration:.4f}  accuracy {self.accuracy:.4f}  "
            f"({self.num_samples} samples)"
        )


def _auc(z: np.ndarray, y: np.ndarray) -> float:
    """Mann-Whitney AUC with mid-ranks for ties; ``nan`` for a one-class set."""
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(z, kind="stable")
    zs = z[order]
    # Ranks 1..n; a run of equal scores gets the mean of its ranks.
    starts = np.flatnonzero(np.r_[True, zs[1:] != zs[:-1]])
    ends = np.r_[starts[1:], zs.size]  # exclusive
    mid = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(zs.size, dtype=np.float64)
    ranks[order] = np.repeat(mid, ends - starts)
    u = ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _binary_entropy(c: float) -> float:
    if c <= 0.0 or c >= 1.0:
        return 0.0
    return -(c * math.log(c) + (1.0 - c) * math.log(1.0 - c))


def compute_metrics(
    logits: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray
) -> Metrics:
    """Compute every metric over ``(N,)`` logits and ``(N,)`` labels in {0, 1}.

    Raises:
        ValueError: on mismatched or empty inputs, or labels outside {0, 1}.
    """
    z = np.asarray(torch.as_tensor(logits).detach().cpu().double().numpy()).reshape(-1)
    y = np.asarray(torch.as_tensor(labels).detach().cpu().double().numpy()).reshape(-1)
    if z.shape != y.shape:
        raise ValueError(f"{z.size} logits but {y.size} labels")
    if z.size == 0:
        raise ValueError("cannot compute metrics over 0 samples")
    if not np.all((y == 0.0) | (y == 1.0)):
        bad = y[(y != 0.0) & (y != 1.0)][:5].tolist()
        raise ValueError(f"labels must be 0 or 1, got {bad}")
    ctr = float(y.mean())
    entropy = _binary_entropy(ctr)
    undefined = np.isnan(z)
    if undefined.any():
        logger.warning(
            "%d of %d logits are nan (the model's output overflowed): every metric is nan",
            int(undefined.sum()),
            z.size,
        )
        nan = math.nan
        return Metrics(
            auc=nan, ne=nan, log_loss=nan, calibration=nan, accuracy=nan,
            num_samples=int(z.size), ctr=ctr,
        )  # fmt: skip
    # -log sigmoid(z) for a positive, -log sigmoid(-z) for a negative: exact at +-inf.
    log_loss = float(np.mean(np.logaddexp(0.0, np.where(y == 1.0, -z, z))))
    mean_p = float(np.mean(0.5 * (1.0 + np.tanh(0.5 * z))))  # sigmoid, no overflow
    return Metrics(
        auc=_auc(z, y),
        ne=log_loss / entropy if entropy > 0 else math.nan,
        log_loss=log_loss,
        calibration=mean_p / ctr if ctr > 0 else math.nan,
        accuracy=float(np.mean((z >= 0.0) == (y == 1.0))),
        num_samples=int(z.size),
        ctr=ctr,
    )


class MetricAccumulator:
    """Collects logits and labels batch by batch; ``compute()`` is exact over all.

    Example:
        >>> acc = MetricAccumulator()
        >>> acc.update(torch.tensor([2.0, -1.0]), torch.tensor([1.0, 0.0]))
        >>> acc.compute().auc
        1.0
    """

    def __init__(self) -> None:
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch of ``(B,)`` logits and ``(B,)`` labels."""
        self._logits.append(logits.detach().reshape(-1).to("cpu", torch.float64))
        self._labels.append(labels.detach().reshape(-1).to("cpu", torch.float64))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, labels)`` added so far, FP64, in order (empty tensors if none)."""
        if not self._logits:
            empty = torch.zeros(0, dtype=torch.float64)
            return empty, empty.clone()
        return torch.cat(self._logits), torch.cat(self._labels)

    def compute(self) -> Metrics:
        """Metrics over everything added so far.

        Raises:
            ValueError: if nothing was added.
        """
        if not self._logits:
            raise ValueError("no batches were evaluated")
        return compute_metrics(torch.cat(self._logits), torch.cat(self._labels))


def miscalibration(metrics: Metrics) -> str | None:
    """Why ``metrics`` count as miscalibrated, or ``None`` when calibration is fine.

    Calibration (mean predicted CTR over observed CTR) outside ``CALIBRATION_BOUNDS``
    is miscalibrated: above, the model over-predicts the CTR; below, it under-predicts.
    A ``nan`` calibration (no positive label) is not judged.

    Example:
        >>> m = Metrics(auc=0.7, ne=0.9, log_loss=0.5, calibration=1.6, accuracy=0.7,
        ...             num_samples=10, ctr=0.2)
        >>> miscalibration(m).split(": ")[1]
        'the model over-predicts the CTR (mean prediction 0.3200, observed 0.2000)'
    """
    low, high = CALIBRATION_BOUNDS
    c = metrics.calibration
    if math.isnan(c) or low <= c <= high:
        return None
    direction = "over-predicts" if c > high else "under-predicts"
    return (
        f"calibration {c:.3f} is outside [{low}, {high}]: the model {direction} the CTR "
        f"(mean prediction {c * metrics.ctr:.4f}, observed {metrics.ctr:.4f})"
    )


def is_improvement(metric: BestMetric, value: float, best: float | None) -> bool:
    """Whether ``value`` of ``metric`` improves on ``best`` (``None``: nothing yet).

    Higher is better for AUC, lower for log loss; a tie is not an improvement and a
    ``nan`` never is one (nor can a ``nan`` best be improved on: it is never kept).
    """
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best if metric.higher_is_better else value < best


@dataclass(frozen=True, kw_only=True)
class BestEval:
    """The best evaluation of a run so far, by one metric (``train.keep_best``).

    Saved in every checkpoint's meta (``to_dict``), so that a resumed run keeps the
    same best, and the same count of evaluations without improvement, as a run that was
    never interrupted.

    Args:
        metric: the metric evaluations are ranked by.
        step: the step of the best evaluation (``None`` before any improved).
        metrics: its metrics.
        since: consecutive evaluations since then that did not improve on it (all of
            them, when none ever did).
        last_step: the step of the last evaluation seen (``-1``: none); another
            evaluation of that same step (a resumed run evaluating its start again)
            is not counted twice.

    Example:
        >>> best = BestEval(metric=BestMetric.AUC)
        >>> m = Metrics(auc=0.7, ne=0.9, log_loss=0.5, calibration=1.0, accuracy=0.7,
        ...             num_samples=10, ctr=0.2)
        >>> best = best.update(2, m).update(4, replace(m, auc=0.6))
        >>> best.step, best.since
        (2, 1)
    """

    metric: BestMetric
    step: int | None = None
    metrics: Metrics | None = None
    since: int = 0
    last_step: int = -1

    def value(self, metrics: Metrics) -> float:
        """The ranked metric's value in ``metrics``."""
        return float(getattr(metrics, self.metric.value))

    def update(self, step: int, metrics: Metrics) -> BestEval:
        """The state after an evaluation at ``step`` gave ``metrics``.

        Returns ``self`` for a step already seen; otherwise a new ``BestEval``: best
        at ``step`` if it improved (``since`` back to 0), else ``since`` one higher.
        """
        if step <= self.last_step:
            return self
        best = None if self.metrics is None else self.value(self.metrics)
        if is_improvement(self.metric, self.value(metrics), best):
            return replace(self, step=step, metrics=metrics, since=0, last_step=step)
        return replace(self, since=self.since + 1, last_step=step)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint's meta and the JSON summary."""
        return {
            "metric": self.metric.value,
            "step": self.step,
            "metrics": self.metrics.to_dict() if self.metrics is not None else None,
            "since": self.since,
            "last_step": self.last_step,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BestEval:
        """Inverse of ``to_dict``.

        Raises:
            ValueError: on a malformed dict.
        """
        try:
            metrics = values["metrics"]
            return cls(
                metric=BestMetric(values["metric"]),
                step=None if values["step"] is None else int(values["step"]),
                metrics=None if metrics is None else Metrics.from_dict(metrics),
                since=int(values["since"]),
                last_step=int(values["last_step"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a BestEval dict ({e!r}): {values}") from e
