"""Check the mutmut mutants of ``tetrarec.train.state`` that only sharded ranks reach.

``_save_sharded`` runs only on the ranks of a sharded run, which are spawned processes:
mutmut's stats run records which tests reach a function in its own process only, so it
marks these mutants "no tests" and never runs them. This script runs them the way a
test would. On 2 gloo ranks (``tetrarec.testing.run_ranks``) it builds a tiny sharded
run (a row-wise and a table-wise table, row-wise Adagrad) and saves a checkpoint with
the unmutated code, then once per mutant: ``MUTANT_UNDER_TEST`` set on both ranks
(mutmut's trampoline reads it at every call), ``save_run_state``, then the variable
cleared, every weight and state changed, and the checkpoint loaded back with
``load_run_state``. The loading functions' sharded branches are not reached in one
process either (past the check that refuses a sharded checkpoint there), nor is
``save_run_state``'s call of ``_save_sharded``: their mutants that survive mutmut are
checked here too (a loading-side mutant loads the unmutated checkpoint). A mutant is killed when

- saving raises, or times out, on either rank;
- a nan in rank 1's state only is not refused on both ranks with the step in the
  message (rank 0 naming "another rank's state", rank 1 its tensors);
- its checkpoint differs from the unmutated one: the file names, any tensor of any
  file (bit for bit) or ``meta.json``;
- loading it back raises, returns another step or data position, or leaves the run
  in another state (weights, optimizer state, RNG) than before the save;
- (mutants of the loading side) a one-process checkpoint, or one written with another
  plan on as many ranks, is not refused with the message naming both layouts.

Otherwise it survived; mutation/README.md explains each survivor. The exit status is
0 when the killed share reaches ``--goal``.

Run from the repository root after ``mutmut run`` generated the mutants (``mutants/``)
and built the kernels into ``mutants/xdg-cache`` (``make mutants`` does both)::

    .venv/bin/python mutation/sharded_state_mutants.py
    .venv/bin/python mutation/sharded_state_mutants.py --json out.json \
        --only x__save_sharded__mutmut_3 x_load_run_state__mutmut_9
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MODULE = "tetrarec.train.state"
FUNCTION = "x__save_sharded"
# The saving side: _check_finite and _non_finite run inside the save (a nan on one rank).
SAVING = ("x__save_sharded__", "x_save_run_state__", "x__check_finite__", "x__non_finite__")
LOADING = ("x_load_run_state__", "x__check_same_layout__")
MUTANTS = Path("mutants")
TINY = (
    "data.source=synthetic",
    "data.batch_size=16",
    "data.eval_batch_size=16",
    "model.num_sparse=2",
    "model.num_embeddings=[30, 11]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.dense=adam",
    "optim.sparse.kind=rowwise_adagrad",
    "sharding.type=[row_wise, table_wise]",
    "sharding.timeout_s=20",
    "train.progress=false",
)


def _state_tensors(parts: Any) -> dict[str, Any]:
    """The run's weights, optimizer state and torch RNG, as plain tensors (unmutated code)."""
    import torch

    from tetrarec.train.checkpoint import flatten_optimizer_state

    out = {f"m.{k}": v.detach().clone() for k, v in parts.model.state_dict().items()}
    for prefix, opt in (("d", parts.dense_optimizer), ("s", parts.sparse_optimizer)):
        tensors, _ = flatten_optimizer_state(opt.state_dict(), prefix)
        out.update({k: v.clone() for k, v in tensors.items()})
    out["rng"] = torch.get_rng_state()
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """``None`` when ``a`` and ``b`` hold the same names and bitwise equal tensors."""
    import torch

    if sorted(a) != sorted(b):
        return f"tensor names differ: {sorted(set(a) ^ set(b))[:4]}"
    for k in a:
        if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
            return f"tensor {k} differs"
    return None


def mutant_worker(ctx: Any, names: list[str], root: str) -> None:
    """On one rank: save the unmutated checkpoint (if not there yet), then each mutant's.

    Writes ``<root>/progress_<rank>.jsonl`` as it goes (one ``{name, status, detail}``
    line per mutant), so a run that hangs or dies still leaves the mutants it checked.
    """
    from tetrarec.comm import LaunchInfo
    from tetrarec.config import RunConfig
    from tetrarec.train import build_parts
    from tetrarec.train.distributed import sharded_parts, sharding_env
    from tetrarec.train.state import load_run_state, save_run_state

    config = RunConfig().with_overrides(list(TINY))
    launch = LaunchInfo(
        rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.rank, local_world_size=2
    )
    env = sharding_env(config, launch)
    parts = sharded_parts(config, env, num_dense=13)
    os.environ["MUTANT_UNDER_TEST"] = ""
    base = save_run_state(Path(root) / "orig", parts, step=1, config=config, keep=1)
    one = Path(root) / f"one_process_{ctx.rank}"  # a one-process run's checkpoint
    one = save_run_state(one, build_parts(config, num_dense=13), step=1, config=config, keep=1)
    other = RunConfig().with_overrides([*TINY, "sharding.type=[table_wise, row_wise]"])
    other_plan = sharded_parts(other, env, num_dense=13)  # same world, another plan
    before = _state_tensors(parts)
    (Path(root) / f"ready_{ctx.rank}").touch()
    log = Path(root) / f"progress_{ctx.rank}.jsonl"
    for name in names:
        path = base
        if name.startswith(SAVING):
            os.environ["MUTANT_UNDER_TEST"] = f"{MODULE}.{name}"
            try:
                path = save_run_state(Path(root) / name, parts, step=1, config=config, keep=1)
            except Exception as e:  # a mutant may raise anything
                _log(log, name, "raised", f"{type(e).__name__}: {e}"[:300])
                if not _in_step(env, name):
                    return  # a collective was left half done: the next spawn continues
                load_run_state(base, parts)
                continue
            finally:
                os.environ["MUTANT_UNDER_TEST"] = ""
            env.comm.barrier(label="mutant")  # both ranks' files are written
            wrong = _refuses_one_ranks_nan(parts, config, Path(root) / f"{name}-nan", name)
            if wrong is not None:
                _log(log, name, "raised", wrong)
                if not _in_step(env, name):
                    return
                load_run_state(base, parts)
                continue
        _scramble(parts)  # so that a load that restores nothing is seen
        if path == base:  # a mutant of the loading side
            os.environ["MUTANT_UNDER_TEST"] = f"{MODULE}.{name}"
            wrong = _refuses_one_process_checkpoint(one, parts) or _refuses_another_plan(
                base, parts, other_plan
            )
            if wrong is not None:
                os.environ["MUTANT_UNDER_TEST"] = ""
                load_run_state(base, parts)
                _log(log, name, "loaded", wrong)
                if not _in_step(env, name):
                    return
                continue
        try:
            position = load_run_state(path, parts)
            differs = _same(before, _state_tensors(parts))
            if position != (1, 1):
                differs = f"loading it back gave (step, position) {position}, not (1, 1)"
        except Exception as e:
            differs = f"loading it back raised {type(e).__name__}: {e}"[:300]
        finally:
            os.environ["MUTANT_UNDER_TEST"] = ""
        if differs is not None:
            load_run_state(base, parts)  # back to the state before the save
        _log(log, name, "loaded", differs or "")
        if not _in_step(env, name):
            return


def _in_step(env: Any, name: str) -> bool:
    """Whether both ranks are done with mutant ``name`` and nothing is left pending.

    After a mutant raised on one rank only, the other may still wait in a collective:
    this exchange then fails (or pairs with it and disagrees) and the spawn ends.
    """
    try:
        return bool(env.comm.all_gather_json(name, label="mutant") == [name, name])
    except Exception:
        return False


def _refuses_one_process_checkpoint(path: Path, parts: Any) -> str | None:
    """Resuming a one-process checkpoint on 2 ranks must be refused, saying so."""
    from tetrarec.train.state import load_run_state

    want = (
        f"{path} was written by one process, this run has 2 ranks: resuming on another "
        "world size or plan is not supported yet (resharding a checkpoint is a later feature)"
    )
    try:
        load_run_state(path, parts)
    except ValueError as e:
        return None if str(e) == want else f"a one-process checkpoint refused with: {e}"
    except Exception as e:  # a mutant may raise anything
        return f"a one-process checkpoint: {type(e).__name__}: {e}"[:300]
    return "a one-process checkpoint was loaded into a sharded run"


def _refuses_another_plan(path: Path, parts: Any, other_plan: Any) -> str | None:
    """Resuming on the same world with another plan must be refused, naming both plans."""
    from tetrarec.train.state import load_run_state

    saved, now = parts.plan.fingerprint(), other_plan.plan.fingerprint()
    want = (
        f"{path} was written with 2 ranks and plan {saved}, this run has 2 ranks and plan "
        f"{now}: resuming with another world size or plan is not supported yet (resharding "
        "a checkpoint is a later feature)"
    )
    try:
        load_run_state(path, other_plan)
    except ValueError as e:
        return None if str(e) == want else f"another plan refused with: {e}"[:300]
    except Exception as e:  # a mutant may raise anything
        return f"another plan: {type(e).__name__}: {e}"[:300]
    return "a checkpoint of another plan was loaded"


def _refuses_one_ranks_nan(parts: Any, config: Any, root: Path, name: str) -> str | None:
    """Save (mutant set) with a nan in rank 1's state only: both ranks must refuse.

    Returns ``None`` when they do (rank 0 naming another rank's state), else what went
    wrong. The run's state is changed; the caller loads the unmutated checkpoint back.
    """
    import torch

    from tetrarec.train.state import NonFiniteStateError, save_run_state

    if parts.env.rank == 1:
        with torch.no_grad():
            next(v for v in parts.model.state_dict().values() if v.is_floating_point())[0] = float(
                "nan"
            )
    os.environ["MUTANT_UNDER_TEST"] = f"{MODULE}.{name}"
    try:
        save_run_state(root, parts, step=1, config=config, keep=1)
    except NonFiniteStateError as e:
        start = "not checkpointing step 1: non-finite values in "
        want = start + ("another rank's state" if parts.env.rank == 0 else "['")
        if not str(e).startswith(want):
            return f"rank {parts.env.rank} refused a nan on rank 1 with: {e}"
        return None
    except Exception as e:  # a mutant may raise anything
        return f"with a nan on rank 1: {type(e).__name__}: {e}"[:300]
    finally:
        os.environ["MUTANT_UNDER_TEST"] = ""
    return "a nan on rank 1 was checkpointed"


def _scramble(parts: Any) -> None:
    """Change every floating-point weight and state in place, and the torch RNG."""
    import torch

    with torch.no_grad():
        for v in parts.model.state_dict().values():
            if v.is_floating_point():
                v.add_(1.0)
        for opt in (parts.dense_optimizer, parts.sparse_optimizer):
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.is_floating_point():
                        v.add_(1.0)
    torch.manual_seed(12345)


def _log(log: Path, name: str, status: str, detail: str) -> None:
    with log.open("a") as f:
        f.write(json.dumps({"name": name, "status": status, "detail": detail}) + "\n")


def _files_differ(a: Path, b: Path) -> str | None:
    """How checkpoint directory ``b`` differs from ``a``; ``None`` when it does not."""
    from safetensors.torch import load_file

    fa, fb = sorted(p.name for p in a.iterdir()), sorted(p.name for p in b.iterdir())
    if fa != fb:
        return f"files {fb} instead of {fa}"
    for name in fa:
        if name.endswith(".safetensors"):
            why = _same(load_file(a / name), load_file(b / name))
            if why is not None:
                return f"{name}: {why}"
        elif (a / name).read_bytes() != (b / name).read_bytes():
            ja, jb = json.loads((a / name).read_text()), json.loads((b / name).read_text())
            keys = sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))
            return f"{name} differs in {keys}"
    return None


def mutant_names(mutmut: str) -> list[str]:
    """Every ``_save_sharded`` mutant, then mutmut's survivors in the functions around it.

    ``save_run_state``, ``_check_finite`` (a nan on another rank only) and the loading
    functions have sharded branches too, which one process never takes (or only up to
    the check that refuses a sharded checkpoint there): their mutants there survive
    mutmut.
    """
    text = (MUTANTS / "tetrarec/train/state.py").read_text()
    found = set(re.findall(rf"\['({FUNCTION}__mutmut_\d+)'\]", text))
    names = sorted(found, key=lambda n: int(n.rpartition("_")[2]))
    out = subprocess.run([mutmut, "results"], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        name, _, status = line.strip().rpartition(": ")
        module, _, short = name.rpartition(".")
        if module == MODULE and status == "survived" and short.startswith((*SAVING, *LOADING)):
            names.append(short)
    return names


def main() -> int:
    """Check the mutants; print each one's verdict; exit 0 when the kill ratio reaches the goal."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant names to check (default: all)")
    parser.add_argument("--mutmut", default=".venv/bin/mutmut", help="the mutmut executable")
    parser.add_argument("--json", help="write the verdicts here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per spawn")
    parser.add_argument("--goal", type=float, default=0.9, help="required kill ratio")
    args = parser.parse_args()
    if not (MUTANTS / "tetrarec/train/state.py").exists():
        parser.error("no mutants/: run `mutmut run 'tetrarec.train.state*'` first")
    os.environ.setdefault("XDG_CACHE_HOME", str((MUTANTS / "xdg-cache").resolve()))
    sys.path.insert(0, str(MUTANTS.resolve()))  # the mutated package, in the ranks too
    from tetrarec.testing import RankFailedError, run_ranks

    names = args.only or mutant_names(args.mutmut)
    verdicts: dict[str, tuple[str, str]] = {}
    root = Path(tempfile.mkdtemp(prefix="sharded-state-mutants-"))
    try:
        todo = list(names)
        while todo:
            for log in [*root.glob("progress_*.jsonl"), *root.glob("ready_*")]:
                log.unlink()
            try:
                run_ranks(
                    mutant_worker,
                    world_size=2,
                    args=(todo, str(root)),
                    timeout_s=args.timeout,
                    collective_timeout_s=20.0,
                )
            except RankFailedError as e:
                failure = str(e)[-3000:]
            else:
                failure = ""
            done = _collect(root, todo, verdicts, failure)
            todo = todo[done:]
            print(f"  ... {len(names) - len(todo)}/{len(names)} checked", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    survived = [n for n, (v, _) in verdicts.items() if v == "survived"]
    print(f"sharded {MODULE} mutants: {len(verdicts) - len(survived)}/{len(verdicts)} killed")
    for name, (verdict, why) in verdicts.items():
        print(f"  {verdict}: {MODULE}.{name}  {why}")
    if args.json:
        Path(args.json).write_text(json.dumps(verdicts, indent=1))
    return 0 if verdicts and 1 - len(survived) / len(verdicts) >= args.goal else 1


def _collect(
    root: Path, todo: list[str], verdicts: dict[str, tuple[str, str]], failure: str
) -> int:
    """Record the verdicts the ranks' progress logs hold; return how many of ``todo``."""
    if not all((root / f"ready_{rank}").exists() for rank in (0, 1)):
        raise SystemExit(f"the ranks failed before the first mutant:\n{failure}")
    logs = []
    for rank in (0, 1):
        path = root / f"progress_{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        logs.append([json.loads(line) for line in lines])
    for i, name in enumerate(todo):
        entries = [log[i] for log in logs if i < len(log)]
        raised = [e["detail"] for e in entries if e["status"] == "raised"]
        if raised:
            verdicts[name] = ("killed", f"save raised: {raised[0]}")
            if len(entries) < 2 or any(len(log) == i + 1 for log in logs):
                return i + 1  # the spawn may have ended here
            continue
        if len(entries) < 2:  # this mutant stopped the spawn: a rank hung or died in it
            last = failure.strip().splitlines()[-1:] or ["?"]
            verdicts[name] = ("killed", f"a rank hung or died: {last[0][:200]}")
            return i + 1
        why = None
        if (root / name).exists():
            why = _files_differ(root / "orig" / "step_00000001", root / name / "step_00000001")
        why = why or next((e["detail"] for e in entries if e["detail"]), None)
        verdicts[name] = ("killed", why) if why else ("survived", "")
    return len(todo)


if __name__ == "__main__":
    sys.exit(main())
