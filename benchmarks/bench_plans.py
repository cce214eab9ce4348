"""Does the planner's cost model predict real steps, and is its plan the fastest?

One DLRM whose tables differ in size and pooling, many plans of it, each run by tetrarec
on gloo ranks of this machine at each world size (default 2 and 4), and each priced by
the cost model (``tetrarec.planner.predict``) on a topology calibrated in the same run:

1. **calibrate**: every rank measures at once, with its share of the cores, a training
   lookup, an MLP's forward + backward and ``all_to_all_v`` (``bench_calibrate.rank_rates``);
   the slowest rank's figures make this world size's ``Topology``.
2. **plan**: the planner plans the model on that topology; the other plans are written
   here: every table table-wise round-robin, table-wise balanced by bytes, table-wise all
   on rank 0, row-wise, column-wise, data-parallel, a mix cycling the four, two hand plans
   (small tables data-parallel, big ones table-wise; the biggest row-wise), and, when
   torchrec is installed, TorchRec's ``EmbeddingShardingPlanner`` choice for the same
   tables and world, translated into a tetrarec plan.
3. **measure**: the ranks build every plan's sharded model, warm each up, then time
   ``--steps`` training steps of each, the plans taking turns step by step, each round
   starting at the next plan (so that a burst of load from elsewhere, and the place in
   the round, fall on all alike); a plan's step is the slowest rank's median.

With ``--repeats N`` (default 2) the plans are made once (on the first calibration),
then steps 1 and 3 run N times: each plan's predicted and measured step are the medians
over the repeats, and each repeat's own rank correlation is reported beside the pooled
one.

Reported per world size: predicted and measured step of every plan, the Spearman rank
correlation, the mean absolute error in percent, the planner's plan against the fastest
measured, and the ratios of the planner's plan to (a) table-wise round-robin, (b) row-wise
and (c) TorchRec's choice.

    python benchmarks/bench_plans.py --json out.json
    python benchmarks/bench_plans.py --smoke          # tiny, for the smoke test

JSON: ``{"env", "config", "results": [{"world_size", "plan", "predicted_ms",
"measured_ms", "predicted_ms_per_repeat", "measured_ms_per_repeat", ...}], "summary":
[{"world_size", "spearman", "spearman_per_repeat" (with repeats), "mape_pct",
"planner_vs_fastest", "planner_vs_tw_round_robin", ...}]}``; ``config.calibration``
holds, per world size, each repeat's rates and topology.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # run from a checkout without installing
from _harness import describe_run, json_path, kernel_summary, print_table, write_json  # noqa: E402
from _routing import ROUTE_BATCH, fit_routing  # noqa: E402
from bench_calibrate import (  # noqa: E402
    combine_rank_rates,
    rank_rates,
    rates_topology,
)
from bench_dlrm import NUM_DENSE, zipf_ids  # noqa: E402
from bench_sharding import _WithDense, training_step  # noqa: E402

from tetrarec.embedding import TableConfig  # noqa: E402
from tetrarec.models import DLRMConfig  # noqa: E402
from tetrarec.planner import (  # noqa: E402
    AccessStats,
    PlannerInputs,
    TableSpec,
    Topology,
    dense_cost,
    plan,
    predict,
)
from tetrarec.sharding import ShardingPlan, plan_by_type  # noqa: E402
from tetrarec.sharding.plan import Shard, TablePlan  # noqa: E402
from tetrarec.sharding.strategy import split_evenly  # noqa: E402
from tetrarec.types import OptimizerKind, ShardingType  # noqa: E402

# Rows and pooling of each table: heavy-tailed sizes, pooling from 1 to 20.
ROWS = (1_000_000, 500_000, 300_000, 200_000, 100_000, 50_000, 20_000, 10_000, 5_000, 2_000,
        1_000, 500)  # fmt: skip
POOLING = (1, 4, 1, 10, 2, 1, 20, 1, 3, 1, 8, 1)
SMOKE_ROWS = (2_000, 1_000, 500, 100)
SMOKE_POOLING = (1, 3, 2, 1)
DP_SMALL_ROWS = 50_000  # the hand plan's "small" tables


@dataclass(frozen=True)
class Config:
    """The model and the measurement (the same on every rank)."""

    rows: tuple[int, ...] = ROWS
    pooling: tuple[int, ...] = POOLING
    dim: int = 64
    batch: int = 2048
    zipf: float = 1.05
    warmup: int = 3
    steps: int = 20
    batches: int = 4
    lr: float = 0.01
    seed: int = 0
    cores: int = 2
    smoke: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"t{i}" for i in range(len(self.rows)))

    def mlp(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self.smoke:
            return (32, self.dim), (32, 1)
        return (512, 256, self.dim), (512, 256, 1)

    def dlrm(self) -> DLRMConfig:
        bottom, top = self.mlp()
        return DLRMConfig(num_dense=NUM_DENSE, bottom_mlp=bottom, top_mlp=top, seed=self.seed)

    def tables(self) -> list[TableConfig]:
        return [
            TableConfig(name=n, num_embeddings=r, dim=self.dim)
            for n, r in zip(self.names, self.rows)
        ]


# -- data ---------------------------------------------------------------------------------


def global_ids(cfg: Config, gen: torch.Generator) -> list[torch.Tensor]:
    """One global batch's ids per table (``batch x pooling`` each, sample-major)."""
    return [zipf_ids(r, cfg.batch * p, cfg.zipf, gen) for r, p in zip(cfg.rows, cfg.pooling)]


def rank_batches(cfg: Config, rank: int, world: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's slice of ``cfg.batches`` global batches: (dense, values, lengths, labels)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    local = cfg.batch // world
    lo, hi = rank * local, (rank + 1) * local
    out = []
    for _ in range(cfg.batches):
        dense = torch.randn(cfg.batch, NUM_DENSE, generator=gen)[lo:hi]
        ids = [t[lo * p : hi * p] for t, p in zip(global_ids(cfg, gen), cfg.pooling)]
        labels = (torch.rand(cfg.batch, generator=gen) < 0.25).float()[lo:hi]
        lengths = torch.cat([torch.full((local,), p, dtype=torch.int64) for p in cfg.pooling])
        out.append((dense, torch.cat(ids), lengths, labels))
    return out


def access_stats(cfg: Config) -> list[AccessStats]:
    """Each table's pooling and hot-row shares, counted over the benchmark's batches."""
    gen = torch.Generator().manual_seed(cfg.seed)
    counts = [np.zeros(r, dtype=np.int64) for r in cfg.rows]
    for _ in range(cfg.batches):
        torch.randn(cfg.batch, NUM_DENSE, generator=gen)  # keep the stream as rank_batches
        for c, ids in zip(counts, global_ids(cfg, gen)):
            np.add.at(c, ids.numpy(), 1)
        torch.rand(cfg.batch, generator=gen)
    out = []
    for c, p in zip(counts, cfg.pooling):
        s = np.sort(c)[::-1]
        total = max(int(s.sum()), 1)
        hot = [float(s[: max(1, int(f * len(s)))].sum() / total) for f in (0.01, 0.05)]
        out.append(AccessStats(mean_pooling=float(p), hot_1pct=hot[0], hot_5pct=hot[1]))
    return out


# -- plans ---------------------------------------------------------------------------------


def planner_inputs(cfg: Config, topology: Topology) -> PlannerInputs:
    flops, params = dense_cost(cfg.dlrm(), len(cfg.rows))
    return PlannerInputs(
        tables=tuple(
            TableSpec(
                name=t.name,
                rows=t.num_embeddings,
                dim=t.dim,
                features=(t.name,),
                optimizer=OptimizerKind.ROWWISE_ADAGRAD,
                stats=(s,),
            )
            for t, s in zip(cfg.tables(), access_stats(cfg))
        ),
        batch_size=cfg.batch,
        dense_flops_per_sample=flops,
        dense_params=params,
        topology=topology,
    )


def _whole(t: TableConfig, rank: int) -> TablePlan:
    shard = Shard(rank=rank, rows=(0, t.num_embeddings), cols=(0, t.dim))
    return TablePlan(table=t.name, sharding=ShardingType.TABLE_WISE, shards=(shard,))


def _row_wise(t: TableConfig, world: int) -> TablePlan:
    shards = tuple(
        Shard(rank=r, rows=rows, cols=(0, t.dim))
        for r, rows in enumerate(split_evenly(t.num_embeddings, world))
    )
    return TablePlan(table=t.name, sharding=ShardingType.ROW_WISE, shards=shards)


def hand_plans(cfg: Config, world: int) -> dict[str, ShardingPlan]:
    """The plans written here (module docstring), by name."""
    tables = cfg.tables()
    tw, rw, cw, dp = (
        ShardingType.TABLE_WISE,
        ShardingType.ROW_WISE,
        ShardingType.COLUMN_WISE,
        ShardingType.DATA_PARALLEL,
    )
    cycle = (tw, rw, cw, dp)

    def by_type(types: list[ShardingType]) -> ShardingPlan:
        return plan_by_type(tables, types, world_size=world)

    def custom(parts: list[TablePlan]) -> ShardingPlan:
        return ShardingPlan(world_size=world, local_world_size=world, tables=tuple(parts))

    biggest = max(range(len(tables)), key=lambda i: tables[i].num_embeddings)
    return {
        "tw_round_robin": custom([_whole(t, i % world) for i, t in enumerate(tables)]),
        "tw_balanced": by_type([tw] * len(tables)),
        "tw_one_rank": custom([_whole(t, 0) for t in tables]),
        "row_wise": custom([_row_wise(t, world) for t in tables]),
        "column_wise": by_type([cw] * len(tables)),
        "data_parallel": by_type([dp] * len(tables)),
        "mixed": by_type([cycle[i % 4] for i in range(len(tables))]),
        "dp_small_tw_big": by_type(
            [dp if t.num_embeddings < DP_SMALL_ROWS else tw for t in tables]
        ),
        "rw_biggest_tw_rest": by_type([rw if i == biggest else tw for i in range(len(tables))]),
    }


def torchrec_plan(cfg: Config, world: int, stats: list[AccessStats]) -> ShardingPlan | str:
    """TorchRec's ``EmbeddingShardingPlanner`` choice for the same tables, world and
    pooling (CPU compute device), as a tetrarec plan; a string says why there is none."""
    try:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.distributed.planner.types import Topology as TRTopology
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
    except Exception as e:  # not installed, or built against another torch
        return f"torchrec not importable ({type(e).__name__})"
    tables = cfg.tables()
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name, embedding_dim=t.dim, num_embeddings=t.num_embeddings,
                feature_names=[t.name],
            )
            for t in tables
        ],
        device=torch.device("meta"),
    )  # fmt: skip
    constraints = {
        t.name: ParameterConstraints(pooling_factors=[s.mean_pooling])
        for t, s in zip(tables, stats)
    }
    planner = EmbeddingShardingPlanner(
        topology=TRTopology(world_size=world, compute_device="cpu"),
        batch_size=cfg.batch // world,
        constraints=constraints,
    )
    try:
        trec = planner.plan(ebc, [EmbeddingBagCollectionSharder()])  # type: ignore[list-item]
    except Exception as e:
        return f"TorchRec's planner failed: {str(e)[:200]}"
    (module_plan,) = trec.plan.values()
    kinds = {
        "table_wise": ShardingType.TABLE_WISE,
        "row_wise": ShardingType.ROW_WISE,
        "column_wise": ShardingType.COLUMN_WISE,
        "data_parallel": ShardingType.DATA_PARALLEL,
        "table_row_wise": ShardingType.TABLE_ROW_WISE,
        "table_column_wise": ShardingType.TABLE_COLUMN_WISE,
    }
    parts = []
    for t in tables:
        ps = module_plan[t.name]  # type: ignore[index]
        kind = kinds[ps.sharding_type]
        if kind is ShardingType.DATA_PARALLEL:
            shards = tuple(
                Shard(rank=r, rows=(0, t.num_embeddings), cols=(0, t.dim)) for r in range(world)
            )
        else:
            shards = tuple(
                Shard(
                    rank=int(m.placement.rank()),
                    rows=(m.shard_offsets[0], m.shard_offsets[0] + m.shard_sizes[0]),
                    cols=(m.shard_offsets[1], m.shard_offsets[1] + m.shard_sizes[1]),
                )
                for m in ps.sharding_spec.shards
            )
        parts.append(TablePlan(table=t.name, sharding=kind, shards=shards))
    return ShardingPlan(world_size=world, local_world_size=world, tables=tuple(parts))


# -- ranks --------------------------------------------------------------------------------


def calibrate_worker(ctx: Any, cfg: Config) -> dict[str, float]:
    torch.set_num_threads(max(1, cfg.cores // ctx.world_size))
    bottom, top = cfg.mlp()
    f = len(cfg.rows) + 1
    mlps = ((NUM_DENSE, bottom), (cfg.dim + f * (f - 1) // 2, top))  # the DLRM's two MLPs
    if cfg.smoke:
        return rank_rates(
            ctx, rows=10_000, ids=2_048, mlp_batch=64, a2a_floats=4096, iters=3, mlps=mlps
        )
    return rank_rates(
        ctx,
        rows=1_000_000,
        ids=cfg.batch * 8 // ctx.world_size,
        mlp_batch=cfg.batch // ctx.world_size,
        a2a_floats=1 << 20,
        iters=10,
        mlps=mlps,
    )


def calibrated_topology(cfg: Config, world: int) -> tuple[Topology, dict[str, float]]:
    """This machine at ``world`` ranks, measured now (module docstring, step 1)."""
    from tetrarec.testing import run_ranks

    res = run_ranks(
        calibrate_worker,
        world_size=world,
        args=(cfg,),
        timeout_s=900,
        collective_timeout_s=300,
        deterministic=False,
    )
    floats = 4096 if cfg.smoke else 1 << 20
    rates = combine_rank_rates(res, floats)
    routes = {k: rates.pop(k) for k in list(rates) if k.startswith("route ")}
    rates |= fit_routing(routes, rates_topology(rates, world, cfg.cores), ROUTE_BATCH)
    return rates_topology(rates, world, cfg.cores), rates | routes


def _step(cfg: Config, splan: ShardingPlan, ctx: Any) -> Any:
    """A zero-argument training step of the DLRM sharded by ``splan``."""
    from tetrarec.embedding import SparseOptimizerSpec
    from tetrarec.kernels import FusedEmbeddingBagCollection
    from tetrarec.models import build_model
    from tetrarec.sharding import ShardingEnv, shard_model
    from tetrarec.sparse import SparseFeatures

    spec = SparseOptimizerSpec(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=cfg.lr)
    emb = FusedEmbeddingBagCollection(cfg.tables(), spec, seed=cfg.seed, device="meta")
    model = build_model(cfg.dlrm(), emb)
    env = ShardingEnv(ctx.comm, ctx.world_size, dense_comm=ctx.dense_comm)
    forward = shard_model(model, splan, env)
    batches = [
        (d, SparseFeatures.from_lengths(cfg.names, v, ln).with_value_counts(), y)
        for d, v, ln, y in rank_batches(cfg, ctx.rank, ctx.world_size)
    ]
    return training_step(model, forward, batches, lr=cfg.lr, global_batch=cfg.batch)


def measure_worker(ctx: Any, cfg: Config, plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """This rank's step times per plan: every plan's model is built, warmed up, then the
    plans take turns step by step (``cfg.steps`` rounds of one step each, each round
    starting at the next plan), so a burst of load from elsewhere on the machine, and
    the place in the round, fall on all of them alike."""
    from tetrarec.comm import second_group

    torch.set_num_threads(max(1, cfg.cores // ctx.world_size))
    ctx = _WithDense(ctx, second_group(ctx.comm))
    steps = {name: _step(cfg, ShardingPlan.from_dict(d), ctx) for name, d in plans.items()}
    for step in steps.values():
        for _ in range(cfg.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in plans}
    comm = {name: {"calls": 0.0, "bytes_sent": 0.0} for name in plans}
    names = list(steps)
    for i in range(cfg.steps):
        # each round starts at the next plan: a plan's place in the round (measured:
        # the first ran ~2 ms faster than the same plan later on) falls on all alike
        for name in names[i % len(names) :] + names[: i % len(names)]:
            step = steps[name]
            ctx.comm.barrier(label="bench")
            ctx.comm.reset_stats()
            ctx.dense_comm.reset_stats()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            stats = [*ctx.comm.stats.values(), *ctx.dense_comm.stats.values()]
            comm[name]["calls"] += sum(c.calls for c in stats) / cfg.steps
            comm[name]["bytes_sent"] += sum(c.bytes_sent for c in stats) / cfg.steps
    return {"times": times, "comm": comm, "kernels": kernel_summary()}


def measured_steps(cfg: Config, world: int, plans: dict[str, ShardingPlan]) -> dict[str, Any]:
    from tetrarec.testing import run_ranks

    res = run_ranks(
        measure_worker,
        world_size=world,
        args=(cfg, {k: p.to_dict() for k, p in plans.items()}),
        timeout_s=3600,
        collective_timeout_s=600,
        deterministic=False,
    )
    out: dict[str, Any] = {"kernels": res[0]["kernels"], "ms": {}, "comm": {}}
    for name in plans:
        # a step ends when its slowest rank does
        out["ms"][name] = max(statistics.median(r["times"][name]) for r in res) * 1e3
        # per rank per step: calls on rank 0, bytes sent by the busiest rank
        out["comm"][name] = {
            "calls": res[0]["comm"][name]["calls"],
            "bytes_sent": max(r["comm"][name]["bytes_sent"] for r in res),
        }
    return out


# -- statistics -----------------------------------------------------------------------------


def _ranks(x: list[float]) -> np.ndarray:
    """Ranks from 1, ties averaged."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    ranks = np.empty(len(a))
    ranks[order] = np.arange(1, len(a) + 1)
    for v in np.unique(a):
        tied = a == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (Pearson's over the ranks, ties averaged)."""
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def summarize(world: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the planner issue asks for, at one world size."""
    pred = [r["predicted_ms"] for r in rows]
    meas = [r["measured_ms"] for r in rows]
    by = {r["plan"]: r["measured_ms"] for r in rows}
    ours = by["planner"]
    fastest = min(rows, key=lambda r: r["measured_ms"])
    out: dict[str, Any] = {
        "world_size": world,
        "plans": len(rows),
        "spearman": spearman(pred, meas),
        "mape_pct": 100 * statistics.fmean(abs(p - m) / m for p, m in zip(pred, meas)),
        "fastest": fastest["plan"],
        "planner_vs_fastest": ours / fastest["measured_ms"],
        "planner_vs_tw_round_robin": by["tw_round_robin"] / ours,
        "planner_vs_row_wise": by["row_wise"] / ours,
    }
    if "torchrec" in by:
        out["planner_vs_torchrec"] = by["torchrec"] / ours
    repeats = len(rows[0].get("measured_ms_per_repeat", []))
    if repeats > 1:
        out["spearman_per_repeat"] = [
            round(
                spearman(
                    [r["predicted_ms_per_repeat"][k] for r in rows],
                    [r["measured_ms_per_repeat"][k] for r in rows],
                ),
                3,
            )
            for k in range(repeats)
        ]
    return out


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-sizes", default=None, help="default 2,4 (with --smoke: 2)")
    p.add_argument("--batch", type=int, default=2048, help="global batch")
    p.add_argument("--steps", type=int, default=40, help="timed steps per plan (in turns)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="calibrate and time every plan this many times (default 2, with --smoke 1); "
        "each plan's predicted and measured step are the medians over the repeats: one "
        "repeat's rank correlation swings with the machine (0.77-0.96 here)",
    )
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    p.add_argument(
        "--torchrec",
        choices=("auto", "no"),
        default="auto",
        help="also run TorchRec's planner's choice (when torchrec is installed)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the smoke test")
    p.add_argument("--json", type=json_path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(
        rows=SMOKE_ROWS if args.smoke else ROWS,
        pooling=SMOKE_POOLING if args.smoke else POOLING,
        dim=8 if args.smoke else 64,
        batch=64 if args.smoke else args.batch,
        warmup=1 if args.smoke else args.warmup,
        steps=2 if args.smoke else args.steps,
        cores=args.cores,
        smoke=args.smoke,
    )
    worlds = [int(w) for w in (args.world_sizes or ("2" if args.smoke else "2,4")).split(",")]
    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 2)
    stats = access_stats(cfg)
    results: list[dict[str, Any]] = []
    summary = []
    topologies = {}
    kernels: dict[str, Any] = {}
    for world in worlds:
        plans: dict[str, ShardingPlan] = {}
        runs: list[dict[str, Any]] = []  # per repeat: predictions and measurements
        for rep in range(repeats):
            tag = f" (repeat {rep + 1} of {repeats})" if repeats > 1 else ""
            print(f"# {world} ranks: calibrating{tag}", file=sys.stderr, flush=True)
            topo, rates = calibrated_topology(cfg, world)
            inputs = planner_inputs(cfg, topo)
            if not plans:  # the plans are made once, on the first calibration
                plans = hand_plans(cfg, world)
                plans["planner"], report = plan(inputs)
                print(report.describe(), file=sys.stderr)
                if args.torchrec == "auto" and not args.smoke:
                    trec = torchrec_plan(cfg, world, stats)
                    if isinstance(trec, ShardingPlan):
                        plans["torchrec"] = trec
                    else:
                        print(f"# torchrec plan skipped: {trec}", file=sys.stderr)
            print(f"# {world} ranks: timing {len(plans)} plans{tag}", file=sys.stderr, flush=True)
            measured = measured_steps(cfg, world, plans)
            kernels = {"kernels": measured["kernels"]}
            runs.append(
                {
                    "rates": rates,
                    "topology": topo.describe(),
                    "predicted": {name: predict(inputs, p) for name, p in plans.items()},
                    "measured": measured,
                }
            )
        topologies[world] = [{"rates": r["rates"], "topology": r["topology"]} for r in runs]
        rows = []
        for name, p in plans.items():
            reps = [r["predicted"][name] for r in runs]
            slowest = [max(rep.ranks, key=lambda r: r.step_s) for rep in reps]
            predicted_ms = statistics.median(rep.step_s for rep in reps) * 1e3
            measured_ms = statistics.median(r["measured"]["ms"][name] for r in runs)
            rows.append(
                {
                    "impl": "tetrarec",
                    "kernels": runs[0]["measured"]["kernels"]["kernels"],
                    "world_size": world,
                    "plan": name,
                    "types": ",".join(sorted({t.sharding.value for t in p})),
                    "predicted_ms": predicted_ms,
                    "measured_ms": measured_ms,
                    "error_pct": 100 * (predicted_ms / measured_ms - 1),
                    "pred_lookup_ms": statistics.median(s.lookup_s for s in slowest) * 1e3,
                    "pred_comm_ms": statistics.median(s.comm_s for s in slowest) * 1e3,
                    "pred_dense_ms": statistics.median(s.dense_s for s in slowest) * 1e3,
                    "collectives": runs[0]["measured"]["comm"][name]["calls"],
                    "max_mb_sent": runs[0]["measured"]["comm"][name]["bytes_sent"] / 1e6,
                    "predicted_ms_per_repeat": [r["predicted"][name].step_s * 1e3 for r in runs],
                    "measured_ms_per_repeat": [r["measured"]["ms"][name] for r in runs],
                    "plan_json": p.to_dict(),
                }
            )
        results.extend(rows)
        summary.append(summarize(world, rows))
    print(describe_run(kernels))
    print_table(
        results,
        ["world_size", "plan", "predicted_ms", "measured_ms", "error_pct", "pred_lookup_ms",
         "pred_comm_ms", "pred_dense_ms", "collectives", "max_mb_sent"],
    )  # fmt: skip
    print()
    print_table(
        summary,
        ["world_size", "plans", "spearman", "spearman_per_repeat", "mape_pct", "fastest",
         "planner_vs_fastest", "planner_vs_tw_round_robin", "planner_vs_row_wise",
         "planner_vs_torchrec"],
    )  # fmt: skip
    config = asdict(cfg) | {"world_sizes": worlds, "calibration": topologies}
    write_json(args.json, config, results, kernels=kernels, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
