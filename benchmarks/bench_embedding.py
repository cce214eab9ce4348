"""Embedding lookup + fused update throughput: tetrarec vs plain PyTorch vs FBGEMM (CPU).

One step = forward pooled lookup of every table + backward + sparse optimizer update.
Each implementation runs in its own subprocess (one "phase"), so that its tables are
freed before the next and its peak RSS is its own. Ids are Zipf-distributed, generated
once per phase outside the timed region (a few pre-generated batches, cycled).

    python benchmarks/bench_embedding.py                       # workload W (26 x 1M x 64)
    python benchmarks/bench_embedding.py --smoke               # tiny, seconds
    flock /tmp/tetrarec-bigbench.lock python benchmarks/bench_embedding.py --json out.json

Implementations: ``tetrarec-<precision>`` (FusedEmbeddingBagCollection),
``torch-embeddingbag`` (nn.EmbeddingBag(sparse=True) per table + torch.optim.Adagrad,
or the optimizer named by --optimizer where torch has one), and ``fbgemm-cpu``
(SplitTableBatchedEmbeddingBagsCodegen, EXACT_ROWWISE_ADAGRAD, host placement), when
fbgemm_gpu imports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import measure, peak_rss_gib, print_table, write_json


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
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", default="tetrarec,torch,fbgemm", help="which to run")
    p.add_argument("--nondeterministic", action="store_true", help="also time deterministic=False")
    p.add_argument(
        "--small-pages",
        action="store_true",
        help="also time tetrarec with 4 KiB pages only (TETRAREC_HUGE_PAGES=0)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the smoke test")
    p.add_argument("--json", default=None, help="write results to this path")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.tables, args.rows, args.dim, args.batch = 3, 1000, 16, 64
        args.iters, args.warmup = 2, 1
        args.pooling, args.precision = "3", "fp32,int8"
    return args


# -- workload ---------------------------------------------------------------------------


def zipf_batches(args: argparse.Namespace, pooling: int, n: int = 4) -> list[np.ndarray]:
    """``n`` batches of ids ``(T, B*L)``: Zipf ranks scattered over the rows by a hash."""
    rng = np.random.default_rng(1234 + pooling)
    ranks = np.arange(1, args.rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** (-args.zipf))
    cdf /= cdf[-1]
    out = []
    for _ in range(n):
        u = rng.random((args.tables, args.batch * pooling))
        r = np.minimum(np.searchsorted(cdf, u), args.rows - 1).astype(np.int64)
        out.append((r * 2_654_435_761 + 12_345) % args.rows)  # spread the hot rows
    return out


def unique_rows(batches: list[np.ndarray]) -> float:
    """Mean unique (table, row) pairs per batch."""
    return float(np.mean([sum(len(np.unique(t)) for t in b) for b in batches]))


def memcopy_gbps(size_mib: int = 512) -> float:
    """Bandwidth of a large copy, GB/s counting bytes read plus bytes written."""
    src = torch.ones(size_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=2, iters=5)
    return 2 * src.numel() * 4 / t.median / 1e9


# -- implementations: each returns (step function, table storage bytes) ------------------


def setup_tetrarec(args: argparse.Namespace, precision: str, batches: list[np.ndarray], det: bool):
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.kernels import FusedEmbeddingBagCollection
    from tetrarec.sparse import SparseFeatures

    tables = [
        TableConfig(name=f"t{i}", num_embeddings=args.rows, dim=args.dim, precision=precision)
        for i in range(args.tables)
    ]
    spec = SparseOptimizerSpec(kind=args.optimizer, lr=0.01)
    ebc = FusedEmbeddingBagCollection(tables, spec, seed=0, deterministic=det)
    keys = tuple(f"t{i}" for i in range(args.tables))
    pooling = batches[0].shape[1] // args.batch
    lengths = torch.full((args.tables * args.batch,), pooling, dtype=torch.int64)
    feats = [
        SparseFeatures(keys, torch.from_numpy(b.reshape(-1)), lengths, args.batch) for b in batches
    ]
    grad = torch.randn(args.batch, args.tables * args.dim)
    it = iter(range(10**9))

    def step() -> None:
        out = ebc(feats[next(it) % len(feats)]).values
        out.backward(grad)

    storage = sum(b.numel() * b.element_size() for n, b in ebc.named_buffers() if "_weights" in n)
    return step, storage


def setup_torch(args: argparse.Namespace, batches: list[np.ndarray]):
    bags = [
        torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
        for _ in range(args.tables)
    ]
    params = [b.weight for b in bags]
    optims = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.01),
        "adam": lambda: torch.optim.SparseAdam(params, lr=0.01),
    }
    opt = optims.get(args.optimizer, lambda: torch.optim.Adagrad(params, lr=0.01))()
    pooling = batches[0].shape[1] // args.batch
    offsets = torch.arange(args.batch, dtype=torch.int64) * pooling
    ids = [[torch.from_numpy(t) for t in b] for b in batches]
    grad = torch.randn(args.batch, args.tables * args.dim)
    it = iter(range(10**9))

    def step() -> None:
        batch = ids[next(it) % len(ids)]
        opt.zero_grad(set_to_none=True)
        out = torch.cat([bag(x, offsets) for bag, x in zip(bags, batch)], dim=1)
        out.backward(grad)
        opt.step()

    return step, sum(p.numel() * 4 for p in params)


def setup_fbgemm(args: argparse.Namespace, batches: list[np.ndarray]):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [
        (args.rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for _ in range(args.tables)
    ]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8
    )
    pooling = batches[0].shape[1] // args.batch
    offsets = torch.arange(args.tables * args.batch + 1, dtype=torch.int64) * pooling
    ids = [torch.from_numpy(b.reshape(-1)) for b in batches]
    grad = torch.randn(args.batch, args.tables * args.dim)
    it = iter(range(10**9))

    def step() -> None:
        out = tbe(ids[next(it) % len(ids)], offsets)
        out.backward(grad)

    storage = sum(w.numel() * w.element_size() for w in tbe.split_embedding_weights())
    return step, storage


# -- phases -------------------------------------------------------------------------------


def row_bytes(impl: str, dim: int) -> int:
    """Stored bytes of one row for an implementation (FP32 unless it says otherwise)."""
    from tetrarec.types import Precision

    if impl.startswith("tetrarec-"):
        return Precision.parse(impl.split("-")[1]).row_bytes(dim)
    return 4 * dim


def run_phase(args: argparse.Namespace) -> dict[str, Any]:
    """Build one implementation, time its steps; the result as one JSON-able dict."""
    impl, pooling_s = args.phase.split(":")
    pooling = int(pooling_s)
    torch.set_num_threads(args.threads)
    batches = zipf_batches(args, pooling)
    t0 = time.perf_counter()
    if impl.startswith("tetrarec-"):
        _, precision, *flags = impl.split("-")
        before = os.environ.get("TETRAREC_HUGE_PAGES")
        if "smallpages" in flags:  # read when the tables are allocated, just below
            os.environ["TETRAREC_HUGE_PAGES"] = "0"
        step, storage = setup_tetrarec(args, precision, batches, det="nondet" not in flags)
        if before is None:
            os.environ.pop("TETRAREC_HUGE_PAGES", None)
        else:
            os.environ["TETRAREC_HUGE_PAGES"] = before
    elif impl == "torch-embeddingbag":
        step, storage = setup_torch(args, batches)
    else:
        step, storage = setup_fbgemm(args, batches)
    init_s = time.perf_counter() - t0
    timing = measure(step, warmup=args.warmup, iters=args.iters)
    ids = args.tables * args.batch * pooling
    rb = row_bytes(impl, args.dim)
    # forward reads every id's row; the update reads and writes each unique row and
    # (row-wise Adagrad) its 4-byte state.
    moved = ids * rb + unique_rows(batches) * (2 * rb + 8)
    return {
        "impl": impl,
        "pooling": pooling,
        "samples_per_s": args.batch / timing.median,
        "step_ms": timing.median * 1e3,
        "step_ms_p90": timing.p90 * 1e3,
        "peak_rss_gib": peak_rss_gib(),
        "storage_gib": storage / 2**30,
        "init_s": init_s,
        "row_gbps": moved / timing.median / 1e9,
    }


def impl_names(args: argparse.Namespace) -> list[str]:
    wanted = args.impls.split(",")
    names = []
    if "torch" in wanted:
        names.append("torch-embeddingbag")
    if "fbgemm" in wanted:
        try:
            import fbgemm_gpu  # noqa: F401

            names.append("fbgemm-cpu")
        except Exception as exc:  # optional comparison target, never a dependency
            print(f"fbgemm_gpu not importable ({exc}); skipping it", file=sys.stderr)
    if "tetrarec" in wanted:
        for p in args.precision.split(","):
            names.append(f"tetrarec-{p}")
            if args.nondeterministic:
                names.append(f"tetrarec-{p}-nondet")
            if args.small_pages:
                names.append(f"tetrarec-{p}-smallpages")
    return names


def add_ratios(results: list[dict[str, Any]], bandwidth: float) -> None:
    for r in results:
        same = {x["impl"]: x for x in results if x["pooling"] == r["pooling"]}
        for base, key in (("torch-embeddingbag", "vs_torch"), ("fbgemm-cpu", "vs_fbgemm")):
            if base in same:
                r[key] = r["samples_per_s"] / same[base]["samples_per_s"]
        if "tetrarec-fp32" in same and r["impl"].startswith("tetrarec"):
            fp32 = same["tetrarec-fp32"]
            r["vs_fp32"] = r["samples_per_s"] / fp32["samples_per_s"]
            r["storage_vs_fp32"] = r["storage_gib"] / fp32["storage_gib"]
        r["bandwidth_fraction"] = r["row_gbps"] / bandwidth


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.phase:
        print(json.dumps(run_phase(args)))
        return
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    if args.json:
        passthrough = [a for a in passthrough if a != args.json]
    torch.set_num_threads(args.threads)
    bandwidth = memcopy_gbps(64 if args.smoke else 512)
    results = []
    for pooling in (int(x) for x in args.pooling.split(",")):
        for impl in impl_names(args):
            if args.smoke:  # in-process: seconds instead of one torch import per phase
                args.phase = f"{impl}:{pooling}"
                results.append(run_phase(args))
                args.phase = None
                continue
            cmd = [sys.executable, __file__, *passthrough, "--phase", f"{impl}:{pooling}"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(f"{impl} pooling {pooling} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"done {impl} pooling {pooling}", file=sys.stderr)
    add_ratios(results, bandwidth)
    cols = [
        "impl", "pooling", "samples_per_s", "step_ms", "vs_torch", "vs_fbgemm", "vs_fp32",
        "peak_rss_gib", "storage_gib", "storage_vs_fp32", "row_gbps", "bandwidth_fraction",
    ]  # fmt: skip
    print(f"memcopy bandwidth: {bandwidth:.1f} GB/s (read + write), threads {args.threads}")
    print_table(results, cols)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "phase")}
    config["memcopy_gbps"] = bandwidth
    write_json(args.json, config, results)


if __name__ == "__main__":
    main()
