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

    tetrarec bench quality [--recipes criteo_kaggle avazu] [--json PATH]
    python benchmarks/bench_quality.py --smoke      # a few steps each, seconds

Runs from any directory: the recipes' data paths are relative to the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _harness import describe_run, kernel_summary, print_table, write_json
from _logreg import C_GRID, features_of, tune_logreg

from tetrarec.config import RunConfig
from tetrarec.data import build_datasets
from tetrarec.train import Metrics, build_tables, train

ROOT = Path(__file__).resolve().parents[1]
LOG_LOSS_SLACK = 0.005  # the recipe's log loss may exceed the regression's by this much


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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--recipes",
        nargs="+",
        choices=[r.name for r in RECIPES],
        default=[r.name for r in RECIPES],
    )
    p.add_argument("--grid", type=float, nargs="+", default=list(C_GRID), help="C values")
    p.add_argument(
        "--valid-fraction", type=float, default=0.2, help="training rows held out to choose C"
    )
    p.add_argument("--smoke", action="store_true", help="3 steps per recipe, one C: seconds")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args()


@contextlib.contextmanager
def _in_repo_root() -> Iterator[None]:
    here = Path.cwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(here)


def _best(evals: tuple[tuple[int, Metrics], ...], metric: str) -> tuple[int, Metrics]:
    """The evaluation ``train.keep_best`` keeps (the first of equals)."""
    if metric == "log_loss":
        return min(evals, key=lambda e: (e[1].log_loss, e[0]))
    return max(evals, key=lambda e: (e[1].auc, -e[0]))


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


def run_recipe(path: str, smoke: bool, checkpoints: Path) -> tuple[RunConfig, dict[str, Any]]:
    """Train one recipe as written; returns its config and its result row's fields."""
    config = RunConfig.from_toml(path)
    overrides = [
        "train.progress=false",
        "train.json=none",
        "train.tensorboard_dir=none",
        f"train.checkpoint_dir={str(checkpoints / Path(path).stem)!r}",
    ]
    if smoke:
        overrides += ["train.steps=3", "train.eval_every=0", "train.early_stop_patience=0"]
    config = config.with_overrides(overrides)
    t0 = time.perf_counter()
    result = train(config)
    seconds = time.perf_counter() - t0
    metric = config.train.keep_best or "auc"
    step, best = _best(result.evals, metric)
    assert result.final is not None
    return config, {
        "metrics": best,
        "best_step": step,
        "steps_run": result.steps,
        "final_auc": round(result.final.auc, 4),
        "wall_s": round(seconds, 1),
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    grid = (0.1,) if args.smoke else tuple(args.grid)
    rows: list[dict[str, Any]] = []
    checkpoints = Path(tempfile.mkdtemp(prefix="tetrarec-quality-"))
    with _in_repo_root():
        for recipe in (r for r in RECIPES if r.name in args.recipes):
            if not Path(recipe.data).is_file():
                raise SystemExit(f"bench_quality: {recipe.name}: data file {recipe.data} not found")
            trained = {}
            for model, path in (("dlrm", recipe.dlrm), ("dlrm-dcnv2", recipe.dcn)):
                trained[model] = run_recipe(path, args.smoke, checkpoints)
            # The regression sees the DLRM recipe's features: its rows, hashing and
            # dense transform (the DCN variant shares them: checked below).
            config = trained["dlrm"][0]
            if trained["dlrm-dcnv2"][0].data != config.data or (
                trained["dlrm-dcnv2"][0].model.table_rows != config.model.table_rows
            ):
                raise SystemExit(f"{recipe.name}: the DCN recipe must read the same features")
            t0 = time.perf_counter()
            train_ds, eval_ds = build_datasets(config.data, build_tables(config.model))
            table_rows = config.model.table_rows
            tuned = tune_logreg(
                features_of(train_ds, table_rows), grid=grid, valid_fraction=args.valid_fraction
            )
            lr = tuned.fit.metrics(features_of(eval_ds, table_rows))
            rows.append(
                _row(
                    recipe.name,
                    "logreg",
                    lr,
                    C=tuned.c,
                    wall_s=round(time.perf_counter() - t0, 1),
                    lbfgs_iters=tuned.fit.iterations,
                )
            )
            for model, (_, fields) in trained.items():
                m: Metrics = fields.pop("metrics")
                meets = m.auc >= lr.auc and m.log_loss <= lr.log_loss + LOG_LOSS_SLACK
                rows.append(
                    _row(
                        recipe.name,
                        model,
                        m,
                        auc_vs_logreg=round(m.auc - lr.auc, 4),
                        log_loss_vs_logreg=round(m.log_loss - lr.log_loss, 4),
                        meets_bar="yes" if meets else "NO",
                        **fields,
                    )
                )
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
        "C",
        "eval_rows",
        "wall_s",
    ]
    print_table(rows, columns)
    print(describe_run())
    print(
        f"bar: AUC >= the tuned logistic regression's, log loss <= its + {LOG_LOSS_SLACK}; "
        f"C from {list(grid)} by log loss on the last {args.valid_fraction:.0%} of the "
        "training rows"
    )
    write_json(
        args.json,
        {**vars(args), "grid": list(grid), "kernels": kernel_summary()["kernels"]},
        rows,
    )


if __name__ == "__main__":
    main()
