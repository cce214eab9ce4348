"""The baseline every recipe must beat: L2-regularized logistic regression, tuned.

The regression sees the same features as the DLRM it is compared with: the transformed
dense values of the run's dataset and one indicator per hashed id (table row) of every
sparse feature, i.e. the rows the DLRM's tables would look up. With ``x`` those
features (a sparse row; a multi-hot bag contributes one indicator per id) it fits

    logit = w . x + b
    minimize   C * sum_i [log(1 + exp(z_i)) - y_i z_i]  +  ||w||^2 / 2

(scikit-learn's ``LogisticRegression(C=C)`` objective: the intercept ``b`` is not
penalized) to convergence with full-batch L-BFGS in float64. ``C`` is chosen from a grid
by the log loss on a validation slice: the *last* ``valid_fraction`` of the training
rows (file order) are held out, a model is fitted on the rest for each ``C``, and the
best ``C`` is refitted on all the training rows. Evaluation rows are never seen.

Written here (torch only) so that the comparison needs no optional dependency; it
solves the same convex problem as scikit-learn's lbfgs solver, so both reach the same
optimum up to the solvers' tolerances (``tests/unit/test_benchmarks_logreg.py`` checks
the optimality conditions, not a timing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tetrarec.data import Dataset
from tetrarec.sparse import Batch
from tetrarec.train import Metrics, compute_metrics

__all__ = [
    "C_GRID",
    "Features",
    "LogRegFit",
    "Tuned",
    "features_of",
    "fit_each_c",
    "fit_logreg",
    "tune_logreg",
]

C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


@dataclass(frozen=True)
class Features:
    """A sparse design matrix (coordinate form, rows in order) and its labels.

    Column ``j < D`` is dense value ``j``; then one column per row of every table
    (feature ``f``'s id ``i`` is column ``D + offset_f + i``).

    Args:
        row: ``(nnz,)`` int64 row of each entry, non-decreasing.
        col: ``(nnz,)`` int64 column of each entry.
        val: ``(nnz,)`` float64 value of each entry (a repeated id of a bag adds up).
        y: ``(N,)`` float64 labels in {0, 1}.
        num_cols: ``P``.
    """

    row: torch.Tensor
    col: torch.Tensor
    val: torch.Tensor
    y: torch.Tensor
    num_cols: int

    @property
    def rows(self) -> int:
        return int(self.y.shape[0])

    def matvec(self, w: torch.Tensor) -> torch.Tensor:
        """``X w``, ``(N,)``."""
        out = torch.zeros(self.rows, dtype=torch.float64)
        return out.index_add_(0, self.row, self.val * w[self.col])

    def rmatvec(self, r: torch.Tensor) -> torch.Tensor:
        """``X^T r``, ``(P,)``."""
        out = torch.zeros(self.num_cols, dtype=torch.float64)
        return out.index_add_(0, self.col, self.val * r[self.row])

    def take(self, start: int, stop: int) -> Features:
        """Rows ``[start, stop)``, renumbered from 0."""
        lo, hi = torch.searchsorted(self.row, torch.tensor([start, stop])).tolist()
        return Features(
            self.row[lo:hi] - start,
            self.col[lo:hi],
            self.val[lo:hi],
            self.y[start:stop],
            self.num_cols,
        )

    def used_columns(self) -> torch.Tensor:
        """The columns with an entry, sorted."""
        return torch.unique(self.col)

    def on_columns(self, columns: torch.Tensor) -> Features:
        """The design restricted to ``columns`` (sorted), renumbered ``0..len-1``.

        A column without any training entry has weight 0 at the optimum (its gradient
        is the penalty's, ``w``), so fitting on the used columns only is exact; an
        evaluation row's entries in other columns then contribute 0.
        """
        pos = torch.searchsorted(columns, self.col).clamp_(max=max(len(columns) - 1, 0))
        keep = columns[pos] == self.col
        return Features(self.row[keep], pos[keep], self.val[keep], self.y, len(columns))


def _design(batch: Batch, table_rows: Sequence[int]) -> Features:
    sf = batch.sparse
    n, d = batch.batch_size, int(batch.dense.shape[1])
    offsets = np.concatenate([[0], np.cumsum(table_rows)[:-1]]).astype(np.int64) + d
    lengths = sf.lengths.view(len(sf.keys), n).numpy().reshape(-1)  # (F*B,) key-major
    ids = sf.values.numpy().astype(np.int64)
    feat_of_id = np.repeat(np.repeat(np.arange(len(sf.keys)), n), lengths)
    sample_of_id = np.repeat(np.tile(np.arange(n), len(sf.keys)), lengths)
    rows = np.concatenate([np.repeat(np.arange(n), d), sample_of_id])
    cols = np.concatenate([np.tile(np.arange(d), n), offsets[feat_of_id] + ids])
    vals = np.concatenate([batch.dense.numpy().astype(np.float64).reshape(-1), np.ones(ids.size)])
    num_cols = d + int(sum(table_rows))
    # Sort by (row, col) and add up repeated entries (an id twice in one bag).
    key = rows * num_cols + cols
    uniq, inverse = np.unique(key, return_inverse=True)
    summed = np.zeros(uniq.size)
    np.add.at(summed, inverse, vals)
    return Features(
        torch.from_numpy(uniq // num_cols),
        torch.from_numpy(uniq % num_cols),
        torch.from_numpy(summed),
        batch.labels.double(),
        num_cols,
    )


def features_of(dataset: Dataset, table_rows: Sequence[int]) -> Features:
    """The design matrix of every row of ``dataset`` (rows in order)."""
    return _design(dataset.read(np.arange(dataset.num_samples)), table_rows)


@dataclass(frozen=True)
class LogRegFit:
    """A fitted regression.

    Args:
        c: the inverse regularization strength it was fitted with.
        w: ``(P,)`` weights.
        b: the intercept.
        iterations: L-BFGS iterations used.
        grad_norm: the objective's gradient norm (max abs) at the end.
    """

    c: float
    w: torch.Tensor
    b: float
    iterations: int
    grad_norm: float

    def logits(self, f: Features) -> torch.Tensor:
        return f.matvec(self.w) + self.b

    def metrics(self, f: Features) -> Metrics:
        return compute_metrics(self.logits(f).float(), f.y.float())


def _objective(f: Features, c: float, wb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(objective, gradient)`` at ``wb = [w, b]``."""
    w, b = wb[:-1], wb[-1]
    z = f.matvec(w) + b
    loss = c * (torch.nn.functional.softplus(z) - f.y * z).sum() + 0.5 * w.dot(w)
    r = c * (torch.sigmoid(z) - f.y)  # (N,) d objective / d z
    grad = torch.cat([f.rmatvec(r) + w, r.sum().reshape(1)])
    return loss, grad


def fit_logreg(f: Features, c: float, *, max_iter: int = 1000, tol: float = 1e-7) -> LogRegFit:
    """Minimize the module docstring's objective for one ``c``.

    Fits on the columns with a training entry only (exact, see
    ``Features.on_columns``). Stops when the gradient's largest component is below
    ``tol * max(1, c * N)`` (relative: the data term grows with ``c`` and the rows) or
    after ``max_iter`` L-BFGS iterations.
    """
    columns = f.used_columns()
    g = f.on_columns(columns)
    wb = torch.zeros(g.num_cols + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [wb],
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=tol * max(1.0, c * g.rows),
        tolerance_change=0.0,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        loss, grad = _objective(g, c, wb.detach())
        wb.grad = grad
        return loss

    opt.step(closure)
    _, grad = _objective(g, c, wb.detach())
    iterations = int(opt.state[wb].get("n_iter", 0))
    w = torch.zeros(f.num_cols, dtype=torch.float64)
    w[columns] = wb.detach()[:-1]
    return LogRegFit(c, w, float(wb.detach()[-1]), iterations, float(grad.abs().max()))


@dataclass(frozen=True)
class Tuned:
    """The tuned regression and how it was chosen."""

    fit: LogRegFit
    valid: dict[float, Metrics]  # C -> metrics on the validation slice

    @property
    def c(self) -> float:
        return self.fit.c


def tune_logreg(
    train: Features, *, grid: Sequence[float] = C_GRID, valid_fraction: float = 0.2
) -> Tuned:
    """Choose ``C`` by validation log loss, then refit on every training row."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    cut = train.rows - max(1, math.ceil(train.rows * valid_fraction))
    fit_part, valid_part = train.take(0, cut), train.take(cut, train.rows)
    valid = {c: fit_logreg(fit_part, c).metrics(valid_part) for c in grid}
    best = min(grid, key=lambda c: (valid[c].log_loss, c))
    return Tuned(fit_logreg(train, best), valid)


def fit_each_c(train: Features, grid: Sequence[float], tuned: Tuned) -> dict[float, LogRegFit]:
    """Every ``C`` of ``grid`` fitted on all the ``train`` rows, as the tuned fit is.

    ``tuned``'s own fit (on these rows) is reused for its ``C``; the others cost one
    full fit each. For reporting each ``C``'s evaluation metrics, never for choosing.
    """
    return {c: tuned.fit if c == tuned.c else fit_logreg(train, c) for c in grid}
