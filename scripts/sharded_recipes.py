r"""Train recipes in one process and under torchrun, and compare their metrics.

    .venv/bin/python scripts/sharded_recipes.py                      # the recipes with a
        # first-order term (criteo_kaggle_sample, avazu_sample), 2 and 3 ranks, row-wise
        # and mixed plans
    .venv/bin/python scripts/sharded_recipes.py --config examples/avazu_sample.toml \
        --nproc 2 --plans row_wise,mixed,planner --json out.json
    .venv/bin/python scripts/sharded_recipes.py --set train.epochs=none \
        --set train.steps=20             # shorter (the recipes set epochs: unset it)

Every run keeps the recipe's global batch (``data.batch_size``; a batch that does not
divide by the ranks splits as evenly as it can), is deterministic
(``train.deterministic = true``) and writes its summary JSON; the sharded runs must give
the one-process run's evaluation metrics (the best checkpoint's, and the last
evaluation's) within ``--auc-tol`` and ``--log-loss-tol`` (DESIGN.md: "sharded equals
unsharded"). A plan is one of:

- ``row_wise`` (or any one sharding type): every table, the first-order term's too;
- ``mixed``: the sharding types in turn over the tables (table-wise, row-wise,
  column-wise, data-parallel, table-row-wise, table-column-wise, ...); a first-order
  table takes its embedding table's type;
- ``planner``: no type, the planner's plan for this machine.

Prints one table of the runs side by side, and exits 1 if any sharded run differs.
Checkpoints and logs go to a temporary directory (``--keep DIR`` keeps them there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tetrarec, as the runs below use

from tetrarec.config import RunConfig  # noqa: E402
from tetrarec.types import ShardingType  # noqa: E402

DEFAULT_CONFIGS = ("examples/criteo_kaggle_sample.toml", "examples/avazu_sample.toml")


def _recipe(config: str, overrides: tuple[str, ...] = ()) -> tuple[int, int]:
    """``(tables, global batch size)`` of a recipe (with the run's overrides)."""
    run = RunConfig.from_toml(config, list(overrides))
    return run.model.num_sparse, run.data.batch_size


def _plan_overrides(plan: str, config: str, extra: list[str]) -> list[str]:
    if plan == "planner":
        return []
    if plan == "mixed":
        n, _ = _recipe(config, tuple(extra))
        every = [t.value for t in ShardingType]  # the registered types, in order
        types = [every[i % len(every)] for i in range(n)]
        return [f"sharding.type={','.join(types)}"]
    return [f"sharding.type={plan}"]


def _run(
    config: str, nproc: int, plan: str, work: Path, batch: int, extra: list[str]
) -> dict[str, Any]:
    name = f"{Path(config).stem}-{nproc}-{plan}"
    out = work / f"{name}.json"
    sets = [
        "train.deterministic=true",
        f"data.batch_size={batch}",
        f"train.checkpoint_dir={work / name}",
        f"train.json={out}",
        *extra,
        *(_plan_overrides(plan, config, extra) if nproc > 1 else []),
    ]
    exe = Path(sys.executable).parent
    if nproc > 1:
        cmd = [str(exe / "torchrun"), "--nproc-per-node", str(nproc), "-m", "tetrarec"]
    else:
        cmd = [sys.executable, "-m", "tetrarec"]
    cmd += ["-q", "train", "--config", config]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    log = work / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    if rc.returncode != 0:
        lines = log.read_text().splitlines()
        said = [x for x in lines if "tetrarec train: error:" in x][:1]  # tetrarec's own line
        return {"name": name, "error": f"exit {rc.returncode}: " + " | ".join(said or lines[-5:])}
    summary = json.loads(out.read_text())
    return {
        "name": name,
        "config": config,
        "nproc": nproc,
        "plan": plan if nproc > 1 else "one process",
        "seconds": round(seconds, 1),
        "steps": summary["steps"],
        "best": summary.get("best"),
        "final": summary["final"],
    }


def _metrics(run: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key in ("best", "final"):
        m = run.get(key)
        if m:
            out[f"{key}_auc"] = m["auc"]
            out[f"{key}_log_loss"] = m["log_loss"]
            if key == "best":
                out["best_step"] = m["step"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; return the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", help="a recipe (repeatable)")
    p.add_argument("--nproc", default="2,3", help="ranks, comma-separated (default 2,3)")
    p.add_argument("--plans", default="row_wise,mixed", help="plans (default row_wise,mixed)")
    p.add_argument("--auc-tol", type=float, default=1e-4)
    p.add_argument("--log-loss-tol", type=float, default=1e-5)
    p.add_argument("--json", help="write every run's metrics here")
    p.add_argument("--keep", help="keep checkpoints and logs in this directory")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="an override for every run (repeatable), e.g. train.steps=40",
    )
    args = p.parse_args(argv)
    configs = args.config or list(DEFAULT_CONFIGS)
    nprocs = [int(x) for x in args.nproc.split(",")]
    plans = args.plans.split(",")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tetrarec-recipes-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    every: list[dict[str, Any]] = []
    failed = False
    for config in configs:
        batch = _recipe(config, tuple(args.overrides))[1]  # as written, or --set
        base = _run(config, 1, "-", work, batch, args.overrides)
        every.append(base)
        if "error" in base:
            print(f"{base['name']}: {base['error']}")
            failed = True
            continue
        ref = _metrics(base)
        print(f"\n{config}  (one process: {base['steps']} steps, {base['seconds']} s)")
        head = f"{'run':<30} {'best step':>9} {'best AUC':>10} {'best log loss':>14} "
        head += f"{'final AUC':>10} {'final log loss':>15} {'max |d AUC|':>12} {'max |d LL|':>11}"
        print(head)
        for nproc in nprocs:
            for plan in plans:
                run = _run(config, nproc, plan, work, batch, args.overrides) if nproc > 1 else base
                every.append(run)
                label = f"{nproc} ranks, {plan}"
                if "error" in run:
                    print(f"{label:<30} {run['error']}")
                    failed = True
                    continue
                got = _metrics(run)
                d_auc = max(abs(got[k] - ref[k]) for k in ref if k.endswith("_auc"))
                d_ll = max(abs(got[k] - ref[k]) for k in ref if k.endswith("_log_loss"))
                same_step = got.get("best_step") == ref.get("best_step")
                ok = d_auc <= args.auc_tol and d_ll <= args.log_loss_tol and same_step
                run.update(d_auc=d_auc, d_log_loss=d_ll, ok=ok)
                failed |= not ok
                print(
                    f"{label:<30} {got.get('best_step', '-'):>9} {got.get('best_auc', 0):>10.6f} "
                    f"{got.get('best_log_loss', 0):>14.8f} {got['final_auc']:>10.6f} "
                    f"{got['final_log_loss']:>15.8f} {d_auc:>12.2e} {d_ll:>11.2e}"
                    f"{'' if ok else '  DIFFERS'}"
                )
        print(
            f"{'one process':<30} {ref.get('best_step', '-'):>9} {ref.get('best_auc', 0):>10.6f} "
            f"{ref.get('best_log_loss', 0):>14.8f} {ref['final_auc']:>10.6f} "
            f"{ref['final_log_loss']:>15.8f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(every, indent=1))
    print(
        f"\n{'some sharded runs differ' if failed else 'every sharded run matches'} "
        f"(AUC within {args.auc_tol}, log loss within {args.log_loss_tol}); logs in {work}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
