"""Sharded DLRM training step: every sharding type and world size, against the one-process
step and TorchRec's DistributedModelParallel (table-wise), measured in the same run.

The workload is the Criteo-Kaggle DLRM of the kernel benchmarks: 26 tables x 1M rows x
dim 64 (data-parallel tables: --dp-rows, since every rank holds a copy), global batch
2048, pooling 1, Zipf ids, row-wise Adagrad fused into backward, bottom MLP 512-256-64,
top 512-256-1, dot interaction. Ranks are gloo processes on this machine (loopback);
each rank runs max(1, cores / world) threads.

    python benchmarks/bench_sharding.py                    # every type at 2 and 4 ranks
    python benchmarks/bench_sharding.py --types table_wise --world-sizes 2 --json out.json
    python benchmarks/bench_sharding.py --smoke            # tiny, for the smoke test

For each (type, world size) the ranks time ``--rounds`` rounds of ``--steps`` steps; with
TorchRec installed (../shared/peers/install-peers.sh) the table-wise ranks at world size
2 also build TorchRec's DMP of the same model and the rounds alternate between the two
(tetrarec, TorchRec, tetrarec, ...), so both see the same noise. samples/s is the global
batch over rank 0's median step time. bytes_per_step is what all ranks sent to other
ranks per step, per collective (tetrarec's, counted in comm/). JSON:
``{"env", "config", "results": [{"impl", "sharding", "world_size", "samples_per_s",
"bytes_per_step", ...}]}``; the one-process step has world_size 1.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import describe_run, json_path, kernel_summary, print_table, write_json
from bench_dlrm import NUM_DENSE, zipf_ids

TYPES = (
    "table_wise",
    "row_wise",
    "column_wise",
    "data_parallel",
    "table_row_wise",
    "table_column_wise",
    "mixed",
)
MIXED_CYCLE = ("table_wise", "row_wise", "column_wise", "data_parallel")


@dataclass(frozen=True)
class Config:
    """One benchmark run's workload (the same on every rank)."""

    tables: int = 26
    rows: int = 1_000_000
    dp_rows: int = 100_000
    dim: int = 64
    batch: int = 2048
    pooling: int = 1
    zipf: float = 1.05
    steps: int = 5
    warmup: int = 3
    rounds: int = 8
    batches: int = 4
    lr: float = 0.01
    seed: int = 0
    smoke: bool = False
    cores: int = 2
    profile: str | None = None

    def mlp(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self.smoke:
            return (32, self.dim), (32, 1)
        return (512, 256, self.dim), (512, 256, 1)


def table_types(cfg: Config, kind: str) -> list[str]:
    """The sharding type of each table."""
    if kind == "mixed":
        return [MIXED_CYCLE[i % len(MIXED_CYCLE)] for i in range(cfg.tables)]
    return [kind] * cfg.tables


def table_rows(cfg: Config, kind: str) -> list[int]:
    """Rows of each table: data-parallel tables are small (every rank holds them)."""
    return [cfg.dp_rows if t == "data_parallel" else cfg.rows for t in table_types(cfg, kind)]


def rank_batches(
    cfg: Config, rows: list[int], rank: int, world: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's slice of ``cfg.batches`` global batches: (dense, values, lengths, labels)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    local = cfg.batch // world
    lo, hi = rank * local, (rank + 1) * local
    out = []
    for _ in range(cfg.batches):
        dense = torch.randn(cfg.batch, NUM_DENSE, generator=gen)[lo:hi]
        ids = [
            zipf_ids(r, cfg.batch * cfg.pooling, cfg.zipf, gen)[lo * cfg.pooling : hi * cfg.pooling]
            for r in rows
        ]
        labels = (torch.rand(cfg.batch, generator=gen) < 0.25).float()[lo:hi]
        lengths = torch.full((cfg.tables * local,), cfg.pooling, dtype=torch.int64)
        out.append((dense, torch.cat(ids), lengths, labels))
    return out


# -- tetrarec ---------------------------------------------------------------------------


def tetrarec_step(cfg: Config, kind: str, ctx: Any) -> Any:
    """A zero-argument training step of tetrarec's DLRM, sharded by ``kind`` (or one process)."""
    from tetrarec.embedding import SparseOptimizerSpec, TableConfig
    from tetrarec.kernels import FusedEmbeddingBagCollection
    from tetrarec.models import DLRMConfig, build_model
    from tetrarec.sharding import ShardingEnv, plan_by_type, shard_model
    from tetrarec.sparse import SparseFeatures
    from tetrarec.types import ShardingType

    world = ctx.world_size if ctx is not None else 1
    rows = table_rows(cfg, kind)
    tables = [TableConfig(name=f"t{i}", num_embeddings=r, dim=cfg.dim) for i, r in enumerate(rows)]
    spec = SparseOptimizerSpec(kind="rowwise_adagrad", lr=cfg.lr)
    bottom, top = cfg.mlp()
    dlrm = DLRMConfig(num_dense=NUM_DENSE, bottom_mlp=bottom, top_mlp=top, seed=cfg.seed)
    if ctx is None:
        emb = FusedEmbeddingBagCollection(tables, spec, seed=cfg.seed)
        model = build_model(dlrm, emb)
        forward: Any = model
    else:
        local = max(1, world // 2) if kind.startswith("table_") and kind != "table_wise" else world
        env = ShardingEnv(ctx.comm, local, dense_comm=ctx.dense_comm)
        types = [ShardingType.parse(t) for t in table_types(cfg, kind)]
        plan = plan_by_type(tables, types, world_size=world, local_world_size=local)
        emb = FusedEmbeddingBagCollection(tables, spec, seed=cfg.seed, device="meta")
        model = build_model(dlrm, emb)
        forward = shard_model(model, plan, env)
    keys = tuple(f"t{i}" for i in range(cfg.tables))
    rank = ctx.rank if ctx is not None else 0
    batches = [
        (d, SparseFeatures.from_lengths(keys, v, ln).with_value_counts(), y)
        for d, v, ln, y in rank_batches(cfg, rows, rank, world)
    ]
    return training_step(model, forward, batches, lr=cfg.lr, global_batch=cfg.batch)


def training_step(
    model: Any, forward: Any, batches: list[Any], *, lr: float, global_batch: int
) -> Any:
    """A zero-argument DLRM training step over ``batches`` (cycled): dense Adagrad, the
    fused sparse optimizer, and the loss of this rank's samples over the global batch."""
    dense_opt = torch.optim.Adagrad(list(model.dense_parameters()), lr=lr)
    sparse_opt = model.embeddings.fused_optimizer
    it = [0]

    def step() -> None:
        dense, sparse, labels = batches[it[0] % len(batches)]
        it[0] += 1
        dense_opt.zero_grad(set_to_none=True)
        logits = forward(dense, sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        torch.autograd.backward(loss / global_batch)
        dense_opt.step()
        sparse_opt.step()

    return step


# -- TorchRec ---------------------------------------------------------------------------


def torchrec_available() -> bool:
    try:
        import torchrec.distributed  # noqa: F401
    except Exception:
        return False
    return True


def torchrec_step(cfg: Config, ctx: Any) -> Any:
    """A zero-argument step of TorchRec's DLRM under DistributedModelParallel, table-wise,
    with FBGEMM's row-wise Adagrad fused into backward and Adagrad on the dense part."""
    import torch.distributed as dist
    import torchrec.optim as trec_optim
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rows = table_rows(cfg, "table_wise")
    names = [f"t{i}" for i in range(cfg.tables)]
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=cfg.dim, num_embeddings=r, feature_names=[n])
        for n, r in zip(names, rows)
    ]
    torch.manual_seed(cfg.seed)
    bottom, top = cfg.mlp()
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(configs, device=torch.device("meta")),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=list(bottom),
        over_arch_layer_sizes=list(top),
        dense_device=torch.device("cpu"),
    )
    apply_optimizer_in_backward(
        trec_optim.RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": cfg.lr}
    )
    constraints = {
        n: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for n in names
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=ctx.world_size, compute_device="cpu"),
        constraints=constraints,
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=cfg.lr),
    )
    batches = [
        (d, KeyedJaggedTensor.from_lengths_sync(keys=names, values=v, lengths=ln), y)
        for d, v, ln, y in rank_batches(cfg, rows, ctx.rank, ctx.world_size)
    ]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    it = [0]

    def step() -> None:
        dense, kjt, labels = batches[it[0] % len(batches)]
        it[0] += 1
        dense_opt.zero_grad()
        loss_fn(dmp(dense, kjt).reshape(-1), labels).backward()
        dense_opt.step()

    return step


# -- ranks ------------------------------------------------------------------------------


def _timed(step: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def rank_worker(ctx: Any, cfg: Config, kind: str, with_torchrec: bool) -> dict[str, Any]:
    """Build the implementations on this rank, then time them in alternating rounds."""
    from tetrarec.comm import second_group

    torch.set_num_threads(max(1, cfg.cores // ctx.world_size))
    ctx = _WithDense(ctx, second_group(ctx.comm))
    steps = {"tetrarec": tetrarec_step(cfg, kind, ctx)}
    if with_torchrec:
        steps["torchrec"] = torchrec_step(cfg, ctx)
    for step in steps.values():
        _timed(step, cfg.warmup)
    ctx.comm.reset_stats()
    ctx.dense_comm.reset_stats()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(cfg.rounds):
        for name, step in steps.items():
            times[name].extend(_timed(step, cfg.steps))
    timed = cfg.rounds * cfg.steps
    sent = {k: v.bytes_sent / timed for k, v in ctx.comm.stats.items()}
    sent.update({k: v.bytes_sent / timed for k, v in ctx.dense_comm.stats.items()})
    if cfg.profile:
        _profile(steps, cfg, ctx.rank)
    return {"times": times, "bytes": sent, "kernels": kernel_summary()}


def _profile(steps: dict[str, Any], cfg: Config, rank: int) -> None:
    """torch.profiler over ``cfg.steps`` more steps of each implementation (after the timed
    rounds, so they are not slowed), written per rank as ``<dir>/rank<r>-<impl>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    out = Path(cfg.profile or ".")
    out.mkdir(parents=True, exist_ok=True)
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _timed(step, cfg.steps)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
        (out / f"rank{rank}-{name}.txt").write_text(f"{cfg.steps} steps\n{table}\n")


@dataclass(frozen=True)
class _WithDense:
    inner: Any
    dense_comm: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def one_process_worker(ctx: Any, cfg: Config) -> dict[str, Any]:
    """The one-process (unsharded) step, timed alone with every core."""
    torch.set_num_threads(cfg.cores)
    step = tetrarec_step(cfg, "table_wise", None)
    _timed(step, cfg.warmup)
    times = {"tetrarec": _timed(step, cfg.rounds * cfg.steps)}
    return {"times": times, "bytes": {}, "kernels": kernel_summary()}


def run_point(cfg: Config, kind: str, world: int, with_torchrec: bool) -> list[dict[str, Any]]:
    """Spawn the ranks of one (type, world size) point; its result rows."""
    from tetrarec.testing import run_ranks

    if world == 1:
        res = run_ranks(
            one_process_worker, world_size=1, args=(cfg,), timeout_s=1800, deterministic=False
        )
    else:
        res = run_ranks(
            rank_worker,
            world_size=world,
            args=(cfg, kind, with_torchrec),
            timeout_s=1800,
            collective_timeout_s=600,
            deterministic=False,
        )
    rows = []
    kernels = res[0]["kernels"]
    for impl, seconds in res[0]["times"].items():
        med = statistics.median(seconds)
        by_label: dict[str, float] = {}
        if impl == "tetrarec":
            for r in res:
                for label, b in r["bytes"].items():
                    by_label[label] = by_label.get(label, 0.0) + b
        rows.append(
            {
                "impl": impl,
                "sharding": kind if world > 1 else "none",
                "world_size": world,
                "samples_per_s": cfg.batch / med,
                "step_ms_median": med * 1e3,
                "step_ms_min": min(seconds) * 1e3,
                "step_ms": [round(x * 1e3, 3) for x in seconds],
                "bytes_per_step": sum(by_label.values()) if impl == "tetrarec" else None,
                "bytes_per_collective": by_label if impl == "tetrarec" else None,
                "kernels": kernels["kernels"] if impl == "tetrarec" else "fbgemm",
            }
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--types",
        default=None,
        help="comma-separated (default: all; with --smoke: table_wise,mixed); "
        "'mixed' cycles TW, RW, CW, DP over the tables",
    )
    p.add_argument("--world-sizes", default=None, help="default 2,4 (with --smoke: 2)")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dp-rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048, help="global batch")
    p.add_argument("--pooling", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--rounds", type=int, default=8, help="rounds per implementation, alternating")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    p.add_argument("--torchrec", choices=("auto", "no"), default="auto",
                   help="also time TorchRec's DMP table-wise at world size 2")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the smoke test")
    p.add_argument("--json", type=json_path, default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, write each rank's profiles to DIR")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(
        tables=args.tables if not args.smoke else 4,
        rows=args.rows if not args.smoke else 1000,
        dp_rows=args.dp_rows if not args.smoke else 100,
        dim=args.dim if not args.smoke else 8,
        batch=args.batch if not args.smoke else 64,
        pooling=args.pooling,
        steps=args.steps if not args.smoke else 2,
        rounds=args.rounds if not args.smoke else 1,
        warmup=args.warmup if not args.smoke else 1,
        smoke=args.smoke,
        cores=args.cores,
        profile=args.profile,
    )
    types = args.types or ("table_wise,mixed" if args.smoke else ",".join(TYPES))
    kinds = [t.strip() for t in types.split(",") if t.strip()]
    bad = [k for k in kinds if k not in TYPES]
    if bad:
        raise SystemExit(f"unknown --types {bad}; valid: {', '.join(TYPES)}")
    worlds = [int(w) for w in (args.world_sizes or ("2" if args.smoke else "2,4")).split(",")]
    with_torchrec = args.torchrec == "auto" and torchrec_available() and not args.smoke
    results = run_point(cfg, "none", 1, False)
    for world in worlds:
        for kind in kinds:
            trec = with_torchrec and world == 2 and kind == "table_wise"
            print(f"# {kind} on {world} ranks{' (+ TorchRec)' if trec else ''}", file=sys.stderr)
            results.extend(run_point(cfg, kind, world, trec))
    base = results[0]["samples_per_s"]
    for r in results:
        r["vs_one_process"] = r["samples_per_s"] / base
    trec_rows = [r for r in results if r["impl"] == "torchrec"]
    for t in trec_rows:
        ours = next(
            r for r in results
            if r["impl"] == "tetrarec" and r["sharding"] == t["sharding"]
            and r["world_size"] == t["world_size"]
        )  # fmt: skip
        ours["vs_torchrec"] = ours["samples_per_s"] / t["samples_per_s"]
    cols = ["impl", "sharding", "world_size", "samples_per_s", "step_ms_median",
            "vs_one_process", "bytes_per_step"]  # fmt: skip
    if trec_rows:
        cols.append("vs_torchrec")
    kernels = {"kernels": results[0]["kernels"]}
    print(describe_run(kernels))
    print_table(results, cols)
    config = asdict(cfg) | {"types": kinds, "world_sizes": worlds}
    write_json(args.json, config, results, kernels=kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
