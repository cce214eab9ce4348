"""The sharding planner at scale, on paper: plan time and whether the plan fits.

Two seeded models, planned by ``tetrarec.planner`` (nothing is trained or allocated):

- ``12t-zionex``: a DLRM of about 12 trillion embedding parameters (``--tables`` 1,000
  tables; rows heavy-tailed (log-normal, scaled so that rows x dims sum to
  ``--params``), dims 64-256, pooling factors 1-100, access skew growing with the table's
  size) on the ``zionex-16x8`` preset (16 nodes x 8 GPUs, 40 GB device memory each,
  host memory and SSD per node), rows allowed in FP32, FP16 or INT8 and in the device,
  host or SSD tier (cached or not). Target: a fitting plan in under 60 s.
- ``1000-tables-128``: 1,000 tables of 0.1-20 M rows on 128 ranks with device memory
  only (no tiers, one precision). Target: under 10 s.

With ``--torchrec`` (and torchrec importable) TorchRec's ``EmbeddingShardingPlanner`` is
timed on the second model's tables and topology in the same run, in a child process
stopped after ``--torchrec-limit-s`` (then reported as a lower bound), and the ratio
printed; skipped cleanly when torchrec is not installed.

    python benchmarks/bench_planner.py --json out.json
    python benchmarks/bench_planner.py --smoke            # tiny, for the smoke test
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # run from a checkout without installing
from _harness import describe_run, json_path, kernel_summary, print_table, write_json  # noqa: E402

from tetrarec.models.config import DLRMConfig  # noqa: E402
from tetrarec.planner import (  # noqa: E402
    AccessStats,
    PlannerError,
    PlannerInputs,
    RankResources,
    TableSpec,
    Topology,
    dense_cost,
    plan,
)
from tetrarec.types import OptimizerKind, Precision  # noqa: E402

DIMS = (64, 128, 192, 256)


def make_tables(
    n: int, params: float, seed: int, precisions: tuple[Precision, ...], max_rows: int = 0
) -> tuple[TableSpec, ...]:
    """``n`` seeded tables whose rows x dims sum to about ``params`` (module docstring)."""
    rng = np.random.default_rng(seed)
    dims = rng.choice(DIMS, size=n)
    weight = rng.lognormal(mean=0.0, sigma=2.0, size=n)
    rows = np.maximum(100, (weight / weight.sum() * params / dims)).astype(np.int64)
    if max_rows:
        rows = np.minimum(rows, max_rows)
    pooling = np.clip(np.exp(rng.uniform(0.0, math.log(100.0), size=n)), 1.0, 100.0)
    tables = []
    for i in range(n):
        size = float(np.log10(rows[i]))
        hot1 = float(np.clip(0.05 * size, 0.01, 0.6))
        stats = AccessStats(
            mean_pooling=round(float(pooling[i]), 2),
            hot_1pct=round(hot1, 3),
            hot_5pct=round(min(1.0, hot1 * 1.5), 3),
        )
        tables.append(
            TableSpec(
                name=f"t{i:04d}",
                rows=int(rows[i]),
                dim=int(dims[i]),
                features=(f"f{i:04d}",),
                precision=precisions[0],
                precisions=precisions,
                optimizer=OptimizerKind.ROWWISE_ADAGRAD,
                stats=(stats,),
            )
        )
    return tuple(tables)


def run_case(name: str, inputs: PlannerInputs, target_s: float) -> dict[str, Any]:
    """Plan ``inputs``; one result row."""
    start = time.perf_counter()
    try:
        _, report = plan(inputs)
    except PlannerError as e:
        seconds = time.perf_counter() - start
        print(f"{name}: does not fit: {e}")
        return {"impl": "tetrarec", "case": name, "fits": False, "plan_seconds": seconds}
    seconds = time.perf_counter() - start
    print(f"\n== {name} ==\n{report.summary()}")
    kinds: dict[str, int] = {}
    tiers: dict[str, int] = {}
    precisions: dict[str, int] = {}
    for t in report.tables:
        kinds[t.label.split()[0]] = kinds.get(t.label.split()[0], 0) + 1
        tiers[t.tier] = tiers.get(t.tier, 0) + 1
        precisions[t.precision] = precisions.get(t.precision, 0) + 1
    return {
        "impl": "tetrarec",
        "kernels": kernel_summary()["kernels"],
        "case": name,
        "tables": len(report.tables),
        "world_size": len(report.ranks),
        "total_params": report.total_params,
        "plan_seconds": seconds,
        "target_s": target_s,
        "fits": True,
        "step_ms": report.step_s * 1e3,
        "imbalance": report.imbalance,
        "sharding_types": dict(sorted(kinds.items())),
        "tiers": dict(sorted(tiers.items())),
        "precisions": dict(sorted(precisions.items())),
    }


def device_only(topology: Topology) -> Topology:
    """``topology`` with device memory only (no host or SSD tier)."""
    rank = replace(topology.rank, host_memory=0.0, ssd=0.0, host_bandwidth=0.0, ssd_bandwidth=0.0)
    return replace(topology, name=f"{topology.name}-device-only", rank=RankResources(**vars(rank)))


def main(argv: list[str] | None = None) -> int:
    """Run both cases; print and write the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=json_path, metavar="PATH")
    p.add_argument("--smoke", action="store_true", help="tiny models, seconds")
    p.add_argument("--tables", type=int, default=1000)
    p.add_argument("--params", type=float, default=12e12, help="embedding parameters (12T)")
    p.add_argument("--batch", type=int, default=65536, help="global batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torchrec", action="store_true", help="also time TorchRec's planner")
    p.add_argument(
        "--torchrec-limit-s", type=float, default=600.0, help="stop TorchRec's planner after"
    )
    args = p.parse_args(argv)
    n = 40 if args.smoke else args.tables
    params = args.params / 100 if args.smoke else args.params
    zionex = Topology.preset("zionex-16x8")
    if args.smoke:
        zionex = zionex.resized(16)
    print(describe_run())
    flops, dense_params = dense_cost(DLRMConfig.dcn_v2(), n)
    big = PlannerInputs(
        tables=make_tables(n, params, args.seed, (Precision.FP32, Precision.FP16, Precision.INT8)),
        batch_size=args.batch,
        dense_flops_per_sample=flops,
        dense_params=dense_params,
        topology=zionex,
    )
    flat_topology = device_only(zionex)
    flat = PlannerInputs(
        tables=make_tables(n, n * 5e6 * 128, args.seed + 1, (Precision.FP16,), max_rows=20_000_000),
        batch_size=args.batch,
        dense_flops_per_sample=flops,
        dense_params=dense_params,
        topology=flat_topology,
    )
    results = [
        run_case("12t-zionex", big, 60.0),
        run_case(f"{n}-tables-{flat_topology.world_size}", flat, 10.0),
    ]
    if args.torchrec:
        results.append(torchrec_case(flat, results[-1], args.torchrec_limit_s))
    print()
    print_table(
        results,
        [
            "case",
            "impl",
            "tables",
            "world_size",
            "total_params",
            "plan_seconds",
            "fits",
            "step_ms",
            "tetrarec_speedup",
            "timed_out_after_s",
            "tetrarec_speedup_at_least",
        ],
    )
    write_json(
        args.json,
        {
            "tables": n,
            "params": params,
            "batch": args.batch,
            "seed": args.seed,
            "smoke": args.smoke,
        },
        results,
    )
    return 0


def torchrec_case(inputs: PlannerInputs, ours: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """TorchRec's ``EmbeddingShardingPlanner`` on the same tables and world, timed in a
    child process that is stopped after ``limit_s`` (reported as a lower bound)."""
    import multiprocessing as mp

    try:
        import torchrec  # noqa: F401
    except ImportError as e:
        print(f"torchrec: skipped ({e})")
        return {"impl": "torchrec", "case": ours["case"], "skipped": str(e)}
    queue: Any = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_torchrec_plan, args=(inputs, queue))
    child.start()
    child.join(limit_s)
    row: dict[str, Any] = {"impl": "torchrec", "case": ours["case"]}
    if child.is_alive():
        child.terminate()
        child.join()
        row.update(
            timed_out_after_s=limit_s, tetrarec_speedup_at_least=limit_s / ours["plan_seconds"]
        )
        print(f"torchrec: no plan after {limit_s:.0f} s (stopped)")
        return row
    result = queue.get() if not queue.empty() else {"error": f"exit code {child.exitcode}"}
    row.update(result)
    if "plan_seconds" in result:
        row["tetrarec_speedup"] = result["plan_seconds"] / ours["plan_seconds"]
    return row


def _torchrec_plan(inputs: PlannerInputs, queue: Any) -> None:
    """In the child: plan with TorchRec, put ``{"plan_seconds"}`` or ``{"error"}``."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import Topology as TRTopology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    topo = inputs.topology
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.dim,
                num_embeddings=t.rows,
                feature_names=list(t.features),
            )
            for t in inputs.tables
        ],
        device=torch.device("meta"),
    )
    planner = EmbeddingShardingPlanner(
        topology=TRTopology(
            world_size=topo.world_size,
            local_world_size=topo.ranks_per_node,
            compute_device="cuda",
            hbm_cap=int(topo.rank.device_memory),
            ddr_cap=0,
        ),
        batch_size=max(1, inputs.batch_size // topo.world_size),
    )
    start = time.perf_counter()
    try:
        planner.plan(ebc, [EmbeddingBagCollectionSharder()])  # type: ignore[list-item]
    except Exception as e:
        queue.put({"error": str(e)[:300]})
        return
    queue.put({"plan_seconds": time.perf_counter() - start})


if __name__ == "__main__":
    sys.exit(main())
