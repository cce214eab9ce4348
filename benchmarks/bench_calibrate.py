"""Calibrate the planner's cost model on this machine and write a topology TOML.

Measures, on this machine:

- ``gather``: random-row gather bandwidth from host memory: bytes of rows gathered per
  second from one FP32 table of ``--gather-gib`` GiB (much larger than the CPU caches),
  uniform random ids, 64 floats a row; by ``torch.index_select`` and by tetrarec's
  fused collection forward with one id per bag (the lookup the kernels run). The
  topology's ``host_bandwidth`` is tetrarec's figure;
- ``matmul``: FP32 GEMM rate (FLOP/s, ``2 M N K`` per product) at DLRM-like MLP shapes
  (batch 2048 against layers of 512-1024 units); ``matmul_flops`` is the median over
  the shapes;
- ``all_to_all``: tetrarec's ``Communicator.all_to_all_v`` on gloo ranks of this
  machine (loopback) at world sizes 2 and 4, one float per peer (latency) and
  ``--a2a-mib`` MiB per peer (bandwidth); each rank times the calls after a barrier, and
  the slowest rank's median counts (a collective ends when its last rank does). With
  ``t(bytes) = latency + bytes / bandwidth``: ``latency = t(small)`` and ``bandwidth =
  (bytes sent to peers, large - small) / (t(large) - t(small))`` per rank, one
  direction. World size 2 gives ``intra_node_bandwidth`` and ``collective_latency_s``;
- ``ssd``: random 4 KiB reads (``os.pread``, one at a time) of a fresh temporary file of
  ``--ssd-mib`` MiB in ``--ssd-dir``, whose pages are first dropped from the page cache
  (``posix_fadvise(DONTNEED)`` after ``fsync``). Where the directory is a ``tmpfs`` (RAM)
  the figure is memory's, and the row says so; one read at a time underestimates an
  NVMe drive's parallel rate.

Capacities: ``host_memory`` is ``MemTotal`` of ``/proc/meminfo`` split over the ranks of
the node, ``ssd`` the free space of ``--ssd-dir`` split the same way; the device fields
are 0 (no accelerator is used). One node is measured: ``inter_node_bandwidth`` is the
loopback figure too (a comment in the file says so). Loopback gloo between processes
that share two cores is not a network: it measures memory copies and scheduling.

    python benchmarks/bench_calibrate.py --out topology.toml --json calibrate.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # run from a checkout without installing
from _harness import (  # noqa: E402
    describe_run,
    git_sha,
    json_path,
    kernel_summary,
    measure,
    print_table,
    write_json,
)
from _routing import (  # noqa: E402
    ROUTE_BATCH,
    ROUTE_GROUPS,
    fit_routing,
    route_seconds_per_point,
)

DIM = 64  # floats per gathered row (a typical DLRM embedding dim)
GATHER_IDS = 65_536  # ids per timed gather call
# (M, K, N): batch 2048 through DLRM-like MLP layers (Criteo DLRM top MLP 1024-1024-512)
MATMUL_SHAPES = ((2048, 512, 256), (2048, 1024, 1024), (2048, 512, 1024), (2048, 479, 1024))
SMOKE_MATMUL_SHAPES = ((256, 128, 128), (256, 256, 256))
SSD_BLOCK = 4096
RANKS_PER_NODE = 2
POOLING = 8  # ids per bag of the per-rank lookup rates (per-id work, not per-bag output)


# --- (a) random-row gather --------------------------------------------------------------


def gather_rows(gib: float, iters: int) -> list[dict[str, Any]]:
    """Random-row gather bandwidth of ``index_select`` and of tetrarec's fused forward."""
    num_rows = max(GATHER_IDS, int(gib * 2**30) // (DIM * 4))
    ids_per_call = min(GATHER_IDS, num_rows)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, num_rows, (ids_per_call,), generator=gen, dtype=torch.int64)
        for _ in range(8)
    ]
    moved = ids_per_call * DIM * 4
    # one table at a time: each is --gather-gib, freed before the next is built
    rows = [_gather_index_select(num_rows, batches, moved, iters)]
    rows.append(_gather_fused(num_rows, batches, moved, iters))
    return rows


def _gather_index_select(
    num_rows: int, batches: list[torch.Tensor], moved: int, iters: int
) -> dict[str, Any]:
    table = torch.empty(num_rows, DIM).uniform_(-0.01, 0.01)  # touched: pages are resident
    buf = torch.empty(batches[0].numel(), DIM)
    it = iter(range(10**9))
    t = measure(
        lambda: torch.index_select(table, 0, batches[next(it) % len(batches)], out=buf),
        warmup=2,
        iters=iters,
    )
    return _gather_row("index_select", t.median, moved, num_rows, kernels=None)


def _gather_fused(num_rows: int, batches: list[torch.Tensor], moved: int, iters: int) -> Any:
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.kernels import FusedEmbeddingBagCollection
    from tetrarec.sparse import SparseFeatures

    table = TableConfig(name="t", num_embeddings=num_rows, dim=DIM)
    ebc = FusedEmbeddingBagCollection([table], SparseOptimizerSpec(kind="sgd", lr=0.01), seed=0)
    n = batches[0].numel()
    ones = torch.ones(n, dtype=torch.int64)
    feats = [SparseFeatures(("t",), b, ones, n) for b in batches]
    it = iter(range(10**9))

    def forward() -> None:
        with torch.no_grad():
            ebc(feats[next(it) % len(feats)])

    t = measure(forward, warmup=2, iters=iters)
    return _gather_row(
        "tetrarec-fused-forward", t.median, moved, num_rows, kernels=kernel_summary()["kernels"]
    )


def _gather_row(impl: str, seconds: float, moved: int, rows: int, kernels: str | None) -> Any:
    row = {
        "impl": impl,
        "what": "gather",
        "table_gib": rows * DIM * 4 / 2**30,
        "ms": seconds * 1e3,
        "value": moved / seconds,
        "unit": "B/s",
    }
    if kernels is not None:
        row["kernels"] = kernels
    return row


# --- (b) matmul ----------------------------------------------------------------------------


def matmul_rows(shapes: tuple[tuple[int, int, int], ...], iters: int) -> list[dict[str, Any]]:
    """FP32 GEMM FLOP/s of ``torch.mm`` at each ``(M, K, N)``."""
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        c = torch.empty(m, n)
        t = measure(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), warmup=2, iters=iters)
        out.append(
            {
                "impl": "torch.mm-fp32",
                "what": f"matmul {m}x{k}x{n}",
                "ms": t.median * 1e3,
                "value": 2 * m * n * k / t.median,
                "unit": "FLOP/s",
            }
        )
    return out


# --- (c) all-to-all -----------------------------------------------------------------------


def a2a_worker(ctx: Any, sizes: tuple[int, ...], iters: int) -> dict[str, list[float]]:
    """Time ``all_to_all_v`` with ``n`` floats per peer for each ``n`` in ``sizes``."""
    w = ctx.world_size
    out: dict[str, list[float]] = {}
    for n in sizes:
        x = torch.ones(n * w)
        splits = [n] * w
        for _ in range(3):
            ctx.comm.all_to_all_v(x, send_splits=splits, recv_splits=splits, label="calib").wait()
        times = []
        for _ in range(iters):
            ctx.comm.barrier(label="calib")
            t0 = time.perf_counter()
            ctx.comm.all_to_all_v(x, send_splits=splits, recv_splits=splits, label="calib").wait()
            times.append(time.perf_counter() - t0)
        out[str(n)] = times
    return out


def a2a_rows(worlds: list[int], large_floats: int, iters: int) -> list[dict[str, Any]]:
    """Latency and bandwidth of all-to-all at each world size (one spawn per size)."""
    from tetrarec.testing import run_ranks

    rows = []
    for w in worlds:
        res = run_ranks(
            a2a_worker,
            world_size=w,
            args=((1, large_floats), iters),
            timeout_s=600,
            collective_timeout_s=120,
            deterministic=False,
        )
        # a collective ends when its slowest rank does
        small = max(statistics.median(r["1"]) for r in res)
        large = max(statistics.median(r[str(large_floats)]) for r in res)
        extra = (w - 1) * (large_floats - 1) * 4  # bytes each rank sends to its peers
        bandwidth = extra / (large - small) if large > small else extra / large
        rows.append(
            {
                "impl": "gloo-loopback",
                "what": f"all_to_all latency W={w}",
                "world_size": w,
                "ms": small * 1e3,
                "value": small,
                "unit": "s",
            }
        )
        rows.append(
            {
                "impl": "gloo-loopback",
                "what": f"all_to_all bandwidth W={w}",
                "world_size": w,
                "bytes_per_peer": large_floats * 4,
                "ms": large * 1e3,
                "value": bandwidth,
                "unit": "B/s",
            }
        )
    return rows


# --- (e) per-rank rates, every rank busy at once ----------------------------------------


def rank_rates(
    ctx: Any,
    *,
    rows: int,
    ids: int,
    mlp_batch: int,
    a2a_floats: int,
    iters: int,
    mlps: tuple[tuple[int, tuple[int, ...]], ...] = ((13, (512, 256, 64)),),
    route_batch: int = ROUTE_BATCH,
) -> dict[str, float]:
    """This rank's rates while every rank of ``ctx`` measures the same at once.

    Run on every rank (``run_ranks``), each with its share of the cores, so the figures
    are what one rank of a training run gets on this machine:

    - ``lookup_bandwidth`` and ``lookup_ids_per_s``: training lookups (fused forward,
      then backward with row-wise Adagrad) of ``ids`` and ``4 ids`` uniform ids in bags
      of ``POOLING``, into
      ``rows`` x 64 FP32 rows (distinct rows: per-id work and row bytes) and into 256
      rows (repeats: per-id work only). From the slopes, in the cost model's terms
      (``tetrarec.planner.cost``): ``2 / lookup_ids_per_s`` seconds per id in the tiny
      table, plus ``(3 rb + 2 sb) / lookup_bandwidth`` per distinct row.
    - ``matmul_flops``: a training step of the MLPs ``mlps`` (``(inputs, layer
      sizes)``, ReLU between, Adagrad) on ``mlp_batch`` rows, as ``3 x forward FLOPs /
      seconds`` (the cost model's dense formula).
    - ``a2a_small_s`` and ``a2a_large_s``: ``all_to_all_v`` of one float and of
      ``a2a_floats`` floats per peer (``a2a_worker``).
    - ``stage_s``: the fixed seconds of one collective stage of a sharded lookup
      (``_stage_seconds``), the cost model's ``collective_latency_s``.
    - ``route <group> p<P> d<D>``: a sharded lookup's training step per sharding group
      and routing point (``_routing.route_seconds_per_point``), fitted by ``fit_routing``.
    """
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.kernels import FusedEmbeddingBagCollection
    from tetrarec.sparse import SparseFeatures
    from tetrarec.types import OptimizerKind

    gen = torch.Generator().manual_seed(ctx.rank)
    spec = SparseOptimizerSpec(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.01)

    def lookup_step(table_rows: int, n: int) -> Any:
        table = TableConfig(name="t", num_embeddings=table_rows, dim=DIM)
        ebc = FusedEmbeddingBagCollection([table], spec, seed=ctx.rank)
        bags = torch.full((n // POOLING,), POOLING, dtype=torch.long)
        feats = [
            SparseFeatures.from_lengths(
                ("t",), torch.randint(0, table_rows, (n,), generator=gen), bags
            )
            for _ in range(4)
        ]
        grad = torch.randn(n // POOLING, DIM, generator=gen)
        it = [0]

        def lookup() -> None:
            out = ebc(feats[it[0] % len(feats)]).values
            it[0] += 1
            out.backward(grad)

        return lookup

    # The four lookups take turns (each after a barrier, each round starting at the
    # next): their differences are what counts, so a burst of other work must fall on
    # all alike. Slopes over 3 ids more per id remove the fixed cost of a call. In a
    # tiny table every id repeats a cached row: only the per-id work is left (forward
    # + backward); in a big one, uniform ids are distinct rows: per-id work plus the
    # rows' bytes.
    points = {(r, k): lookup_step(r, k * ids) for r in (256, rows) for k in (1, 4)}
    for step in points.values():
        for _ in range(2):
            step()
    spent: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    order = list(points)
    for i in range(2 * iters):
        for p in order[i % len(order) :] + order[: i % len(order)]:
            ctx.comm.barrier(label="calib")
            t0 = time.perf_counter()
            points[p]()
            spent[p].append(time.perf_counter() - t0)
    t = {p: statistics.median(v) for p, v in spent.items()}
    # Where noise still leaves a slope <= 0, the larger point's seconds per id bound it
    # instead (fixed cost included: an overestimate, never 0).
    tiny = (t[256, 4] - t[256, 1]) / (3 * ids)
    tiny = tiny if tiny > 0 else t[256, 4] / (4 * ids)
    big = (t[rows, 4] - t[rows, 1]) / (3 * ids)
    big = big if big > tiny else max(t[rows, 4] / (4 * ids), 2 * tiny)
    row_bytes, state_bytes = DIM * 4, 4  # FP32 row, one row-wise Adagrad sum
    lookup_ids_per_s = 2 / tiny if tiny > 0 else 0.0
    lookup_bandwidth = (3 * row_bytes + 2 * state_bytes) / max(big - max(tiny, 0.0), 1e-12)

    nets: list[torch.nn.Module] = []
    inputs: list[torch.Tensor] = []
    fwd_flops = 0
    for n_in, sizes in mlps:
        layers: list[torch.nn.Module] = []
        for n_out in sizes:
            layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
            fwd_flops += 2 * mlp_batch * n_in * n_out
            n_in = n_out
        nets.append(torch.nn.Sequential(*layers))
        inputs.append(torch.randn(mlp_batch, mlps[len(inputs)][0], generator=gen))
    params = [p for net in nets for p in net.parameters()]
    opt = torch.optim.Adagrad(params, lr=0.01)

    def dense() -> None:
        opt.zero_grad(set_to_none=True)
        sum(net(x).sum() for net, x in zip(nets, inputs)).backward()
        opt.step()

    ctx.comm.barrier(label="calib")
    t_dense = measure(dense, warmup=2, iters=iters).median
    a2a = a2a_worker(ctx, (1, a2a_floats), iters)
    return {
        "lookup_bandwidth": lookup_bandwidth,
        "lookup_ids_per_s": lookup_ids_per_s,
        "matmul_flops": 3 * fwd_flops / t_dense,
        "a2a_small_s": statistics.median(a2a["1"]),
        "a2a_large_s": statistics.median(a2a[str(a2a_floats)]),
        "stage_s": _stage_seconds(ctx, iters),
        **route_seconds_per_point(ctx, route_batch, 3 * iters),
    }


def _stage_seconds(ctx: Any, iters: int) -> float:
    """Fixed seconds per collective stage of a sharded lookup: a table-wise lookup of a
    few ids (one tiny table per rank; forward and backward are 4 collectives: id counts,
    ids, pooled rows, their gradients) over 4. Unlike a bare all-to-all of one float, it
    includes what each stage costs around its collective (routing, copies, autograd)."""
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.kernels import FusedEmbeddingBagCollection
    from tetrarec.sharding import ShardingEnv, plan_by_type, shard_collection
    from tetrarec.sparse import SparseFeatures
    from tetrarec.types import OptimizerKind, ShardingType

    w = ctx.world_size
    tables = [TableConfig(name=f"s{r}", num_embeddings=100, dim=8) for r in range(w)]
    spec = SparseOptimizerSpec(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.01)
    module = FusedEmbeddingBagCollection(tables, spec, seed=0, device="meta")
    splan = plan_by_type(tables, ShardingType.TABLE_WISE, world_size=w)
    sharded = shard_collection(module, splan, ShardingEnv(ctx.comm))
    keys = tuple(t.name for t in tables)
    feats = SparseFeatures.from_lengths(
        keys, torch.arange(4 * w) % 100, torch.ones(4 * w, dtype=torch.long)
    ).with_value_counts()

    def step() -> None:
        sharded(feats).values.sum().backward()

    ctx.comm.barrier(label="calib")
    return measure(step, warmup=3, iters=max(iters, 10)).median / 4


def combine_rank_rates(results: list[dict[str, float]], a2a_floats: int) -> dict[str, float]:
    """One figure per rate over the ranks of a ``rank_rates`` run: the slowest rank's
    compute rates (a step waits for it) and the collectives' times as they end (on their
    slowest rank)."""
    w = len(results)
    small = max(r["a2a_small_s"] for r in results)
    large = max(r["a2a_large_s"] for r in results)
    extra = (w - 1) * (a2a_floats - 1) * 4
    return {
        "lookup_bandwidth": min(r["lookup_bandwidth"] for r in results),
        "lookup_ids_per_s": min(r["lookup_ids_per_s"] for r in results),
        "matmul_flops": min(r["matmul_flops"] for r in results),
        "a2a_latency_s": small,
        "collective_latency_s": max(r["stage_s"] for r in results),
        "link_bandwidth": extra / (large - small) if large > small else extra / large,
        **{
            k: max(r[k] for r in results)  # a step ends with its slowest rank
            for k in results[0]
            if k.startswith("route ")
        },
    }


# --- (d) SSD random reads -------------------------------------------------------------------


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (``/proc/mounts``)."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def ssd_row(directory: Path, mib: int, reads: int) -> dict[str, Any]:
    """Random 4 KiB read bandwidth of a fresh file in ``directory``, its cache dropped."""
    size = mib * 2**20
    blocks = size // SSD_BLOCK
    kind = fs_type(directory)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="tetrarec-calib-") as f:
        chunk = os.urandom(2**20)
        for _ in range(mib):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, size, os.POSIX_FADV_DONTNEED)
        offsets = np.random.default_rng(0).integers(0, blocks, reads) * SSD_BLOCK
        t0 = time.perf_counter()
        for off in offsets.tolist():
            os.pread(f.fileno(), SSD_BLOCK, off)
        seconds = time.perf_counter() - t0
    bandwidth = reads * SSD_BLOCK / seconds
    if kind == "tmpfs":
        note = "tmpfs: the file is in RAM, this is memory's rate"
    elif bandwidth > 4e9:
        note = "faster than any SSD at queue depth 1: the page cache still served the reads"
    else:
        note = "page cache dropped (fadvise DONTNEED); queue depth 1"
    return {
        "impl": "pread-4k",
        "what": "ssd random read",
        "fs": kind,
        "file_mib": mib,
        "reads": reads,
        "ms": seconds / reads * 1e3,
        "value": bandwidth,
        "unit": "B/s",
        "note": note,
    }


# --- the topology file --------------------------------------------------------------------


def host_memory_bytes() -> int:
    """``MemTotal`` of ``/proc/meminfo`` in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def _rates_worker(ctx: Any, cores: int, kw: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(max(1, cores // ctx.world_size))
    return rank_rates(ctx, **kw)


def rank_rate_rows(world: int, cores: int, smoke: bool) -> list[dict[str, Any]]:
    """``rank_rates`` on ``world`` ranks at once, each with its share of the cores, as
    result rows (``what`` = ``per-rank <rate>``)."""
    from tetrarec.testing import run_ranks

    kw: dict[str, Any] = (
        {"rows": 10_000, "ids": 2_048, "mlp_batch": 64, "a2a_floats": 4096, "iters": 3}
        if smoke
        else {"rows": 1_000_000, "ids": 8192, "mlp_batch": 1024, "a2a_floats": 1 << 20, "iters": 10}
    )
    res = run_ranks(
        _rates_worker,
        world_size=world,
        args=(cores, kw),
        timeout_s=900,
        collective_timeout_s=300,
        deterministic=False,
    )
    rates = combine_rank_rates(res, kw["a2a_floats"])
    routes = {k: rates.pop(k) for k in list(rates) if k.startswith("route ")}
    rates |= fit_routing(routes, rates_topology(rates, world, cores), ROUTE_BATCH)
    units = {
        "lookup_bandwidth": "B/s",
        "lookup_ids_per_s": "1/s",
        "matmul_flops": "FLOP/s",
        "a2a_latency_s": "s",
        "collective_latency_s": "s",
        "link_bandwidth": "B/s",
    }
    rows = [
        {
            "impl": f"{world} ranks at once",
            "what": f"per-rank {k}",
            "world_size": world,
            "ms": float("nan"),
            "value": v,
            "unit": units.get(k, "s"),
        }
        for k, v in rates.items()
    ]
    rows += [
        {
            "impl": f"{world} ranks at once",
            "what": k,
            "world_size": world,
            "ms": v * 1e3,
            "value": v,
            "unit": "s",
        }
        for k, v in routes.items()
    ]
    return rows


def rates_topology(rates: dict[str, float], world: int, cores: int, name: str = "") -> Any:
    """The one-node ``Topology`` of ``world`` ranks sharing ``cores`` cores with the
    per-rank ``rates`` of ``combine_rank_rates`` (and ``fit_routing``'s, when present)."""
    from tetrarec.planner import RankResources, Topology

    routing = {k: v for k, v in rates.items() if "_route_s_per_" in k}
    return Topology(
        name=name or f"calibrated-{world}-ranks",
        nodes=1,
        ranks_per_node=world,
        cores_per_node=cores,
        collective_latency_s=rates["collective_latency_s"],
        intra_node_bandwidth=rates["link_bandwidth"],
        inter_node_bandwidth=rates["link_bandwidth"],
        rank=RankResources(
            host_memory=host_memory_bytes() / world,
            host_bandwidth=rates["lookup_bandwidth"],
            matmul_flops=rates["matmul_flops"],
            lookup_ids_per_s=rates["lookup_ids_per_s"],
            **routing,
        ),
    )


def topology(results: list[dict[str, Any]], ssd_dir: Path) -> dict[str, Any]:
    """The topology fields (shared schema) from the measured rows: per-rank rates from
    the ranks measured at once (``rank_rate_rows``)."""

    def pick(what: str, impl: str | None = None) -> float:
        return float(
            next(r["value"] for r in results if r["what"] == what and impl in (None, r["impl"]))
        )

    ssd_rows = [r for r in results if r["what"] == "ssd random read"]
    a2a = pick(f"all_to_all bandwidth W={RANKS_PER_NODE}")
    return {
        "name": "calibrated-" + re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()),
        "nodes": 1,
        "ranks_per_node": RANKS_PER_NODE,
        "cores_per_node": os.cpu_count() or 1,
        "collective_latency_s": pick("per-rank collective_latency_s"),
        "intra_node_bandwidth": a2a,
        "inter_node_bandwidth": a2a,
        "rank": {
            "device_memory": 0,
            "host_memory": host_memory_bytes() // RANKS_PER_NODE,
            "ssd": shutil.disk_usage(ssd_dir).free // RANKS_PER_NODE,
            "device_bandwidth": 0,
            "host_bandwidth": pick("per-rank lookup_bandwidth"),
            "ssd_bandwidth": ssd_rows[0]["value"] if ssd_rows else 0.0,
            "matmul_flops": pick("per-rank matmul_flops"),
            "lookup_ids_per_s": pick("per-rank lookup_ids_per_s"),
            **{
                k: pick(f"per-rank {k}")
                for g, _ in ROUTE_GROUPS
                for k in (f"{g}_route_s_per_id", f"{g}_route_s_per_value", f"{g}_route_s_per_step")
            },
        },
    }


def topology_toml(topo: dict[str, Any], header: list[str]) -> str:
    """``topo`` as TOML (flat keys, then ``[rank]``), after ``header`` comment lines."""

    def value(v: Any) -> str:
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, int):
            return str(v)
        text = f"{float(v):.6g}"  # TOML floats need a "." or an exponent
        return text if any(c in text for c in ".en") else text + ".0"

    lines = [f"# {h}" for h in header]
    lines += [f"{k} = {value(v)}" for k, v in topo.items() if not isinstance(v, dict)]
    lines += ["", "[rank]"]
    lines += [f"{k} = {value(v)}" for k, v in topo["rank"].items()]
    return "\n".join(lines) + "\n"


def human(value: float, unit: str) -> str:
    """``value`` in ``unit`` for the printed table: GB/s, GFLOP/s, ms."""
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    return f"{value / 1e9:.3f} G{unit}"


_T0 = time.perf_counter()


def _progress(stage: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {stage}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the topology TOML here")
    ap.add_argument("--json", type=json_path, default=None, help="write results here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (smoke test)")
    ap.add_argument("--gather-gib", type=float, default=1.0, help="gathered table size, GiB")
    ap.add_argument("--a2a-mib", type=float, default=4.0, help="MiB per peer (bandwidth)")
    ap.add_argument("--world-sizes", default="2,4", help="all-to-all world sizes")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--ssd-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--ssd-mib", type=int, default=256, help="size of the SSD test file, MiB")
    ap.add_argument("--no-ssd", action="store_true", help="skip the SSD read test")
    args = ap.parse_args(argv)
    if not args.ssd_dir.is_dir():  # its free space is the topology's ssd: say so now
        ap.error(f"--ssd-dir {args.ssd_dir}: not a directory")
    worlds = sorted({RANKS_PER_NODE, *(int(w) for w in args.world_sizes.split(","))})
    gib, a2a_mib, iters, ssd_mib = args.gather_gib, args.a2a_mib, args.iters, args.ssd_mib
    shapes = MATMUL_SHAPES
    if args.smoke:
        gib, a2a_mib, iters, ssd_mib, shapes = 1 / 64, 0.25, 3, 4, SMOKE_MATMUL_SHAPES
        worlds = [RANKS_PER_NODE]
    started = datetime.datetime.now(datetime.UTC)
    _progress("gather")
    results = gather_rows(gib, iters)
    _progress("matmul")
    results += matmul_rows(shapes, iters)
    _progress(f"all_to_all at world sizes {worlds}")
    results += a2a_rows(worlds, max(2, int(a2a_mib * 2**20) // 4), iters)
    _progress(f"per-rank rates, {RANKS_PER_NODE} ranks at once")
    results += rank_rate_rows(RANKS_PER_NODE, os.cpu_count() or 1, args.smoke)
    if not args.no_ssd:
        _progress("ssd")
        results.append(ssd_row(args.ssd_dir, ssd_mib, 64 if args.smoke else 2000))
    topo = topology(results, args.ssd_dir)
    ssd = next((r for r in results if r["what"] == "ssd random read"), None)
    header = [
        f"written by `tetrarec bench calibrate` on {socket.gethostname()} at "
        f"{started:%Y-%m-%d %H:%M} UTC (git {git_sha()}){', SMOKE sizes' if args.smoke else ''}",
        f"per rank, {RANKS_PER_NODE} ranks measuring at once with their share of the cores "
        "(bench_calibrate.rank_rates):",
        f"  host_bandwidth, lookup_ids_per_s: training lookups of {DIM}-dim FP32 rows, a big "
        "table (distinct rows) and a tiny one (repeated rows), slopes over the ids",
        "  matmul_flops: a training step of a 13-512-256-64 MLP (3 x forward FLOPs / s)",
        "  collective_latency_s: a tiny table-wise sharded lookup (4 collective stages) / 4",
        "  <group>_route_s_per_id / _per_value / _per_step: sharded lookups per sharding "
        "group (256-row tables; the split group's 64k-row column blocks against an SGD "
        "baseline), slopes over the ids and pooled values of what the cost model does "
        "not predict without them (_routing.fit_routing)",
        f"intra_node_bandwidth: all_to_all_v on {RANKS_PER_NODE} gloo ranks of this machine "
        f"(loopback: memory copies, not a network), {a2a_mib:g} MiB/peer",
        "inter_node_bandwidth: NOT measured (one node): the intra-node figure",
        "cores_per_node: os.cpu_count() (more ranks than cores share them)",
        "host_memory: MemTotal / ranks_per_node; ssd: free space of "
        f"{args.ssd_dir} / ranks_per_node; device_*: 0 (no accelerator)",
        "ssd_bandwidth: "
        + (f"random 4 KiB preads, {ssd['note']}" if ssd else "not measured (--no-ssd): 0"),
    ]
    text = topology_toml(topo, header)
    print(describe_run())
    for r in results:
        r["figure"] = human(r["value"], r["unit"])
    print_table(results, ["impl", "what", "ms", "figure"])
    print()
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    config = {
        "smoke": args.smoke,
        "gather_gib": gib,
        "a2a_mib_per_peer": a2a_mib,
        "world_sizes": worlds,
        "iters": iters,
        "matmul_shapes": [list(s) for s in shapes],
        "topology": topo,
    }
    write_json(args.json, config, results)


if __name__ == "__main__":
    main()
