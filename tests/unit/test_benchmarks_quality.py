"""``bench quality``'s command line and its scratch space, without training a recipe.

Its smoke run on the real samples is ``tests/integration/test_integration_train.py``.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tetrarec.train import Metrics

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _bench_quality() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return __import__("bench_quality")
    finally:
        sys.path.remove(str(BENCH))


def _main(monkeypatch, bench: Any, *args: str) -> None:
    """``bench_quality.py ARGS``."""
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", *args])
    bench.main()


@pytest.mark.parametrize("seeds", ["0", "-2"])
def test_seeds_under_one_is_a_usage_error(monkeypatch, capsys, seeds) -> None:
    """Bug caught: ``--seeds 0`` (or negative) trained nothing and then failed with an
    ``IndexError`` traceback reading the first seed's run."""
    bench = _bench_quality()
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", "--seeds", seeds])
    with pytest.raises(SystemExit) as e:
        bench.parse_args()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: --seeds {seeds}: give 1 or more (1: the recipe's own seed only)")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_the_runs_checkpoints_are_removed_when_it_stops(monkeypatch, tmp_path, stop) -> None:
    """The recipes' runs checkpoint into a scratch directory, removed however the
    benchmark ends (here Ctrl-C or an error in a run; a complete run leaves it the same
    way). Bug caught: ``tempfile.mkdtemp`` without cleanup left every run's
    checkpoints in ``/tmp/tetrarec-quality-*`` (62 MB for one smoke recipe)."""
    bench = _bench_quality()
    data = tmp_path / "sample.csv"
    data.write_text("")
    monkeypatch.setattr(bench, "RECIPES", (bench.Recipe("r", str(data), "a.toml", "b.toml"),))
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))  # where leftovers go
    used: list[Path] = []

    def run_recipe(path: str, smoke: bool, checkpoints: Path, seed_offset: int = 0) -> Any:
        used.append(checkpoints)
        (checkpoints / "step_00000001").mkdir()
        raise stop

    monkeypatch.setattr(bench, "run_recipe", run_recipe)
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", "--smoke"])
    with pytest.raises(stop):
        bench.main()
    assert len(used) == 1
    assert used[0].parent == tmp_path
    assert used[0].name.startswith("tetrarec-quality-")
    assert not used[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample.csv"]


def test_sigterm_deletes_the_scratch_and_exits_143(monkeypatch, tmp_path, capsys) -> None:
    """Bug caught: SIGTERM (what ``tetrarec bench`` now forwards, and what schedulers
    send) killed the benchmark at once, leaving its ``tetrarec-quality-*`` scratch; it
    now unwinds the ``with TemporaryDirectory`` and exits 143."""
    bench = _bench_quality()
    data = tmp_path / "sample.csv"
    data.write_text("")
    monkeypatch.setattr(bench, "RECIPES", (bench.Recipe("r", str(data), "a.toml", "b.toml"),))
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))

    def run_recipe(path: str, smoke: bool, checkpoints: Path, seed_offset: int = 0) -> Any:
        (checkpoints / "step_00000001").mkdir()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)  # the handler runs here
        raise AssertionError("SIGTERM did not stop the benchmark")

    def ignore(signum: int, frame: Any) -> None:  # without the fix: not the end of pytest
        pass

    monkeypatch.setattr(bench, "run_recipe", run_recipe)
    before = signal.signal(signal.SIGTERM, ignore)
    try:
        with pytest.raises(SystemExit) as e:
            _main(monkeypatch, bench, "--smoke")
        assert signal.getsignal(signal.SIGTERM) is ignore  # restored
    finally:
        signal.signal(signal.SIGTERM, before)
    assert e.value.code == 143
    assert capsys.readouterr().err.strip() == "bench_quality: terminated (SIGTERM)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample.csv"]


def test_every_recipes_data_is_checked_before_any_training(monkeypatch, tmp_path) -> None:
    """Bug caught: each recipe's sample was checked just before its own training, so a
    missing file for the second recipe lost the first one's (minutes of) results; the
    message now names the absolute path."""
    bench = _bench_quality()
    present = tmp_path / "a.csv"
    present.write_text("")
    missing = "../no-such-data-dir/b.csv"  # relative to the repository root, as in RECIPES
    recipes = (
        bench.Recipe("first", str(present), "a.toml", "b.toml"),
        bench.Recipe("second", missing, "c.toml", "d.toml"),
    )
    monkeypatch.setattr(bench, "RECIPES", recipes)

    def run_recipe(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("trained before every data file was checked")

    monkeypatch.setattr(bench, "run_recipe", run_recipe)
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, bench, "--smoke")
    absolute = (REPO / missing).resolve()
    assert str(e.value.code) == f"bench_quality: second: data file {absolute} not found"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--valid-fraction", "0"], "argument --valid-fraction: must be > 0 and < 1"),
        (["--valid-fraction", "1"], "argument --valid-fraction: must be > 0 and < 1"),
        (["--valid-fraction", "nan"], "argument --valid-fraction: must be > 0 and < 1"),
        (["--grid", "-1"], "argument --grid: C must be finite and > 0, got -1"),
        (["--grid", "0.1", "0"], "argument --grid: C must be finite and > 0, got 0"),
        (["--grid", "nan"], "argument --grid: C must be finite and > 0, got nan"),
        (["--grid", "inf"], "argument --grid: C must be finite and > 0, got inf"),
    ],
)
def test_bad_options_are_usage_errors(monkeypatch, capsys, args, message) -> None:
    """Bug caught: ``--valid-fraction 0``/``1`` failed with a traceback after all the
    training, ``--grid -1`` with an ``IndexError``, ``--grid 0`` fitted a constant
    predictor without a word, and ``nan``/``inf`` went through."""
    bench = _bench_quality()
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", *args])
    with pytest.raises(SystemExit) as e:
        bench.parse_args()
    assert e.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_json_to_a_directory_is_refused_before_any_work(monkeypatch, tmp_path, capsys) -> None:
    """Bug caught: ``--json DIR`` failed with an ``IsADirectoryError`` traceback after
    all the training; it is now a usage error before anything runs."""
    bench = _bench_quality()

    def run_recipe(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("trained before --json was checked")

    monkeypatch.setattr(bench, "run_recipe", run_recipe)
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", "--smoke", "--json", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"argument --json: {str(tmp_path)!r} is a directory; give a file path")


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_every_benchmarks_json_path_is_checked_when_parsed(script) -> None:
    """Bug caught: every benchmark wrote its ``--json`` last, so a bad path failed only
    after the work; each ``--json`` option now has the harness's ``json_path`` type
    (checked when parsed, whether run by ``tetrarec bench`` or directly)."""
    tree = ast.parse((BENCH / script).read_text())
    options = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        and any(isinstance(a, ast.Constant) and a.value == "--json" for a in node.args)
    ]
    for option in options:
        types = [k.value for k in option.keywords if k.arg == "type"]
        assert [getattr(t, "id", None) for t in types] == ["json_path"], ast.unparse(option)


def test_every_benchmark_with_scratch_files_unwinds_on_sigterm() -> None:
    """Bug caught: only bench_quality unwound on SIGTERM (what ``tetrarec bench`` forwards
    when it is terminated); bench_cache, bench_tiers, bench_data and bench_embedding died
    at once, leaving their scratch directories (the tiers' SSD files) behind. Every
    script that makes a scratch directory (itself or through ``_cache_big``) runs under
    the harness's ``unwind_on_signals``."""
    with_scratch, missing = [], []
    for path in sorted(BENCH.glob("bench_*.py")):
        source = path.read_text()
        if not any(w in source for w in ("mkdtemp", "TemporaryDirectory", "_cache_big")):
            continue
        with_scratch.append(path.name)
        tree = ast.parse(source)
        if not any(
            isinstance(node, ast.Call) and getattr(node.func, "id", None) == "unwind_on_signals"
            for node in ast.walk(tree)
        ):
            missing.append(path.name)
    assert len(with_scratch) >= 5, with_scratch  # the check still finds the scripts
    assert missing == []


# --- the report, with the training and the data replaced --------------------------------


def _metrics(auc: float, log_loss: float, calibration: float = 1.0) -> Metrics:
    return Metrics(
        auc=auc,
        ne=1.0,
        log_loss=log_loss,
        calibration=calibration,
        accuracy=0.8,
        num_samples=100,
        ctr=0.2,
    )


class _FakeRuns:
    """``run_recipe`` without training: one fixed ``Metrics`` per seed."""

    def __init__(self, per_seed: list[Metrics]) -> None:
        self.per_seed = per_seed

    def __call__(self, path: str, smoke: bool, checkpoints: Path, seed_offset: int = 0) -> Any:
        config = SimpleNamespace(
            data="same data",
            model=SimpleNamespace(table_rows=[7, 5]),
            train=SimpleNamespace(seed=7 + seed_offset, keep_best=None),
        )
        return config, {
            "metrics": self.per_seed[seed_offset],
            "best_step": 3,
            "steps_run": 3,
            "stopped_early": False,
            "final_auc": 0.5,
            "wall_s": 0.1,
        }


def _fake_pipeline(monkeypatch, tmp_path, runs: _FakeRuns, train_f: Any, eval_f: Any) -> Any:
    """``bench_quality`` with one recipe, ``runs`` as its training and ``train_f`` and
    ``eval_f`` as the regression's features."""
    bench = _bench_quality()
    data = tmp_path / "sample.csv"
    data.write_text("")
    monkeypatch.setattr(bench, "RECIPES", (bench.Recipe("r", str(data), "a.toml", "b.toml"),))
    monkeypatch.setattr(bench, "run_recipe", runs)
    monkeypatch.setattr(bench, "build_tables", lambda model: None)
    monkeypatch.setattr(bench, "build_datasets", lambda data, tables: ("train", "eval"))
    features = {"train": train_f, "eval": eval_f}
    monkeypatch.setattr(bench, "features_of", lambda ds, rows: features[ds])
    return bench


def _design_problem(seed: int, n: int) -> Any:
    """Small logistic-regression features (dense columns and two tables)."""
    sys.path.insert(0, str(BENCH))
    try:
        from _logreg import Features
    finally:
        sys.path.remove(str(BENCH))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    ids = rng.integers(0, 7, size=n)
    logit = x @ np.array([1.0, -0.5, 0.2]) + 0.8 * (ids % 2) - 0.4
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float64)
    row = np.repeat(np.arange(n), 4)
    col = np.stack([np.zeros(n), np.ones(n), np.full(n, 2), 3 + ids], 1).reshape(-1)
    val = np.stack([x[:, 0], x[:, 1], x[:, 2], np.ones(n)], 1).reshape(-1)
    return Features(
        torch.from_numpy(row),
        torch.from_numpy(col.astype(np.int64)),
        torch.from_numpy(val),
        torch.from_numpy(y),
        3 + 7,
    )


class _FixedFit:
    """A fitted regression whose evaluation metrics are given."""

    def __init__(self, c: float, metrics: Metrics) -> None:
        self.c, self.iterations, self._metrics = c, 5, metrics

    def metrics(self, features: Any) -> Metrics:
        return self._metrics


def _fixed_regression(monkeypatch, bench: Any, lr: Metrics, grids: list[Any]) -> None:
    """The regression replaced: every C evaluates to ``lr``; ``grids`` records the grid."""

    def tune_logreg(train: Any, *, grid: Any, valid_fraction: float) -> Any:
        grids.append(list(grid))
        return SimpleNamespace(fit=_FixedFit(grid[0], lr), c=grid[0])

    monkeypatch.setattr(bench, "tune_logreg", tune_logreg)
    fits = lambda train, grid, tuned: {c: _FixedFit(c, lr) for c in grid}  # noqa: E731
    monkeypatch.setattr(bench, "fit_each_c", fits, raising=False)


def test_a_miss_by_a_ten_thousandth_prints_as_one(monkeypatch, tmp_path, capsys) -> None:
    """Bug caught: the table printed 3 decimals, so an AUC 0.0001 below the regression's
    printed as ``-0.000 NO``; and the JSON's ``per_seed`` said neither which seed it
    was nor its calibration."""
    runs = _FakeRuns([_metrics(0.7499, 0.5, 1.1), _metrics(0.7503, 0.49, 0.9)])
    bench = _fake_pipeline(monkeypatch, tmp_path, runs, None, None)
    _fixed_regression(monkeypatch, bench, _metrics(0.75, 0.5), [])
    out = tmp_path / "out.json"
    _main(monkeypatch, bench, "--smoke", "--seeds", "2", "--json", str(out))
    printed = capsys.readouterr().out.splitlines()
    dlrm = next(ln.split() for ln in printed if ln.split()[1:2] == ["dlrm"])
    assert dlrm[2:4] == ["0.7499", "0.5000"]
    assert "-0.0001" in dlrm
    assert "NO" in dlrm
    assert "0.7501" in dlrm  # the mean AUC over the seeds
    row = next(r for r in json.loads(out.read_text())["results"] if r["model"] == "dlrm")
    assert [(s["seed"], s["auc"], s["calibration"]) for s in row["per_seed"]] == [
        (7, 0.7499, 1.1),
        (8, 0.7503, 0.9),
    ]


def test_smoke_keeps_a_grid_given_explicitly(monkeypatch, tmp_path) -> None:
    """Bug caught: ``--smoke`` replaced the user's ``--grid`` by C=0.1 without a word;
    the grid given is now the one fitted (``--smoke`` alone still fits C=0.1)."""
    runs = _FakeRuns([_metrics(0.7, 0.5)])
    bench = _fake_pipeline(monkeypatch, tmp_path, runs, None, None)
    grids: list[Any] = []
    _fixed_regression(monkeypatch, bench, _metrics(0.7, 0.5), grids)
    out = tmp_path / "out.json"
    _main(monkeypatch, bench, "--smoke", "--grid", "1", "3", "--json", str(out))
    _main(monkeypatch, bench, "--smoke")
    assert grids == [[1.0, 3.0], [0.1]]
    assert json.loads(out.read_text())["config"]["grid"] == [1.0, 3.0]


def test_report_shows_each_cs_evaluation_and_the_c_best_on_the_eval_rows(
    monkeypatch, tmp_path, capsys
) -> None:
    """Bug caught (transparency): the DLRM's figure is its best checkpoint on the
    evaluation rows (``train.keep_best``) while the regression's C is chosen on the
    training rows, and the report showed only the latter. Now the regression's row holds
    every C's evaluation metrics (each fitted on all the training rows) and the C best
    on the evaluation rows, printed as a reference row that the bar does not use."""
    sys.path.insert(0, str(BENCH))
    try:
        from _logreg import fit_logreg, tune_logreg
    finally:
        sys.path.remove(str(BENCH))
    train_f, eval_f = _design_problem(0, 400), _design_problem(1, 300)
    grid = [0.001, 0.03, 1.0]
    bench = _fake_pipeline(monkeypatch, tmp_path, _FakeRuns([_metrics(0.6, 0.7)]), train_f, eval_f)
    out = tmp_path / "out.json"
    _main(monkeypatch, bench, "--smoke", "--grid", *map(str, grid), "--json", str(out))
    rows = {r["model"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"logreg", "dlrm", "dlrm-dcnv2"}  # the reference row is printed only
    lr = rows["logreg"]
    expected = {c: fit_logreg(train_f, c).metrics(eval_f) for c in grid}
    assert [e["C"] for e in lr["eval_by_c"]] == grid
    for e in lr["eval_by_c"]:
        assert e["auc"] == pytest.approx(expected[e["C"]].auc, abs=1e-4)
        assert e["log_loss"] == pytest.approx(expected[e["C"]].log_loss, abs=1e-4)
    on_eval = min(grid, key=lambda c: expected[c].log_loss)
    assert lr["C_chosen_on_eval"] == on_eval
    tuned = tune_logreg(train_f, grid=grid, valid_fraction=0.2)
    assert lr["C"] == tuned.c  # the bar's regression: C chosen on the training rows
    assert rows["dlrm"]["auc_vs_logreg"] == pytest.approx(0.6 - lr["auc"], abs=2e-4)
    printed = capsys.readouterr().out
    reference = next(ln for ln in printed.splitlines() if bench.ON_EVAL in ln)
    assert f"{expected[on_eval].auc:.4f}" in reference
    assert "A reference only: the bar is the regression whose C" in printed


@pytest.mark.parametrize("keep_best", ["auc", "log_loss", None])
def test_the_reference_c_is_chosen_by_the_recipes_keep_best_metric(keep_best) -> None:
    """Bug caught: the reference row said it made "the same selection train.keep_best
    makes", but chose C by log loss also for the recipes that keep their best
    checkpoint by AUC (the Criteo Kaggle ones). The data here are chosen so that the
    two metrics pick different Cs (3.0 by AUC, 0.3 by log loss)."""
    sys.path.insert(0, str(BENCH))
    try:
        from _logreg import fit_logreg
    finally:
        sys.path.remove(str(BENCH))
    bench = _bench_quality()
    train_f, eval_f = _design_problem(0, 400), _design_problem(2, 300)
    grid = [0.03, 0.1, 0.3, 1.0, 3.0]
    metric = None if keep_best is None else bench.BestMetric(keep_best)
    _, row, reference = bench.logreg_rows("r", train_f, eval_f, grid, 0.2, metric)
    by_c = {c: fit_logreg(train_f, c).metrics(eval_f) for c in grid}
    want = (
        max(grid, key=lambda c: by_c[c].auc)
        if keep_best == "auc"
        else min(grid, key=lambda c: by_c[c].log_loss)
    )
    assert want == (3.0 if keep_best == "auc" else 0.3)
    assert row["C_chosen_on_eval"] == reference["C"] == want
    assert reference["auc"] == pytest.approx(by_c[want].auc, abs=1e-4)
