"""The ``tetrarec`` command (also ``python -m tetrarec``); it holds no logic of its own.

::

    tetrarec demo                                   small DLRM on built-in data, CPU
    tetrarec train --config run.toml [--set k=v ...] [--resume] [--json PATH]
    torchrun --nproc-per-node N -m tetrarec train --config run.toml   (sharded)
    tetrarec eval --checkpoint DIR [--data PATH ...] [--set k=v ...] [--json PATH]
                                                    (DIR may be <checkpoint_dir>/best)
    tetrarec preprocess criteo --input FILE ... --output DIR [--on-bad-line skip]
                               [--json PATH]
    tetrarec preprocess csv|parquet --config run.toml --output FILE.parquet
                                    [--input FILE ...] [--on-bad-line skip] [--set k=v ...]
                                    [--json PATH]
    tetrarec stats --config run.toml [--rows N] [--json PATH] [--set k=v ...]
                                                    per-feature pooling and access skew
    tetrarec plan --config run.toml --world-size N [--topology FILE|PRESET]
                  [--stats stats.json] [--json plan.json] [--plot PATH]
    tetrarec export --checkpoint DIR --output MODEL_DIR [--json PATH]
                                                    a checkpoint as a model directory
    tetrarec predict --model MODEL_DIR --input FILE ... --output FILE
                     [--format parquet|csv] [--batch-size N] [--source SOURCE]
                     [--on-bad-line error|skip] [--id-column NAME] [--json PATH]
    tetrarec quantize --model DIR --output DIR2 [--tables P] [--table NAME=P ...]
                      [--mlp fp32|bf16|int8] [--activations dynamic|static]
                      [--eval FILE ... | --eval-split] [--budget-ne PCT] [--eval-rows N]
                      [--json PATH] [--plot PNG]
    tetrarec quantize --check --model DIR2 --reference DIR --eval FILE ... [--budget-ne PCT]
    tetrarec serve --model DIR [--host H] [--port N] [--max-batch N] [--max-wait-ms MS]
                   [--no-batching] [--threads N] [--max-body-bytes N] [--max-rows N]
                                                    HTTP scoring (SIGTERM/Ctrl-C: exit 0)
    tetrarec bench NAME [args ...]                  runs benchmarks/bench_NAME.py

tetrarec's own errors print one line on stderr (``tetrarec COMMAND: error: ...``), never
a traceback: errors in the user's input (config, data, checkpoint, an id outside its
table) exit 2; a run that fails (a non-finite loss or state, the compiled kernels
failing to build under ``TETRAREC_KERNELS=compiled``, an OS error such as a full disk)
exits 1; Ctrl-C exits 130, SIGTERM (what torchrun, a scheduler or ``docker stop`` send)
143; both unwind the run, so its SSD scratch files are deleted (``bench`` forwards
SIGTERM to its script and waits for it to delete its scratch, at most about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tetrarec import jsonio
from tetrarec.cli.common import at_least_one, write_json
from tetrarec.cli.errors import first_to_say
from tetrarec.cli.inference import INFERENCE_COMMANDS, add_inference_commands
from tetrarec.cli.orphan import watch_launcher

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tetrarec.comm import LaunchInfo
    from tetrarec.config import RunConfig

__all__ = ["main"]

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _add_set(p: argparse.ArgumentParser, *, hidden: bool = False) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=argparse.SUPPRESS
        if hidden
        else "override a config key, as a TOML value (train.steps=100, "
        'train.checkpoint_dir="out/ck", model.dlrm.bottom_mlp=[64,16]); repeatable',
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tetrarec", description="Train, evaluate and benchmark DLRM recommendation models."
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small DLRM on built-in synthetic data")
    demo.add_argument("--json", metavar="PATH", help="write the run summary as JSON")
    _add_set(demo, hidden=True)

    train = sub.add_parser("train", help="train the run a TOML config describes")
    train.add_argument("--config", required=True, type=Path, help="the run's TOML file")
    _add_set(train)
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    train.add_argument("--json", metavar="PATH", help="write the run summary as JSON")

    ev = sub.add_parser("eval", help="evaluate a checkpoint")
    ev.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        help="a checkpoint directory (<checkpoint_dir>/step_N, or <checkpoint_dir>/best)",
    )
    ev.add_argument(
        "--data",
        nargs="+",
        default=[],
        metavar="PATH",
        help="data to evaluate on "
        "(default: the run's evaluation split); the run's data.source applies",
    )
    _add_set(ev)
    ev.add_argument("--json", metavar="PATH", help="write the metrics as JSON")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    pre = sub.add_parser("preprocess", help="parse raw data once into a fast format")
    pre_sub = pre.add_subparsers(dest="format", required=True, metavar="FORMAT")
    criteo = pre_sub.add_parser("criteo", help="Criteo TSV (plain or .gz) files -> binary dir")
    criteo.add_argument("--input", nargs="+", required=True, type=Path, metavar="FILE")
    criteo.add_argument("--output", required=True, type=Path, metavar="DIR")
    criteo.add_argument("--on-bad-line", choices=("error", "skip"), default="error")
    criteo.add_argument("--no-progress", action="store_true")
    criteo.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    for fmt, what in (("csv", "delimited text (plain or .gz)"), ("parquet", "parquet")):
        p = pre_sub.add_parser(
            fmt,
            help=f"{what} files -> one parquet file of raw ids",
            description=f"Parse {what} files once into one parquet file whose sparse columns "
            "hold the raw 64-bit ids (int64, or list<int64> for multi-hot columns), dense "
            "and label columns float32, under the same names. The column mapping "
            "(label_column, dense_columns, sparse_columns) and [data.csv] come from the run "
            'config\'s [data] section; train on the output with data.source = "parquet" '
            "and the same mapping.",
        )
        p.add_argument("--config", required=True, type=Path, help="a run TOML with the mapping")
        p.add_argument(
            "--input",
            nargs="+",
            type=Path,
            metavar="FILE",
            help="the files to convert (default: the config's data.train_path)",
        )
        p.add_argument("--output", required=True, type=Path, metavar="FILE")
        p.add_argument(
            "--on-bad-line",
            choices=("error", "skip"),
            help="default: the config's data.on_bad_line",
        )
        _add_set(p)
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--json", metavar="PATH", help="write the summary as JSON")

    # --- tetrarec stats (the planner's per-feature inputs) ---
    stats = sub.add_parser(
        "stats",
        help="measure each feature's pooling and access skew on the training rows",
        description="Read the first training rows of the run's data and print, per feature, "
        "its table's rows, the mean ids per bag, the share of lookups that hit the hottest "
        "1% and 5% of the table's rows and how many rows were touched (definitions: "
        "tetrarec.planner.stats). --json writes what the planner reads.",
    )
    stats.add_argument("--config", required=True, type=Path, help="the run's TOML file")
    stats.add_argument(
        "--rows",
        type=int,
        help="training rows to read from the start (default: all, at most 1,000,000)",
    )
    stats.add_argument("--json", metavar="PATH", help="write the statistics as JSON")
    _add_set(stats)

    _add_plan(sub)
    add_inference_commands(sub)
    bench = sub.add_parser("bench", help="run benchmarks/bench_NAME.py from the source tree")
    bench.add_argument("name", nargs="?", help="the benchmark (none: list them)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    return parser


def _toml_strings(items: list[str]) -> str:
    r"""A TOML array of basic strings holding ``items`` exactly.

    ``json.dumps`` alone is not TOML: it writes a character beyond the Basic
    Multilingual Plane (an emoji) as a UTF-16 surrogate pair ``\ud83d\ude00``, which
    TOML refuses. So non-ASCII text is kept as is, and only what TOML requires is
    escaped: the quote, the backslash and the control characters (JSON escapes these
    the TOML way too), plus DEL, which JSON leaves alone.
    """
    quoted = (json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f") for s in items)
    return f"[{', '.join(quoted)}]"


def _with_json(config: RunConfig, path: str | None) -> RunConfig:
    """``config`` with ``train.json = path`` when ``--json`` was given."""
    if not path:
        return config
    return dataclasses.replace(config, train=dataclasses.replace(config.train, json=path))


def _demo(args: argparse.Namespace) -> int:
    from tetrarec.train import demo_config, train

    result = train(_with_json(demo_config().with_overrides(args.overrides), args.json))
    assert result.final is not None
    print(
        f"AUC {result.final.auc:.4f}  NE {result.final.ne:.4f}  "
        f"samples/s {result.samples_per_s:,.0f}  ({result.steps} steps)"
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    from tetrarec.config import RunConfig
    from tetrarec.train import train

    # The overrides are merged into the file's values before validation: the file
    # alone need not be a complete run (a Parquet run's paths may come from --set).
    config = _with_json(RunConfig.from_toml(args.config, args.overrides), args.json)
    with _stop_on_sigterm() as stop:
        result = train(config, resume=args.resume, launch=args.launch, stop=stop)
    if args.launch.rank != 0:  # rank 0 reports for the run
        return 0
    if result.final is not None:
        print(result.final.summary())
    print(f"samples/s {result.samples_per_s:,.0f}  steps {result.steps}")
    if result.checkpoint:
        print(f"checkpoint {result.checkpoint}")
    best = result.best_summary()
    if best is not None:
        print(best + (f"  checkpoint {result.best_checkpoint}" if result.best_checkpoint else ""))
    if result.stopped_early:
        print(f"stopped early at step {result.steps} (train.early_stop_patience)")
    if result.bad_lines is not None and result.bad_lines.skipped:
        print(f"input files: {result.bad_lines.summary()}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tetrarec.train import evaluate_checkpoint
    from tetrarec.train.metrics import miscalibration

    metrics = evaluate_checkpoint(
        args.checkpoint, data=args.data, overrides=args.overrides, progress=not args.no_progress
    )
    note = miscalibration(metrics)
    if note is not None:
        logging.getLogger("tetrarec.eval").warning("miscalibrated: %s", note)
    print(metrics.summary())
    write_json(args.json, {"checkpoint": str(args.checkpoint), **metrics.to_dict()})
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from tetrarec.data import ColumnMapping, preprocess_criteo, preprocess_to_parquet

    if args.format == "criteo":
        summary = preprocess_criteo(
            args.input, args.output, on_bad_line=args.on_bad_line, progress=not args.no_progress
        )
        print(summary.summary())
        write_json(args.json, summary.to_dict())
        return 0
    from tetrarec.config import RunConfig

    # --input stands for data.train_path, and --set is merged before the config is
    # validated (as for train): either may give what the file leaves out.
    overrides = list(args.overrides)
    if args.input:
        overrides.append(f"data.train_path={_toml_strings([str(p) for p in args.input])}")
    data = RunConfig.from_toml(args.config, overrides).data
    if not data.sparse_columns:
        other = f" (its data.source is {str(data.source)!r})" if data.source != args.format else ""
        raise ValueError(
            f"preprocess {args.format} reads the columns that the config maps, and "
            f"{args.config}{other} maps none: set data.sparse_columns, data.label_column "
            "and data.dense_columns"
        )
    summary = preprocess_to_parquet(
        data.train_path,
        args.output,
        source=args.format,
        mapping=ColumnMapping(
            label_column=data.label_column,
            dense_columns=data.dense_columns,
            sparse_columns=data.sparse_columns,
        ),
        csv=data.csv,
        on_bad_line=args.on_bad_line or data.on_bad_line,
        progress=not args.no_progress,
    )
    print(summary.summary())
    write_json(args.json, summary.to_dict())
    return 0


def _stats(args: argparse.Namespace) -> int:
    from tetrarec.config import RunConfig
    from tetrarec.config.tables import build_tables
    from tetrarec.data import build_datasets
    from tetrarec.planner import feature_stats

    config = RunConfig.from_toml(args.config, args.overrides)
    tables = build_tables(config.model)
    train, _ = build_datasets(config.data, tables)
    result = feature_stats(train, tables, rows=args.rows, batch_size=config.data.batch_size)
    print(f"{result.rows_sampled:,} training rows read (batch size {result.batch_size:,})")
    print(result.format_table())
    write_json(args.json, result.to_json())
    return 0


# --- tetrarec plan (the sharding planner) -------------------------------------------------


def _add_plan(sub: Any) -> None:
    plan = sub.add_parser("plan", help="plan the sharding of a run's tables and explain it")
    plan.add_argument("--config", required=True, type=Path, help="the run's TOML file")
    plan.add_argument("--world-size", required=True, type=at_least_one, help="ranks to plan for")
    plan.add_argument(
        "--topology",
        default="this-machine",
        help="a topology TOML file or a preset (this-machine, gpu-node-8, zionex-16x8)",
    )
    plan.add_argument("--stats", type=Path, help="feature statistics (tetrarec stats --json)")
    plan.add_argument(
        "--json", metavar="PATH", help="write the plan (sharding.plan) and PATH.report.json"
    )
    plan.add_argument("--plot", metavar="PATH", help="per-rank memory and time bars (PNG)")
    _add_set(plan)


def _plan(args: argparse.Namespace) -> int:
    from tetrarec.config import RunConfig
    from tetrarec.planner import Topology, inputs_from_config, plan
    from tetrarec.planner.report import plot_report

    config = RunConfig.from_toml(args.config, args.overrides)
    topology = Topology.resolve(args.topology)
    # Ranks per node: the config's, else one node of processes on a machine without a
    # device (what torchrun --nproc-per-node N runs), else the topology's nodes.
    local = config.sharding.local_world_size or (
        args.world_size if topology.rank.device_memory == 0 and topology.nodes == 1 else None
    )
    topology = topology.resized(args.world_size, local)
    sharding_plan, report = plan(inputs_from_config(config, topology, args.stats))
    print(report.describe())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        sharding_plan.save(args.json)
        report.save(f"{args.json}.report.json")
        print(f"wrote {args.json} (set sharding.plan to it) and {args.json}.report.json")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    folder = _REPO_ROOT / "benchmarks"
    found = ", ".join(sorted(p.stem.removeprefix("bench_") for p in folder.glob("bench_*.py")))
    if args.name is None:
        raise ValueError(
            f"name a benchmark (tetrarec bench NAME --help for its options); available: "
            f"{found or f'none ({folder} has no bench_*.py)'}"
        )
    script = folder / f"bench_{args.name}.py"
    if not script.is_file():
        raise ValueError(
            f"no benchmark {args.name!r}: {script} does not exist (benchmarks live in the "
            f"source tree, not in an installed package); available: {found or 'none'}"
        )
    # The script imports the tetrarec of this same source tree, installed or not. It
    # runs in the caller's directory, so that relative paths (--json out.json) are the
    # caller's; scripts find the repository's own files (examples/) from __file__.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    child = subprocess.Popen([sys.executable, str(script), *args.args], env=env)
    try:
        return child.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the child too: the terminal signals its whole process group.
        _let_child_unwind(child, then=(signal.SIGTERM, signal.SIGKILL))
        raise
    except _Terminated:
        child.send_signal(signal.SIGTERM)  # only this process was told
        _let_child_unwind(child, then=(signal.SIGKILL,))
        raise


# How long a stopping benchmark gets to unwind (delete its scratch) before the next step.
_CHILD_STOP_S = 30.0


def _let_child_unwind(child: subprocess.Popen[bytes], then: tuple[signal.Signals, ...]) -> None:
    """Wait for a signalled child to unwind and exit; escalate while it does not.

    After each ``_CHILD_STOP_S`` that the child is still running it is sent the next
    signal of ``then``. ``subprocess.call`` killed the child at once on Ctrl-C, before
    its ``finally`` blocks ran (a ``tetrarec-quality-*`` scratch directory of 15 MB
    was left behind). A bench script ignores repeated SIGINTs and SIGTERMs while it
    unwinds (``benchmarks/_harness.unwind_on_signals``), so the SIGTERM after a Ctrl-C
    only matters to a child that never got the Ctrl-C (a SIGINT sent to this process
    alone). A second signal to this process while it waits kills the child at once.
    """
    try:
        for signum in then:
            try:
                child.wait(timeout=_CHILD_STOP_S)
                return
            except subprocess.TimeoutExpired:
                child.send_signal(signum)
        child.wait()
    except BaseException:
        child.kill()
        child.wait()
        raise


_COMMANDS = {
    "demo": _demo,
    "train": _train,
    "eval": _eval,
    "preprocess": _preprocess,
    "stats": _stats,
    "plan": _plan,
    **INFERENCE_COMMANDS,
    "bench": _bench,
}


_NEEDS_KERNELS = frozenset({"demo", "train", "eval", "predict", "quantize", "serve"})
_MAX_LINE = 1000  # longer messages are cut: one line must stay readable


class _RunFailedError(Exception):
    """A failure the command reports as one line with exit status 1."""


def _one_line(error: BaseException) -> str:
    """The error's message on one line (multi-line messages are joined)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    text = text or type(error).__name__
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 3] + "..."


def _build_kernels(command: str) -> None:
    """Build (or load) the compiled kernels before the command's work starts.

    Under ``TETRAREC_KERNELS=compiled`` a failed build raises ``RuntimeError`` with the
    whole compiler output; here it becomes one line naming the first compiler error.
    """
    if command not in _NEEDS_KERNELS:
        return
    from tetrarec.kernels import build_cpu_kernels

    try:
        build_cpu_kernels()
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first_error = next((ln for ln in lines[1:] if "error" in ln.lower()), "")
        head = lines[0] if lines else "building tetrarec CPU kernels failed"
        detail = f" ({first_error})" if first_error and first_error not in head else ""
        raise _RunFailedError(
            f"{head[:200]}{detail[:200]}; TETRAREC_KERNELS=compiled makes this an error "
            "(unset it to fall back to the portable PyTorch path)"
        ) from e


def _fail(command: str, error: BaseException, status: int, launch: LaunchInfo) -> int:
    """Print the error's line (once per distinct line on a torchrun node); ``status``."""
    line = f"tetrarec {command}: error: {_one_line(error)}"
    if first_to_say(line, launch.world_size):
        print(line, file=sys.stderr)
    return status


def _log_format(launch: LaunchInfo) -> str:
    """The log line's format.

    Under torchrun the other ranks log warnings only, and each line says whose it is: a
    warning about the data that every rank reads is one line per rank, told apart.
    """
    rank = f"rank {launch.rank} " if launch.world_size > 1 else ""
    return f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in ``argv`` (default ``sys.argv[1:]``); return the exit status.

    tetrarec's own errors are reported as one line on stderr (see the module docstring
    for the exit statuses); any other exception is a bug and keeps its traceback.
    """
    args = _parser().parse_args(argv)
    from tetrarec.comm import launch_info

    # torchrun's environment, read once: it says which rank this process is.
    args.launch = launch_info()
    logging.basicConfig(
        level=logging.WARNING if args.quiet or args.launch.rank != 0 else logging.INFO,
        format=_log_format(args.launch),
        stream=sys.stderr,
    )
    from tqdm.contrib.logging import logging_redirect_tqdm

    from tetrarec.comm import CollectiveError
    from tetrarec.train import NonFiniteLossError, NonFiniteStateError, TrainingStoppedError

    on_term = _raise_on_sigterm()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: stop if it dies
        watch_launcher()
    try:
        with logging_redirect_tqdm():
            _check_json_path(getattr(args, "json", None))
            _build_kernels(args.command)
            return _COMMANDS[args.command](args)
    except _Terminated:
        print(f"tetrarec {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except TrainingStoppedError as e:
        if args.launch.rank == 0:
            print(f"tetrarec {args.command}: SIGTERM: {e}", file=sys.stderr)
        return 143
    except (NonFiniteLossError, NonFiniteStateError, CollectiveError, _RunFailedError) as e:
        return _fail(args.command, e, 1, args.launch)
    except (ValueError, FileNotFoundError) as e:  # DataError is a ValueError
        return _fail(args.command, e, 2, args.launch)
    except OSError as e:
        return _fail(args.command, e, 1, args.launch)
    except KeyboardInterrupt:
        print(f"tetrarec {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)


def _check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` path the command could only fail to write after its work.

    Every command writes its JSON last (after training, evaluating or preprocessing).

    Raises:
        ValueError: naming the path.
    """
    if path:
        jsonio.check_output_path(path, f"--json {path!r}")


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the run unwinds as for Ctrl-C."""


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[threading.Event]:
    """An event that the first SIGTERM sets; a second SIGTERM raises ``_Terminated``.

    A run given the event checkpoints the step it is in and raises
    ``TrainingStoppedError``. Off the main thread (no handler there) it is never set.
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request_stop(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise _Terminated
        stop.set()
        logger.info("SIGTERM: stopping after this step, with a checkpoint of it")

    previous = signal.signal(signal.SIGTERM, request_stop)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise ``_Terminated``; return the handler it replaces (to restore).

    Python's default is to die at once, leaving what only unwinding deletes (an ``ssd``
    table's scratch files) behind. ``None`` off the main thread (no handler there).
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    return signal.signal(signal.SIGTERM, raise_terminated)
