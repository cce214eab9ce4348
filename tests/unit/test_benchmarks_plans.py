"""``bench plans``' statistics: the rank correlation and the summary over repeats."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_plans import spearman, summarize


def test_spearman_matches_the_textbook_formula_and_averages_ties() -> None:
    """Catches Pearson's correlation of the values instead of their ranks, ranks from the
    wrong end, and ties ranked by position instead of averaged."""
    x = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    y = [2.0, 0.5, 7.0, 8.0, 30.0, 1.0]
    n = len(x)
    rx = {v: i + 1 for i, v in enumerate(sorted(x))}
    ry = {v: i + 1 for i, v in enumerate(sorted(y))}
    d2 = sum((rx[a] - ry[b]) ** 2 for a, b in zip(x, y))
    assert spearman(x, y) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))
    assert spearman(x, [-v for v in y]) == pytest.approx(-spearman(x, y))
    # y's ranks with the tie averaged: 1, 2, 3.5, 5, 3.5 (by hand, Pearson over ranks)
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8207826816681234)


def _row(plan: str, predicted: list[float], measured: list[float]) -> dict[str, object]:
    mid = sorted(measured)[len(measured) // 2]
    return {
        "plan": plan,
        "predicted_ms": sorted(predicted)[len(predicted) // 2],
        "measured_ms": mid,
        "predicted_ms_per_repeat": predicted,
        "measured_ms_per_repeat": measured,
    }


def test_summary_reports_each_repeats_correlation_and_the_planners_ratios() -> None:
    """Catches the per-repeat correlations computed across repeats instead of across
    plans, or the planner's ratios taken the wrong way round."""
    rows = [
        _row("tw_round_robin", [10, 10, 10], [12, 11, 13]),
        _row("row_wise", [20, 20, 20], [15, 25, 24]),
        _row("planner", [5, 5, 5], [11, 9, 10]),
    ]
    out = summarize(2, rows)
    # repeat 1 measures planner 11 < tw 12 < rw 15 (as predicted); repeat 2 swaps planner
    # and tw: 9 < 11 < 25 (still as predicted); repeat 3: 10 < 13 < 24
    assert out["spearman_per_repeat"] == [1.0, 1.0, 1.0]
    rows[0]["measured_ms_per_repeat"] = [12, 8, 13]  # repeat 2: tw fastest
    assert summarize(2, rows)["spearman_per_repeat"] == [1.0, 0.5, 1.0]
    assert out["fastest"] == "planner"
    assert out["planner_vs_row_wise"] == pytest.approx(24 / 10)
    assert out["planner_vs_tw_round_robin"] == pytest.approx(12 / 10)
