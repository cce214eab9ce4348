"""Every real-data recipe against a tuned logistic regression on the same features.

For each recipe in ``examples/`` that trains on a real sample in ``../shared/data`` (the
Criteo Kaggle sample, the Criteo 1TB-layout sample, the Avazu sample), and for its
DLRM-DCNv2 variant, this trains the recipe exactly as written (``tetrarec train``
would) and, on the same training rows and the same features (the run's transformed
dense values and one indicator per hashed table row, see ``_logreg.py``), a logistic
regression whose L2 strength ``C`` is chosen from a grid on a validation slice of the
training rows. Both are evaluated on the recipe's evaluation rows. Printed side by
side: AUC, log loss, calibration, the DLRM's best evaluated step (``train.keep_best``)
and whether the recipe meets the bar: AUC >= the regression's and log loss <= the
regression's + 0.005.

The DLRM's figure is its best checkpoint on the evaluation rows (``train.keep_best``),
while the regression's C is chosen on the training rows. For transparency, the
regression's row also holds ``eval_by_c`` (each C of the grid fitted on all the training
rows and evaluated) and ``C_chosen_on_eval``, printed as the reference row "logreg, C
chosen on eval rows": the same selection keep_best makes (by the DLRM recipe's
``keep_best`` metric, log loss without one), never used for the bar.

    tetrarec bench quality [--recipes criteo_kaggle avazu] [--seeds 3] [--json PATH]
    python benchmarks/bench_quality.py --smoke      # a few steps each, C=0.1: seconds

Runs from any directory: the recipes' data paths are relative to the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _harness import (
    describe_run,
    json_path,
    kernel_summary,
    print_table,
    unwind_on_signals,
    write_json,
)
from _logreg import C_GRID, Features, features_of, fit_each_c, tune_logreg

from tetrarec.config import BestMetric, RunConfig
from tetrarec.data import build_datasets
from tetrarec.train import Metrics, build_tables, train

ROOT = Path(__file__).resolve().parents[1]
LOG_LOSS_SLACK = 0.005  # the recipe's log loss may exceed the regression's by this much
SMOKE_C = 0.1  # --smoke fits this C only (unless --grid is given)
ON_EVAL = "logreg, C chosen on eval rows"  # the printed reference row (not the bar)
# Printed decimals: a miss of 0.0001 must not print as "-0.000 NO".
_FOUR = ("auc", "log_loss", "auc_vs_logreg", "log_loss_vs_logreg", "auc_mean", "auc_min")
DIGITS = dict.fromkeys((*_FOUR, "log_loss_mean"), 4)


@dataclass(frozen=True)
class Recipe:
    """One real sample and its two recipes (DLRM and DLRM-DCNv2)."""

    name: str
    data: str  # the sample file, relative to the repository root
    dlrm: str  # recipe files, relative to the repository root
    dcn: str


RECIPES = (
    Recipe(
        "criteo_kaggle",
        "../shared/data/criteo-kaggle-dac-sample/criteo_kaggle_dac_sample.tsv.gz",
        "examples/criteo_kaggle_sample.toml",
        "examples/criteo_kaggle_sample_dcn.toml",
    ),
    Recipe(
        "criteo_1tb",
        "../shared/data/criteo-1tb-sample/criteo_1tb_sample_1000.tsv.gz",
        "examples/criteo_1tb_sample.toml",
        "examples/criteo_1tb_sample_dcn.toml",
    ),
    Recipe(
        "avazu",
        "../shared/data/avazu-sample/avazu_sample.csv.gz",
        "examples/avazu_sample.toml",
        "examples/avazu_sample_dcn.toml",
    ),
)


def _c_value(text: str) -> float:
    """An argparse ``type``: a finite C > 0 (C = 0 fits a constant, C < 0 no optimum)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"C must be finite and > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    """An argparse ``type``: a fraction strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value < 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be > 0 and < 1 (rows to fit on and rows to validate on), got {text}"
        )
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--recipes",
        nargs="+",
        choices=[r.name for r in RECIPES],
        default=[r.name for r in RECIPES],
    )
    p.add_argument(
        "--grid",
        type=_c_value,
        nargs="+",
        help=f"C values, finite and > 0 (default: {' '.join(map(str, C_GRID))}; with "
        f"--smoke: {SMOKE_C})",
    )
    p.add_argument(
        "--valid-fraction",
        type=_fraction,
        default=0.2,
        help="training rows held out to choose C (> 0 and < 1)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="also train each recipe with its seed + 1, ..., + N-1 and report the spread",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"3 steps per recipe, and C={SMOKE_C} only unless --grid is given: seconds",
    )
    p.add_argument("--json", type=json_path, metavar="PATH")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: give 1 or more (1: the recipe's own seed only)")
    if args.grid is None:
        args.grid = [SMOKE_C] if args.smoke else list(C_GRID)
    return args


def missing_data(recipes: list[Recipe]) -> list[str]:
    """One line per recipe of ``recipes`` whose sample file is absent (absolute path)."""
    return [
        f"{r.name}: data file {(ROOT / r.data).resolve()} not found"
        for r in recipes
        if not (ROOT / r.data).is_file()
    ]


@contextlib.contextmanager
def _in_repo_root() -> Iterator[None]:
    here = Path.cwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(here)


def _row(recipe: str, model: str, m: Metrics, **extra: Any) -> dict[str, Any]:
    return {
        "recipe": recipe,
        "model": model,
        "auc": round(m.auc, 4),
        "log_loss": round(m.log_loss, 4),
        "calibration": round(m.calibration, 3),
        "eval_rows": m.num_samples,
        **extra,
    }


def run_recipe(
    path: str, smoke: bool, checkpoints: Path, seed_offset: int = 0
) -> tuple[RunConfig, dict[str, Any]]:
    """Train one recipe as written (its seed plus ``seed_offset``).

    Returns:
        The run's config and its result fields: the best evaluation's ``metrics``
        (``train.keep_best``; the final one without it) and its step.
    """
    config = RunConfig.from_toml(path)
    overrides = [
        "train.progress=false",
        "train.json=none",
        "train.tensorboard_dir=none",
        f"train.seed={config.train.seed + seed_offset}",
        f"train.checkpoint_dir={str(checkpoints / f'{Path(path).stem}-{seed_offset}')!r}",
    ]
    if smoke:
        overrides += [
            "train.epochs=none",
            "train.steps=3",
            "train.eval_every=0",
            "train.early_stop_patience=0",
        ]
    config = config.with_overrides(overrides)
    t0 = time.perf_counter()
    result = train(config)
    seconds = time.perf_counter() - t0
    assert result.final is not None
    b = result.best
    if b is not None and b.step is not None and b.metrics is not None:  # train.keep_best
        step, best = b.step, b.metrics
    else:
        step, best = result.steps, result.final
    return config, {
        "metrics": best,
        "best_step": step,
        "steps_run": result.steps,
        "stopped_early": result.stopped_early,
        "final_auc": round(result.final.auc, 4),
        "wall_s": round(seconds, 1),
    }


def _meets(m: Metrics, lr: Metrics) -> bool:
    return m.auc >= lr.auc and m.log_loss <= lr.log_loss + LOG_LOSS_SLACK


def logreg_rows(
    recipe: str,
    train_f: Features,
    eval_f: Features,
    grid: list[float],
    valid_fraction: float,
    keep_best: BestMetric | None,
) -> tuple[Metrics, dict[str, Any], dict[str, Any]]:
    """The tuned regression's evaluation metrics, its result row and the printed
    reference row of the C that is best on the evaluation rows.

    The result row holds ``eval_by_c`` (every C of ``grid`` fitted on all the training
    rows, as the tuned fit is, and evaluated) and ``C_chosen_on_eval``: the selection
    ``train.keep_best`` makes for the DLRM's figure (by ``keep_best``'s metric; log
    loss when it is ``None``), shown for reference, never the bar.
    """
    t0 = time.perf_counter()
    tuned = tune_logreg(train_f, grid=grid, valid_fraction=valid_fraction)
    lr = tuned.fit.metrics(eval_f)
    wall_s = round(time.perf_counter() - t0, 1)
    by_c = {c: fit.metrics(eval_f) for c, fit in fit_each_c(train_f, grid, tuned).items()}
    if keep_best is BestMetric.AUC:
        on_eval = min(grid, key=lambda c: (-by_c[c].auc, c))
    else:
        on_eval = min(grid, key=lambda c: (by_c[c].log_loss, c))
    eval_by_c = [
        {
            "C": c,
            "auc": round(m.auc, 4),
            "log_loss": round(m.log_loss, 4),
            "calibration": round(m.calibration, 3),
        }
        for c, m in by_c.items()
    ]
    row = _row(
        recipe,
        "logreg",
        lr,
        C=tuned.c,
        wall_s=wall_s,
        lbfgs_iters=tuned.fit.iterations,
        eval_by_c=eval_by_c,
        C_chosen_on_eval=on_eval,
    )
    return lr, row, _row(recipe, ON_EVAL, by_c[on_eval], C=on_eval)


def model_row(
    recipe: str, model: str, runs: list[tuple[RunConfig, dict[str, Any]]], lr: Metrics
) -> dict[str, Any]:
    """The result row of one recipe's runs (one per seed; the first is the recipe's
    own seed) beside the tuned regression's evaluation metrics ``lr``."""
    fields = dict(runs[0][1])  # the recipe as written (its own seed)
    m: Metrics = fields.pop("metrics")
    extra: dict[str, Any] = {}
    if len(runs) > 1:
        every = [f["metrics"] for _, f in runs]
        extra = {
            "auc_mean": round(statistics.fmean(e.auc for e in every), 4),
            "auc_min": round(min(e.auc for e in every), 4),
            "log_loss_mean": round(statistics.fmean(e.log_loss for e in every), 4),
            "seeds_meeting_bar": f"{sum(_meets(e, lr) for e in every)}/{len(every)}",
            "per_seed": [
                {
                    "seed": c.train.seed,
                    "auc": e.auc,
                    "log_loss": e.log_loss,
                    "calibration": e.calibration,
                    "best_step": f["best_step"],
                }
                for e, (c, f) in zip(every, runs)
            ],
        }
    return _row(
        recipe,
        model,
        m,
        auc_vs_logreg=round(m.auc - lr.auc, 4),
        log_loss_vs_logreg=round(m.log_loss - lr.log_loss, 4),
        meets_bar="yes" if _meets(m, lr) else "NO",
        **fields,
        **extra,
    )


def _recipe_rows(
    recipe: Recipe, args: argparse.Namespace, checkpoints: Path
) -> list[dict[str, Any]]:
    """Train ``recipe``'s two models and the regression; their rows, the regression's
    first and the reference row (``ON_EVAL``) after it."""
    trained: dict[str, list[tuple[RunConfig, dict[str, Any]]]] = {}
    for model, path in (("dlrm", recipe.dlrm), ("dlrm-dcnv2", recipe.dcn)):
        trained[model] = [run_recipe(path, args.smoke, checkpoints, k) for k in range(args.seeds)]
    # The regression sees the DLRM recipe's features: its rows, hashing and
    # dense transform (the DCN variant must share them: checked here).
    config = trained["dlrm"][0][0]
    for c, _ in trained["dlrm-dcnv2"]:
        if c.data != config.data or c.model.table_rows != config.model.table_rows:
            raise SystemExit(f"{recipe.name}: the DCN recipe must read the same features")
    t0 = time.perf_counter()
    train_ds, eval_ds = build_datasets(config.data, build_tables(config.model))
    table_rows = config.model.table_rows
    train_f, eval_f = features_of(train_ds, table_rows), features_of(eval_ds, table_rows)
    read_s = time.perf_counter() - t0
    lr, row, reference = logreg_rows(
        recipe.name, train_f, eval_f, args.grid, args.valid_fraction, config.train.keep_best
    )
    row["wall_s"] = round(row["wall_s"] + read_s, 1)
    return [row, reference, *(model_row(recipe.name, m, runs, lr) for m, runs in trained.items())]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    recipes = [r for r in RECIPES if r.name in args.recipes]
    # Every sample is checked before any training: a missing second one would lose the
    # first one's results.
    missing = missing_data(recipes)
    if missing:
        raise SystemExit("bench_quality: " + "; ".join(missing))
    printed: list[dict[str, Any]] = []
    # The runs' checkpoints are scratch (tens of MB per recipe): gone at the end, also
    # after an error, Ctrl-C or SIGTERM.
    with (
        unwind_on_signals("bench_quality"),
        tempfile.TemporaryDirectory(prefix="tetrarec-quality-") as scratch,
        _in_repo_root(),
    ):
        for recipe in recipes:
            printed += _recipe_rows(recipe, args, Path(scratch))
    columns = [
        "recipe",
        "model",
        "auc",
        "log_loss",
        "calibration",
        "best_step",
        "auc_vs_logreg",
        "log_loss_vs_logreg",
        "meets_bar",
        *(["auc_mean", "auc_min", "log_loss_mean", "seeds_meeting_bar"] if args.seeds > 1 else []),
        "C",
        "eval_rows",
        "wall_s",
    ]
    print_table(printed, columns, DIGITS)
    print(describe_run())
    print(
        f"bar: AUC >= the tuned logistic regression's, log loss <= its + {LOG_LOSS_SLACK}; "
        f"C from {args.grid} by log loss on the last {args.valid_fraction:.0%} of the "
        "training rows"
    )
    print(
        f"{ON_EVAL}: the grid's C that is best on the evaluation rows by the DLRM "
        "recipe's train.keep_best metric (AUC or log loss), each C fitted on all the "
        "training rows; the same selection keep_best makes for the DLRM's figure (its "
        "best checkpoint on those rows). A reference only: the bar is the regression "
        "whose C the training rows chose."
    )
    write_json(
        args.json,
        {**vars(args), "kernels": kernel_summary()["kernels"]},
        [r for r in printed if r["model"] != ON_EVAL],
    )


if __name__ == "__main__":
    main()
