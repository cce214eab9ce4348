"""The logistic-regression baseline of ``bench quality`` solves the problem it states.

Checked against conditions written here in numpy on a dense copy of the design, never
against the solver's own quantities: the design's layout (dense columns first, one
column per table row, a repeated id counting twice), the optimality conditions of
``C * sum(log loss) + ||w||^2 / 2`` with an unpenalized intercept, and the choice of
``C`` on the validation slice.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tetrarec.sparse import Batch, SparseFeatures

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _logreg import _design, fit_logreg, tune_logreg


def _batch(dense: np.ndarray, bags: list[list[list[int]]], labels: np.ndarray) -> Batch:
    """``bags[f][b]``: the ids of feature ``f`` in sample ``b``."""
    b = dense.shape[0]
    values = [i for feature in bags for bag in feature for i in bag]
    lengths = [len(bag) for feature in bags for bag in feature]
    sf = SparseFeatures(
        tuple(f"C{i}" for i in range(len(bags))),
        torch.tensor(values, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
        b,
    )
    return Batch(
        torch.from_numpy(dense.astype(np.float32)), sf, torch.from_numpy(labels.astype(np.float32))
    )


def _dense_design(f) -> np.ndarray:  # type: ignore[no-untyped-def]
    x = np.zeros((f.rows, f.num_cols))
    np.add.at(x, (f.row.numpy(), f.col.numpy()), f.val.numpy())
    return x


def test_design_places_dense_then_each_tables_rows_and_counts_repeats() -> None:
    # Bug caught: a feature's ids not shifted by the rows of the tables before it (two
    # features' ids would share weights), or a repeated id of a bag counted once.
    dense = np.array([[0.5, -1.0], [2.0, 0.0]])
    bags = [[[1], [0]], [[2, 2], []]]  # feature 0 (3 rows), feature 1 (4 rows)
    f = _design(_batch(dense, bags, np.array([1.0, 0.0])), [3, 4])
    expected = np.zeros((2, 2 + 3 + 4))
    expected[:, :2] = dense
    expected[0, 2 + 1] = 1.0
    expected[1, 2 + 0] = 1.0
    expected[0, 2 + 3 + 2] = 2.0
    np.testing.assert_array_equal(_dense_design(f), expected)
    np.testing.assert_array_equal(_dense_design(f.take(1, 2)), expected[1:])


def _problem(seed: int, n: int = 300) -> tuple[Batch, list[int]]:
    rng = np.random.default_rng(seed)
    rows = [7, 5]
    dense = rng.normal(size=(n, 3))
    ids = [rng.integers(0, r - 1, size=n) for r in rows]  # the last row of each is unused
    logit = dense @ np.array([1.0, -0.5, 0.2]) + 0.8 * (ids[0] % 2) - 0.4
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float64)
    bags = [[[int(i)] for i in f] for f in ids]
    return _batch(dense, bags, labels), rows


@pytest.mark.parametrize("c", [0.05, 1.0])
def test_fit_meets_the_optimality_conditions(c: float) -> None:
    # Bug caught: a penalized intercept (sum(p - y) != 0 at the fit), a wrong gradient
    # (the fit would stop away from the optimum) or a compaction that drops a used column.
    batch, rows = _problem(0)
    f = _design(batch, rows)
    fit = fit_logreg(f, c)
    x, y = _dense_design(f), batch.labels.double().numpy()
    p = 1 / (1 + np.exp(-(x @ fit.w.numpy() + fit.b)))
    grad_w = c * x.T @ (p - y) + fit.w.numpy()
    assert np.abs(grad_w).max() < 1e-4 * c * f.rows
    assert abs(c * (p - y).sum()) < 1e-4 * c * f.rows
    # Columns no training row uses: the penalty alone acts on them, so they stay 0.
    unused = np.flatnonzero(np.abs(x).sum(0) == 0)
    assert unused.size == 2
    assert np.all(fit.w.numpy()[unused] == 0)


def test_stronger_regularization_shrinks_the_weights() -> None:
    # Bug caught: C applied to the penalty instead of the data term (the order reverses).
    batch, rows = _problem(1)
    f = _design(batch, rows)
    norms = [float(fit_logreg(f, c).w.norm()) for c in (0.01, 0.1, 1.0)]
    assert norms[0] < norms[1] < norms[2]


def test_tune_picks_the_best_validation_log_loss_and_refits_on_all_rows() -> None:
    # Bug caught: choosing by the training loss (always the largest C), or returning the
    # model fitted on the reduced rows instead of refitting on all of them.
    rng = np.random.default_rng(2)
    n = 400
    dense = rng.normal(size=(n, 2))
    labels = (rng.random(n) < 1 / (1 + np.exp(-dense[:, 0]))).astype(np.float64)
    noise = [[[int(i)] for i in rng.integers(0, 150, size=n)]]  # ids unrelated to labels
    f = _design(_batch(dense, noise, labels), [150])
    grid = (0.001, 0.1, 1000.0)
    tuned = tune_logreg(f, grid=grid, valid_fraction=0.25)
    assert set(tuned.valid) == set(grid)
    best = min(grid, key=lambda c: tuned.valid[c].log_loss)
    assert tuned.c == best
    assert best == 0.1  # neither the flattest nor the loosest fit
    assert tuned.valid[best].num_samples == 100
    refit = fit_logreg(f, best)
    torch.testing.assert_close(tuned.fit.w, refit.w)
    assert not torch.allclose(tuned.fit.w, fit_logreg(f.take(0, 300), best).w)


def test_fit_each_c_fits_every_c_on_all_rows_and_reuses_the_tuned_fit() -> None:
    # Bug caught (the report's eval_by_c): a C fitted on the reduced rows, or the tuned
    # C fitted a second time (seconds each on the real samples).
    from _logreg import fit_each_c

    batch, rows = _problem(3)
    f = _design(batch, rows)
    grid = (0.01, 0.1, 1.0)
    tuned = tune_logreg(f, grid=grid, valid_fraction=0.25)
    fits = fit_each_c(f, grid, tuned)
    assert list(fits) == list(grid)
    assert fits[tuned.c] is tuned.fit
    for c in grid:
        assert fits[c].c == c
        torch.testing.assert_close(fits[c].w, fit_logreg(f, c).w)
