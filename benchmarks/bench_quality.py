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

    tetrarec bench quality [--recipes criteo_kaggle avazu] [--seeds 3] [--json PATH]
    python benchmarks/bench_quality.py --smoke      # a few steps each, seconds

Runs from any directory: the recipes' data paths are relative to the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
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
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="also train each recipe with its seed + 1, ..., + N-1 and report the spread",
    )
    p.add_argument("--smoke", action="store_true", help="3 steps per recipe, one C: seconds")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: give 1 or more (1: the recipe's own seed only)")
    return args


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


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    grid = (0.1,) if args.smoke else tuple(args.grid)
    rows: list[dict[str, Any]] = []
    # The runs' checkpoints are scratch (tens of MB per recipe): gone at the end, also
    # after an error or Ctrl-C.
    with tempfile.TemporaryDirectory(prefix="tetrarec-quality-") as scratch, _in_repo_root():
        checkpoints = Path(scratch)
        for recipe in (r for r in RECIPES if r.name in args.recipes):
            if not Path(recipe.data).is_file():
                raise SystemExit(f"bench_quality: {recipe.name}: data file {recipe.data} not found")
            trained: dict[str, list[tuple[RunConfig, dict[str, Any]]]] = {}
            for model, path in (("dlrm", recipe.dlrm), ("dlrm-dcnv2", recipe.dcn)):
                trained[model] = [
                    run_recipe(path, args.smoke, checkpoints, k) for k in range(args.seeds)
                ]
            # The regression sees the DLRM recipe's features: its rows, hashing and
            # dense transform (the DCN variant must share them: checked here).
            config = trained["dlrm"][0][0]
            for c, _ in trained["dlrm-dcnv2"]:
                if c.data != config.data or c.model.table_rows != config.model.table_rows:
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
            for model, runs in trained.items():
                fields = dict(runs[0][1])  # the recipe as written (its own seed)
                m: Metrics = fields.pop("metrics")
                extra: dict[str, Any] = {}
                if args.seeds > 1:
                    every = [f["metrics"] for _, f in runs]
                    extra = {
                        "auc_mean": round(statistics.fmean(e.auc for e in every), 4),
                        "auc_min": round(min(e.auc for e in every), 4),
                        "log_loss_mean": round(statistics.fmean(e.log_loss for e in every), 4),
                        "seeds_meeting_bar": f"{sum(_meets(e, lr) for e in every)}/{len(every)}",
                        "per_seed": [
                            {"auc": e.auc, "log_loss": e.log_loss, "best_step": f["best_step"]}
                            for e, (_, f) in zip(every, runs)
                        ],
                    }
                rows.append(
                    _row(
                        recipe.name,
                        model,
                        m,
                        auc_vs_logreg=round(m.auc - lr.auc, 4),
                        log_loss_vs_logreg=round(m.log_loss - lr.log_loss, 4),
                        meets_bar="yes" if _meets(m, lr) else "NO",
                        **fields,
                        **extra,
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
        *(["auc_mean", "auc_min", "log_loss_mean", "seeds_meeting_bar"] if args.seeds > 1 else []),
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
