"""Exact evaluation metrics for click-through-rate models.

Every metric is computed over the whole evaluated set in float64 (no sampling, no
binning), from logits ``z`` and labels ``y`` in {0, 1}:

- ``auc``: the probability that a random positive scores above a random negative,
  ties counted half (Mann-Whitney U from mid-ranks). Ranked by logit, so two logits
  that round to the same float32 probability still count as distinct.
- ``log_loss``: mean of ``-[y log p + (1 - y) log(1 - p)]`` with ``p = sigmoid(z)``,
  computed as ``log(1 + exp(z)) - y z`` so that saturated logits stay finite.
- ``ne``: normalized entropy, ``log_loss / H(ctr)`` where ``ctr = mean(y)`` and
  ``H(c) = -[c log c + (1 - c) log(1 - c)]``.
- ``calibration``: ``mean(p) / mean(y)``.
- ``accuracy``: the fraction with ``(p >= 0.5) == y``, i.e. ``z >= 0``.

Metrics that a one-class set leaves undefined (AUC, NE, calibration) are ``nan``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

__all__ = ["MetricAccumulator", "Metrics", "compute_metrics"]


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
    log_loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    ctr = float(y.mean())
    entropy = _binary_entropy(ctr)
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
