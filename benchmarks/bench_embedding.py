"""Embedding lookup + fused update throughput: tetrarec vs plain PyTorch vs FBGEMM (CPU).

One step = forward pooled lookup of every table + backward + sparse optimizer update,
with the optimizer of ``--optimizer`` on every implementation that has it.

    python benchmarks/bench_embedding.py                       # workload W (26 x 1M x 64)
    python benchmarks/bench_embedding.py --smoke               # tiny, seconds
    python benchmarks/bench_embedding.py --sweep --json sweep.json   # shapes, vs FBGEMM

Implementations: ``tetrarec-<precision>`` (FusedEmbeddingBagCollection; labelled
``...-portable`` when the portable PyTorch path ran instead of the compiled kernel),
``torch-embeddingbag`` (``nn.EmbeddingBag(sparse=True)`` per table and the closest torch
optimizer, named in each row's ``optimizer``: torch has no row-wise Adagrad, so
``rowwise_adagrad`` runs element-wise ``Adagrad`` there, and Adam runs as
``SparseAdam``), and ``fbgemm-cpu`` (``SplitTableBatchedEmbeddingBagsCodegen`` on the
host with ``EXACT_SGD``, ``EXACT_ADAGRAD`` or ``EXACT_ROWWISE_ADAGRAD``; FBGEMM has no
CPU Adam, so it sits out Adam runs), when ``fbgemm_gpu`` imports.

Interleaved rounds. Each implementation lives in its own worker process, which keeps
its tables (and its own peak RSS) between rounds; the parent tells the workers in turn
to time a few steps (``--rounds`` rounds, each starting with the next worker), so every
implementation sees the same mix of quiet and busy spells of a shared machine. A ratio
``vs_X`` is the median over rounds of X's median step time in that round over this
implementation's. Workers that do not fit together in ``--max-gib`` are split into
groups that each hold the first baseline (FBGEMM, else torch); a ratio between two
implementations timed in different groups is marked in ``not_interleaved``. Every
implementation that fits alone is timed (the baseline alone if nothing fits beside
it); a requested one that cannot run (FBGEMM not importable or without the optimizer,
a worker over ``--max-gib`` alone) is printed as ``NOT RUN`` with its reason and
listed in the JSON's ``not_run``.

``--sweep`` varies the shape around a centre point (one factor at a time, plus corners
that combine the extremes): see ``sweep_points``. ``--breakdown`` (on in the sweep)
also times each FP32 implementation's forward alone and a plain gather of every id's
row from tetrarec's FP32 tables (``torch.index_select``): the random-row-read floor of
the step's forward.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import (
    ServingChild,
    cpu_summary,
    json_path,
    kernel_summary,
    measure,
    peak_rss_gib,
    print_table,
    unwind_on_signals,
    write_json,
)

PROCESS_GIB = 0.45  # RSS of a worker before its tables (torch, and FBGEMM's libraries)
FBGEMM_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
}
TORCH_OPTIMIZERS = {  # tetrarec optimizer -> (torch optimizer, state bytes per weight)
    "sgd": ("SGD", 0),
    "adagrad": ("Adagrad", 4),
    "rowwise_adagrad": ("Adagrad (element-wise; torch has no row-wise Adagrad)", 4),
    "adam": ("SparseAdam", 8),
    "rowwise_adam": ("SparseAdam (element-wise second moment)", 8),
}


@dataclass(frozen=True)
class Point:
    """One workload: the tables' shape and the batch's."""

    tables: int
    rows: int
    dim: int
    batch: int
    pooling: int
    why: str = ""

    def table_key(self) -> tuple[int, int, int]:
        return (self.tables, self.rows, self.dim)


# -- arguments ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling", default="1,20", help="ids per bag; comma-separated list")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--optimizer", default="rowwise_adagrad")
    p.add_argument("--precision", default="fp32,fp16,int8", help="tetrarec row precisions")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    p.add_argument(
        "--iters", type=int, default=0, help="steps per round (0: about --round-s seconds)"
    )
    p.add_argument("--round-s", type=float, default=0.3, help="seconds per round and impl")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", default="tetrarec,torch,fbgemm", help="which to run")
    p.add_argument("--max-gib", type=float, default=None, help="memory of workers alive at once")
    p.add_argument("--sweep", action="store_true", help="the shape sweep against FBGEMM")
    p.add_argument("--breakdown", action="store_true", help="also time forward alone, gather")
    p.add_argument(
        "--rows-scale",
        type=float,
        default=1.0,
        help="multiply the sweep's rows (for trial runs in less memory; final figures: 1)",
    )
    p.add_argument("--nondeterministic", action="store_true", help="also time deterministic=False")
    p.add_argument(
        "--small-pages",
        action="store_true",
        help="also time tetrarec with 4 KiB pages only (TETRAREC_HUGE_PAGES=0)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument(
        "--workers",
        choices=["process", "local"],
        default=None,
        help="a process per implementation (default), or all in this one (--smoke's default)",
    )
    p.add_argument("--json", type=json_path, default=None, help="write results to this path")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sweep:
        args.breakdown = True
        if "--precision" not in (argv if argv is not None else sys.argv[1:]):
            args.precision = "fp32"
        if "--impls" not in (argv if argv is not None else sys.argv[1:]):
            args.impls = "tetrarec,fbgemm"
    if args.max_gib is None:
        args.max_gib = 8.0 if args.sweep else 14.0
    if args.workers is None:
        args.workers = "local" if args.smoke else "process"
    if args.smoke:
        args.tables, args.rows, args.dim, args.batch = 3, 1000, 16, 64
        args.rounds, args.iters, args.warmup = 2, 1, 1
        args.pooling, args.precision = "3", "fp32,int8"
    return args


def sweep_points(smoke: bool = False) -> list[Point]:
    """The sweep: the centre C, one factor at a time around it, and corners.

    C = 26 tables x 500k rows x dim 64, batch 2048, pooling 1: workload W with half its
    rows, so that tetrarec's and FBGEMM's tables (3.2 GiB each) are alive together in
    8 GiB; pooling 1 is where FBGEMM came closest. Along the dim axis the rows shrink as
    the dim grows (same bytes per table); rows of 1M and 2M need fewer tables. 26 x 2M
    x 256 FP32 (53 GB) or any point over ~3.3 GiB of tables per implementation does not
    fit. The corners pair the extremes: tiny batches on huge tables (fixed costs, TLB),
    huge batches and pooling on small rows (throughput), dim 256 at both batch ends.
    """
    if smoke:
        return [Point(2, 500, 8, 32, 1, "smoke"), Point(3, 400, 8, 32, 4, "smoke")]
    c = Point(26, 500_000, 64, 2048, 1, "centre")
    pts = [c]
    pts += [replace(c, dim=d, rows=c.rows * 64 // d, why="dim") for d in (32, 128, 256)]
    pts += [replace(c, batch=b, why="batch") for b in (512, 1024, 4096, 8192)]
    pts += [replace(c, pooling=p, why="pooling") for p in (5, 20, 50)]
    pts += [replace(c, tables=t, why="tables") for t in (8, 13)]
    pts += [replace(c, rows=r, why="rows") for r in (100_000, 250_000)]
    pts += [replace(c, tables=13, rows=1_000_000, why="rows")]
    pts += [
        Point(8, 2_000_000, 32, 512, 1, "corner"),
        Point(8, 2_000_000, 32, 8192, 50, "corner"),
        Point(8, 2_000_000, 32, 2048, 20, "corner"),
        Point(26, 100_000, 256, 512, 1, "corner"),
        Point(26, 100_000, 256, 8192, 20, "corner"),
        Point(8, 100_000, 32, 512, 1, "corner"),
        Point(26, 100_000, 32, 8192, 50, "corner"),
        Point(8, 250_000, 256, 2048, 50, "corner"),
    ]
    return pts


def base_points(args: argparse.Namespace) -> list[Point]:
    if args.sweep:
        pts = sweep_points(args.smoke)
        if args.rows_scale != 1.0:  # a development aid: less memory, other cache behaviour
            pts = [replace(p, rows=max(1, round(p.rows * args.rows_scale))) for p in pts]
        return pts
    return [
        Point(args.tables, args.rows, args.dim, args.batch, int(p), "")
        for p in args.pooling.split(",")
    ]


# -- workload -----------------------------------------------------------------------------


def zipf_batches(point: Point, zipf: float, n: int = 4) -> np.ndarray:
    """``(n, T, B*L)`` ids: Zipf ranks scattered over the rows by a multiplicative hash."""
    rng = np.random.default_rng(1234 + point.pooling)
    ranks = np.arange(1, point.rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** (-zipf))
    cdf /= cdf[-1]
    u = rng.random((n, point.tables, point.batch * point.pooling))
    r = np.minimum(np.searchsorted(cdf, u), point.rows - 1).astype(np.int64)
    return (r * 2_654_435_761 + 12_345) % point.rows  # spread the hot rows


def unique_rows(batches: np.ndarray) -> float:
    """Mean unique (table, row) pairs per batch."""
    return float(np.mean([sum(len(np.unique(t)) for t in b) for b in batches]))


def memcopy_gbps(size_mib: int = 512) -> float:
    """Bandwidth of a large copy, GB/s counting bytes read plus bytes written."""
    src = torch.ones(size_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=2, iters=5)
    return 2 * src.numel() * 4 / t.median / 1e9


def row_bytes(impl: str, dim: int) -> int:
    """Stored bytes of one row (FP32 unless a tetrarec precision says otherwise)."""
    from tetrarec.types import Precision

    if impl.startswith("tetrarec-"):
        return Precision.parse(impl.split("-")[1]).row_bytes(dim)
    return 4 * dim


def state_bytes(impl: str, optimizer: str, dim: int) -> int:
    """Optimizer-state bytes per row."""
    from tetrarec.kernels import state_layout
    from tetrarec.types import OptimizerKind

    if impl == "torch-embeddingbag":
        return TORCH_OPTIMIZERS[optimizer][1] * dim
    return 4 * sum(state_layout(OptimizerKind.parse(optimizer), dim).values())


def estimate_gib(impl: str, point: Point, optimizer: str) -> float:
    """Memory of a worker holding ``point``'s tables, state and batches, GiB."""
    per_row = row_bytes(impl, point.dim) + state_bytes(impl, optimizer, point.dim)
    ids = 4 * point.tables * point.batch * point.pooling * 8
    dense = 3 * point.batch * point.tables * point.dim * 4  # output, gradient, scratch
    return PROCESS_GIB + (point.tables * point.rows * per_row + ids + dense) / 2**30


# -- implementations (worker side): each returns {variant: step}, storage bytes ----------


def setup_tetrarec(impl: str, point: Point, optimizer: str) -> Any:
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.kernels import FusedEmbeddingBagCollection

    _, precision, *flags = impl.split("-")
    before = os.environ.get("TETRAREC_HUGE_PAGES")
    if "smallpages" in flags:  # read when the tables are allocated, just below
        os.environ["TETRAREC_HUGE_PAGES"] = "0"
    tables = [
        TableConfig(name=f"t{i}", num_embeddings=point.rows, dim=point.dim, precision=precision)
        for i in range(point.tables)
    ]
    spec = SparseOptimizerSpec(kind=optimizer, lr=0.01)
    ebc = FusedEmbeddingBagCollection(tables, spec, seed=0, deterministic="nondet" not in flags)
    if before is None:
        os.environ.pop("TETRAREC_HUGE_PAGES", None)
    else:
        os.environ["TETRAREC_HUGE_PAGES"] = before
    storage = sum(b.numel() * b.element_size() for n, b in ebc.named_buffers() if "_weights" in n)
    return ebc, storage, ebc.optimizer_spec.kind.value


def tetrarec_steps(ebc: Any, impl: str, point: Point, ids: np.ndarray, breakdown: bool) -> Any:
    from tetrarec.sparse import SparseFeatures

    keys = tuple(f"t{i}" for i in range(point.tables))
    lengths = torch.full((point.tables * point.batch,), point.pooling, dtype=torch.int64)
    feats = [
        SparseFeatures(keys, torch.from_numpy(b.reshape(-1)), lengths, point.batch) for b in ids
    ]
    grad = torch.randn(point.batch, point.tables * point.dim)
    it = iter(range(10**9))

    def step() -> None:
        out = ebc(feats[next(it) % len(feats)]).values
        out.backward(grad)

    steps = {"step": step}
    if breakdown and impl == "tetrarec-fp32":

        def forward() -> None:
            with torch.no_grad():
                ebc(feats[next(it) % len(feats)])

        steps["forward"] = forward
        steps["gather"] = gather_step(ebc._storage(0).view(-1, point.dim), point, ids)
    return steps


def gather_step(rows: torch.Tensor, point: Point, ids: np.ndarray) -> Any:
    """Read every id's row once (``index_select`` in 64k-id pieces): the forward's floor."""
    offs = (np.arange(point.tables, dtype=np.int64) * point.rows)[None, :, None]
    flat = [torch.from_numpy((ids + offs)[i].reshape(-1)) for i in range(len(ids))]
    piece = 1 << 16
    buf = torch.empty(min(piece, flat[0].numel()), point.dim)
    it = iter(range(10**9))

    def step() -> None:
        g = flat[next(it) % len(flat)]
        for s in range(0, g.numel(), piece):
            part = g[s : s + piece]
            torch.index_select(rows, 0, part, out=buf[: part.numel()])

    return step


def setup_torch(point: Point, optimizer: str) -> Any:
    bags = [
        torch.nn.EmbeddingBag(point.rows, point.dim, mode="sum", sparse=True)
        for _ in range(point.tables)
    ]
    params = [b.weight for b in bags]
    name, _ = TORCH_OPTIMIZERS[optimizer]
    opt = getattr(torch.optim, name.split(" ")[0])(params, lr=0.01)
    ran = type(opt).__name__ + name[len(name.split(" ")[0]) :]  # its class, and the caveat
    return (bags, opt), sum(p.numel() * 4 for p in params), ran


def torch_steps(obj: Any, point: Point, ids: np.ndarray) -> Any:
    bags, opt = obj
    offsets = torch.arange(point.batch, dtype=torch.int64) * point.pooling
    per_table = [[torch.from_numpy(t) for t in b] for b in ids]
    grad = torch.randn(point.batch, point.tables * point.dim)
    it = iter(range(10**9))

    def step() -> None:
        batch = per_table[next(it) % len(per_table)]
        opt.zero_grad(set_to_none=True)
        out = torch.cat([bag(x, offsets) for bag, x in zip(bags, batch)], dim=1)
        out.backward(grad)
        opt.step()

    return {"step": step}


def setup_fbgemm(point: Point, optimizer: str) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [(point.rows, point.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * point.tables
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer]),
        learning_rate=0.01,
        eps=1e-8,
    )
    storage = sum(w.numel() * w.element_size() for w in tbe.split_embedding_weights())
    return tbe, storage, tbe.optimizer.name


def fbgemm_steps(tbe: Any, point: Point, ids: np.ndarray, breakdown: bool) -> Any:
    offsets = torch.arange(point.tables * point.batch + 1, dtype=torch.int64) * point.pooling
    flat = [torch.from_numpy(b.reshape(-1)) for b in ids]
    grad = torch.randn(point.batch, point.tables * point.dim)
    it = iter(range(10**9))

    def step() -> None:
        out = tbe(flat[next(it) % len(flat)], offsets)
        out.backward(grad)

    steps = {"step": step}
    if breakdown:

        def forward() -> None:
            with torch.no_grad():
                tbe(flat[next(it) % len(flat)], offsets)

        steps["forward"] = forward
    return steps


class Bench:
    """One implementation's tables and step functions, re-used across points."""

    def __init__(self, impl: str, args: argparse.Namespace) -> None:
        self.impl, self.args = impl, args
        self.key: tuple[int, int, int] | None = None
        self.obj: Any = None
        self.storage = 0
        self.optimizer = ""  # as the implementation names the optimizer it runs
        self.steps: dict[str, Any] = {}

    def drop(self) -> None:
        self.obj, self.steps, self.key = None, {}, None
        gc.collect()

    def setup(self, point: Point, ids_path: str) -> dict[str, Any]:
        """Build (or keep) the tables of ``point``; load its batches; warm up."""
        torch.set_num_threads(self.args.threads)
        opt, t0 = self.args.optimizer, time.perf_counter()
        if self.key != point.table_key():
            self.drop()
            if self.impl.startswith("tetrarec-"):
                self.obj, self.storage, self.optimizer = setup_tetrarec(self.impl, point, opt)
            elif self.impl == "torch-embeddingbag":
                self.obj, self.storage, self.optimizer = setup_torch(point, opt)
            else:
                self.obj, self.storage, self.optimizer = setup_fbgemm(point, opt)
            self.key = point.table_key()
        init_s = time.perf_counter() - t0
        ids = np.load(ids_path)
        if self.impl.startswith("tetrarec-"):
            self.steps = tetrarec_steps(self.obj, self.impl, point, ids, self.args.breakdown)
        elif self.impl == "torch-embeddingbag":
            self.steps = torch_steps(self.obj, point, ids)
        else:
            self.steps = fbgemm_steps(self.obj, point, ids, self.args.breakdown)
        est = {}
        for variant, fn in self.steps.items():
            warm = measure(fn, warmup=max(0, self.args.warmup - 1), iters=1)
            est[variant] = warm.median
        return {
            "init_s": init_s,
            "storage_gib": self.storage / 2**30,
            "estimate_s": est,
            "optimizer": self.optimizer,
            **self.kernels(),
        }

    def kernels(self) -> dict[str, Any]:
        if not self.impl.startswith("tetrarec-"):
            return {"kernels": self.impl.split("-")[0]}
        return kernel_summary()

    def run(self, variant: str, iters: int) -> list[float]:
        return measure(self.steps[variant], warmup=0, iters=iters).seconds


# -- worker processes ------------------------------------------------------------------------
# Protocol, one line each (the child's own output passes through):
#   parent -> child "setup <point json> <ids.npy>"  child -> parent "@@ready <info json>"
#   parent -> child "run <variant> <k>"              child -> parent "@@times [s, ...]"
#   parent -> child "drop"                           child -> parent "@@dropped"
#   parent -> child "quit"                           child -> parent "@@rss <GiB>"


def serve(args: argparse.Namespace) -> None:
    bench = Bench(args.serve, args)
    print("@@up", flush=True)
    for line in sys.stdin:
        cmd, *rest = line.strip().split(" ", 1)
        arg = rest[0].strip() if rest else ""
        if cmd == "setup":
            spec, ids_path = arg.rsplit(" ", 1)
            print(
                "@@ready " + json.dumps(bench.setup(Point(**json.loads(spec)), ids_path)),
                flush=True,
            )
        elif cmd == "run":
            variant, k = arg.split()
            print("@@times " + json.dumps(bench.run(variant, int(k))), flush=True)
        elif cmd == "drop":
            bench.drop()
            print("@@dropped", flush=True)
        elif cmd == "quit":
            print(f"@@rss {peak_rss_gib()}", flush=True)
            return


class Worker:
    """A serving child process for one implementation (``--smoke``: a ``Bench`` here)."""

    def __init__(self, impl: str, args: argparse.Namespace, passthrough: list[str]) -> None:
        self.impl = impl
        self.local = Bench(impl, args) if args.workers == "local" else None
        self.child: ServingChild | None = None
        if self.local is None:
            argv = [sys.executable, str(Path(__file__).resolve()), *passthrough, "--serve", impl]
            self.child = ServingChild(argv, f"{impl} worker")
            self.child.expect("@@up")

    def _ask(self, command: str, tag: str) -> str:
        assert self.child is not None
        self.child.send(command)
        return self.child.expect(tag)

    def setup(self, point: Point, ids_path: str) -> dict[str, Any]:
        if self.local is not None:
            return self.local.setup(point, ids_path)
        info: dict[str, Any] = json.loads(
            self._ask(f"setup {json.dumps(asdict(point))} {ids_path}", "@@ready")
        )
        return info

    def run(self, variant: str, iters: int) -> list[float]:
        if self.local is not None:
            return self.local.run(variant, iters)
        return list(json.loads(self._ask(f"run {variant} {iters}", "@@times")))

    def drop(self) -> None:
        if self.local is not None:
            self.local.drop()
            return
        self._ask("drop", "@@dropped")

    def finish(self) -> float:
        if self.local is not None:
            return peak_rss_gib()
        assert self.child is not None
        return self.child.quit()


# -- the parent: groups, interleaved rounds, ratios ------------------------------------------


def impl_names(args: argparse.Namespace) -> list[str]:
    """Implementations to run, baselines first (the first one anchors every group)."""
    return requested_impls(args)[0]


def requested_impls(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """``(names, not_run)``: what runs, baselines first, and each requested
    implementation that cannot run with the reason (printed and in the JSON)."""
    wanted = args.impls.split(",")
    names: list[str] = []
    not_run: dict[str, str] = {}
    if "fbgemm" in wanted:
        if args.optimizer not in FBGEMM_OPTIMIZERS:
            not_run["fbgemm-cpu"] = f"FBGEMM has no CPU {args.optimizer}"
        else:
            try:
                import fbgemm_gpu  # noqa: F401

                names.append("fbgemm-cpu")
            except Exception as exc:  # optional comparison target, never a dependency
                not_run["fbgemm-cpu"] = f"fbgemm_gpu not importable ({exc})"
    if "torch" in wanted:
        names.append("torch-embeddingbag")
    if "tetrarec" in wanted:
        for p in args.precision.split(","):
            names.append(f"tetrarec-{p}")
            if args.nondeterministic:
                names.append(f"tetrarec-{p}-nondet")
            if args.small_pages:
                names.append(f"tetrarec-{p}-smallpages")
    for impl, why in not_run.items():
        print(f"NOT RUN: {impl}: {why}", file=sys.stderr)
    return names, not_run


def too_big(impls: list[str], point: Point, args: argparse.Namespace) -> dict[str, str]:
    """Each of ``impls`` whose worker alone needs more than ``--max-gib``, with why."""
    gib = {i: estimate_gib(i, point, args.optimizer) for i in impls}
    return {
        i: f"needs {g:.1f} GiB alone at {point}, over --max-gib {args.max_gib:g}"
        for i, g in gib.items()
        if g > args.max_gib
    }


def plan_groups(impls: list[str], point: Point, args: argparse.Namespace) -> list[list[str]]:
    """Split ``impls`` into groups whose workers fit in ``--max-gib`` together.

    Every implementation that fits alone is in a group (the anchor ``impls[0]`` too,
    alone if nothing fits beside it); every group holds the anchor where it fits beside
    it. Those that do not fit alone are left out: ``too_big`` names them.
    """
    gib = {i: estimate_gib(i, point, args.optimizer) for i in impls}
    fits = [i for i in impls if gib[i] <= args.max_gib]
    anchor = impls[0] if impls and impls[0] in fits else None
    groups: list[list[str]] = []
    cur = [anchor] if anchor else []
    for impl in (i for i in fits if i != anchor):
        if sum(gib[i] for i in cur) + gib[impl] <= args.max_gib:
            cur.append(impl)
            continue
        if cur != [anchor]:  # the anchor alone waits: a later group may hold it
            groups.append(cur)
        beside = anchor is not None and gib[anchor] + gib[impl] <= args.max_gib
        cur = [anchor, impl] if beside else [impl]
    if cur:
        groups.append(cur)
    if anchor is not None and not any(anchor in g for g in groups):
        groups.insert(0, [anchor])  # it fits beside nobody: timed alone, never dropped
    return groups


def timed_rounds(
    workers: dict[str, Worker], jobs: list[tuple[str, str]], est: dict[tuple[str, str], float],
    args: argparse.Namespace,
) -> dict[tuple[str, str], list[tuple[float, list[float]]]]:  # fmt: skip
    """Run ``args.rounds`` rounds; each round times every job once, starting one later.

    Returns:
        Per job, per round: (when the round's run started, seconds after the first
        run; the step times).
    """
    out: dict[tuple[str, str], list[tuple[float, list[float]]]] = {j: [] for j in jobs}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for n in range(len(jobs)):
            impl, variant = jobs[(r + n) % len(jobs)]
            k = args.iters or max(1, min(50, round(args.round_s / max(est[(impl, variant)], 1e-6))))
            started = time.perf_counter() - t0
            out[(impl, variant)].append((started, workers[impl].run(variant, k)))
    return out


def measure_group(
    group: list[str], points: list[Point], workers: dict[str, Worker], args: argparse.Namespace,
    tmp: Path,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every point of one table shape, for the workers of one group."""
    rows = []
    for point in points:
        ids = zipf_batches(point, args.zipf)
        ids_path = tmp / "ids.npy"
        np.save(ids_path, ids)
        infos = {impl: workers[impl].setup(point, str(ids_path)) for impl in group}
        jobs = [(i, v) for i in group for v in infos[i]["estimate_s"]]
        est = {(i, v): infos[i]["estimate_s"][v] for i, v in jobs}
        times = timed_rounds(workers, jobs, est, args)
        uniq = unique_rows(ids)
        for (impl, variant), per_round in times.items():
            rows.append(result_row(point, impl, variant, per_round, infos[impl], uniq, group, args))
        elapsed = time.perf_counter() - args.start
        print(f"done {point} [{', '.join(group)}] at {elapsed:.0f} s", file=sys.stderr)
    return rows


def result_row(
    point: Point, impl: str, variant: str, rounds: list[tuple[float, list[float]]],
    info: dict[str, Any], uniq: float, group: list[str], args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    per_round = [times for _, times in rounds]
    secs = [s for r in per_round for s in r]
    med = statistics.median(secs)
    ids = point.tables * point.batch * point.pooling
    rb = row_bytes(impl, point.dim)
    name = impl if info["kernels"] != "portable" else f"{impl}-portable"
    return {
        "impl": name if variant == "step" else f"{name}:{variant}",
        "base_impl": impl,
        "variant": variant,
        **asdict(point),
        "optimizer": info["optimizer"],
        "kernels": info["kernels"],
        "samples_per_s": point.batch / med,
        "step_ms": med * 1e3,
        "step_ms_min": min(secs) * 1e3,
        "round_ms": [statistics.median(r) * 1e3 for r in per_round],
        "round_started_s": [started for started, _ in rounds],
        "steps_timed": len(secs),
        "unique_rows": uniq,
        # forward reads every id's row; the update reads and writes each unique row and
        # (row-wise Adagrad) its 4-byte state.
        "row_gbps": (ids * rb + uniq * (2 * rb + 8)) / med / 1e9,
        "storage_gib": info["storage_gib"],
        "init_s": info["init_s"],
        "group": group,
        **({"kernel_isa": info["isa"]} if "isa" in info else {}),
    }


def add_ratios(results: list[dict[str, Any]], bandwidth: float) -> None:
    """``vs_*`` ratios from per-round medians (interleaved where in one group)."""
    for r in results:
        same = {
            (x["base_impl"], x["variant"]): x
            for x in results
            if (x["tables"], x["rows"], x["dim"], x["batch"], x["pooling"])
            == (r["tables"], r["rows"], r["dim"], r["batch"], r["pooling"])
        }
        r["not_interleaved"] = []
        r["bandwidth_fraction"] = r["row_gbps"] / bandwidth
        bases = [("torch-embeddingbag", "vs_torch"), ("fbgemm-cpu", "vs_fbgemm")]
        if r["base_impl"].startswith("tetrarec-"):
            bases.append(("tetrarec-fp32", "vs_fp32"))
        for base, key in bases:
            b = same.get((base, r["variant"]))
            if b is None or b is r:
                continue
            if base in r["group"]:
                paired = zip(b["round_ms"], r["round_ms"])
                r[key] = statistics.median(x / y for x, y in paired)
            else:
                r[key] = b["step_ms"] / r["step_ms"]
                r["not_interleaved"].append(key)
        gather = same.get(("tetrarec-fp32", "gather"))
        if gather is not None and r["variant"] != "gather":
            r["vs_gather"] = r["step_ms"] / gather["step_ms"]


def run_all(
    args: argparse.Namespace, passthrough: list[str], not_run: list[dict[str, str]]
) -> list[dict[str, Any]]:
    """Every point for every implementation; appends to ``not_run`` what cannot run."""
    impls, skipped = requested_impls(args)
    not_run += [{"impl": i, "reason": why} for i, why in skipped.items()]
    if not impls:
        raise SystemExit("nothing to run: no implementation is available")
    points = base_points(args)
    shapes: dict[tuple[int, int, int], list[Point]] = {}
    for p in points:
        shapes.setdefault(p.table_key(), []).append(p)
    args.start = time.perf_counter()
    workers = {i: Worker(i, args, passthrough) for i in impls}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-embedding-") as d:
        for shape_points in shapes.values():
            biggest = max(shape_points, key=lambda p: p.batch * p.pooling)
            for impl, why in too_big(impls, biggest, args).items():
                print(f"NOT RUN: {impl}: {why}", file=sys.stderr)
                not_run.append({"impl": impl, "reason": why})
            for group in plan_groups(impls, biggest, args):
                results += measure_group(group, shape_points, workers, args, Path(d))
                for impl in group:
                    workers[impl].drop()
    rss = {i: w.finish() for i, w in workers.items()}
    for r in results:
        r["peak_rss_gib"] = rss[r["base_impl"]]
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(args)
        return
    raw = list(argv if argv is not None else sys.argv[1:])
    if args.json:
        i = raw.index("--json")
        del raw[i : i + 2]
    torch.set_num_threads(args.threads)
    bandwidth = memcopy_gbps(64 if args.smoke else 512)
    not_run: list[dict[str, str]] = []
    results = run_all(args, raw, not_run)
    add_ratios(results, bandwidth)
    cols = ["impl", "optimizer", "kernels", "tables", "rows", "dim", "batch", "pooling"]
    cols += ["samples_per_s", "step_ms", "vs_torch", "vs_fbgemm", "vs_fp32", "vs_gather"]
    cols += ["peak_rss_gib", "storage_gib", "row_gbps", "bandwidth_fraction"]
    cpu = cpu_summary()
    isa = next((r["kernel_isa"] for r in results if "kernel_isa" in r), None)
    print(f"CPU: {cpu['model']}; flags: {' '.join(cpu['flags']) or '-'}; threads {args.threads}")
    print(f"tetrarec kernels: {kernel_line(results, isa)}")
    print(f"memcopy bandwidth: {bandwidth:.1f} GB/s (read + write)")
    print_table(results, cols)
    for miss in not_run:  # a requested implementation never disappears silently
        print(f"NOT RUN: {miss['impl']}: {miss['reason']}")
    if any(r["not_interleaved"] for r in results):
        print("ratios not from interleaved rounds (different groups): see not_interleaved")
    if args.sweep:
        print_sweep_summary(results)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "serve", "start")}
    config["memcopy_gbps"] = bandwidth
    config["points"] = [asdict(p) for p in base_points(args)]
    kernels = {"isa": isa, "ran": kernel_line(results, isa)}
    write_json(args.json, config, results, kernels=kernels, not_run=not_run)


def kernel_line(results: list[dict[str, Any]], isa: dict[str, Any] | None) -> str:
    paths = sorted({r["kernels"] for r in results if r["base_impl"].startswith("tetrarec-")})
    if not paths:
        return "not run"
    line = ", ".join(paths)
    if "portable" in paths:
        line += " (the portable PyTorch path: NOT the compiled kernel's figures)"
    if isa:
        line += f"; compiled for {isa.get('isa', '?')} ({isa.get('vector_paths', '')})"
    return line


def print_sweep_summary(results: list[dict[str, Any]]) -> None:
    fp32 = [
        r
        for r in results
        if r["base_impl"] == "tetrarec-fp32" and r["variant"] == "step" and "vs_fbgemm" in r
    ]
    if not fp32:
        return
    worst = min(fp32, key=lambda r: r["vs_fbgemm"])
    print(
        f"sweep: tetrarec-fp32 vs FBGEMM over {len(fp32)} points: min {worst['vs_fbgemm']:.2f}x "
        f"at T={worst['tables']} E={worst['rows']} D={worst['dim']} B={worst['batch']} "
        f"L={worst['pooling']}; median {statistics.median(r['vs_fbgemm'] for r in fp32):.2f}x"
    )


if __name__ == "__main__":
    with unwind_on_signals("bench_embedding"):  # SIGTERM deletes the scratch too
        main()
