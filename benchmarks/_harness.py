"""Shared benchmark harness: warm-up, timed repeats, median/p90, JSON output.

Benchmarks measure against a baseline in the same run and report ratios; absolute
times on these shared machines vary by +-15% between processes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tetrarec import jsonio


@dataclass
class Timing:
    """Per-iteration seconds of one measured callable."""

    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p90(self) -> float:
        s = sorted(self.seconds)
        return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def sync() -> None:
    """Wait for queued device work (no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``iters`` times timed."""
    for _ in range(warmup):
        fn()
    sync()
    t = Timing()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        t.seconds.append(time.perf_counter() - t0)
    return t


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far, GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def current_rss_gib() -> float:
    """Current resident set size of this process, GiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


# CPU flags that decide which vector code the kernels (built with -march=native), oneDNN
# and FBGEMM run: AVX2/FMA/F16C, AVX-512 and its BF16 and VNNI parts, AMX tiles.
KERNEL_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16",
)  # fmt: skip


def cpu_summary() -> dict[str, Any]:
    """This CPU's model name and which of ``KERNEL_FLAGS`` it has."""
    from tetrarec.models.precision import cpu_flags

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    flags = cpu_flags() or frozenset()
    return {"model": model, "flags": [f for f in KERNEL_FLAGS if f in flags]}


def kernel_summary() -> dict[str, Any]:
    """Which tetrarec kernel path this process ran, and what the compiled one was built for.

    Returns:
        ``{"kernels": "compiled" | "portable" | "none"}`` (see
        ``tetrarec.kernels._build.kernel_path``), plus ``"isa"``: the compiled module's
        ``build_info()`` (instruction sets it was compiled for, vector paths) when compiled.
    """
    from tetrarec.kernels._build import compiled_cpu_kernels, kernel_path

    path = kernel_path()
    out: dict[str, Any] = {"kernels": path}
    if path == "compiled":
        ext = compiled_cpu_kernels()
        if ext is not None and hasattr(ext, "build_info"):
            out["isa"] = dict(ext.build_info())
    return out


def environment() -> dict[str, Any]:
    return {
        "git_sha": git_sha(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu_summary(),
    }


def json_path(text: str) -> str:
    """An argparse ``type`` for ``--json``: refuse a path that could only fail at the end.

    Every benchmark writes its JSON after all its work, so a directory, or a path under
    a file, is a usage error before anything runs (``tetrarec.jsonio.check_output_path``),
    however the script is started (``tetrarec bench NAME`` or ``python bench_NAME.py``).
    """
    try:
        jsonio.check_output_path(text, repr(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that a benchmark unwinds as for Ctrl-C."""


@contextlib.contextmanager
def unwind_on_signals(name: str) -> Iterator[None]:
    """Stop on the first SIGINT or SIGTERM by unwinding, so ``finally`` blocks and
    ``with TemporaryDirectory`` delete the benchmark's scratch; exit 143 on SIGTERM.

    Python dies at once on SIGTERM (what ``tetrarec bench`` forwards when it is
    terminated, and what schedulers send), leaving the scratch behind. Once the first
    signal has arrived, later SIGINTs and SIGTERMs are ignored: a second one (Ctrl-C
    reaches the whole process group, and ``tetrarec bench`` may forward one more)
    would otherwise cut the cleanup short. Main thread only.

    Args:
        name: what the one-line message on SIGTERM calls the benchmark.
    """

    def unwind(signum: int, frame: Any) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    before = {s: signal.signal(s, unwind) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except Terminated:
        print(f"{name}: terminated (SIGTERM)", file=sys.stderr)
        raise SystemExit(143) from None
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def write_json(
    path: str | None,
    config: dict[str, Any],
    results: list[dict[str, Any]],
    kernels: dict[str, Any] | None = None,
    **extra: Any,
) -> None:
    """Write ``{"env", "config", "results", **extra}`` to ``path`` (if given).

    ``env.kernels`` is ``kernels`` when given (benchmarks whose workers ran the
    kernels say what they ran), else this process's ``kernel_summary()``. ``extra``:
    more top-level keys (a summary, say).
    """
    if not path:
        return
    env = environment()
    env["kernels"] = kernels if kernels is not None else kernel_summary()
    payload = {"env": env, "config": config, "results": results, **extra}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(jsonio.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def describe_run(kernels: dict[str, Any] | None = None) -> str:
    """One line for a printed table: the CPU, its kernel flags and the kernel path."""
    cpu = cpu_summary()
    k = kernels if kernels is not None else kernel_summary()
    line = f"CPU: {cpu['model']} [{' '.join(cpu['flags']) or 'no listed flags'}]; "
    line += f"tetrarec kernels: {k['kernels']}"
    if k["kernels"] == "portable":
        line += " (portable PyTorch path, not the compiled kernel)"
    if "isa" in k:
        line += f", built for {k['isa'].get('isa', '?')}"
    return line


def print_table(
    rows: list[dict[str, Any]], columns: list[str], digits: Mapping[str, int] | None = None
) -> None:
    """Print ``rows`` as an aligned text table.

    Floats get 3 decimals (none from 100 on), or ``digits[column]`` where given.
    """

    def fmt(v: Any, column: str) -> str:
        if isinstance(v, float):
            if digits and column in digits:
                return f"{v:,.{digits[column]}f}"
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, ""), c) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


class ServingChild:
    """A benchmark's child process that serves one command per stdin line and answers
    with ``@@tag payload`` lines on stdout (its other output is passed through).

    Args:
        argv: the child's command line.
        name: what error messages call it.
    """

    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def expect(self, tag: str) -> str:
        """The payload of the next ``tag`` line (raises if the child exits first)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag) :].strip()
            sys.stdout.write(line)  # the child's own output
        raise RuntimeError(f"{self.name} exited with {self.proc.wait()} before {tag}")

    def send(self, text: str) -> None:
        """One command line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def quit(self) -> float:
        """Stop the child; its peak RSS in GiB (it answers ``quit`` with ``@@rss``)."""
        self.send("quit")
        rss = float(self.expect("@@rss"))
        self.proc.wait()
        return rss
