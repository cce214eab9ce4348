"""Full DLRM / DLRM-DCNv2 training step: tetrarec against TorchRec, in one run.

A step is forward, BCE-with-logits loss, backward (the fused embedding applies its
row-wise Adagrad update inside backward) and the dense Adagrad step. Each
implementation runs in its own child process, one after the other, so that its peak
RSS is its own and the two never hold their tables at the same time.

    flock /tmp/tetrarec-bigbench.lock .venv/bin/python benchmarks/bench_dlrm.py \\
        --model dlrm --pooling 1 --dense-dtype fp32,bf16 --json out.json

Criteo-Kaggle shape by default: 13 dense features, bottom MLP 512-256-64, 26 tables
x 1,000,000 rows x dim 64, top MLP 512-256-1 (DLRM) or 3 low-rank (512) cross layers
and top MLP 1024-1024-512-256-1 (DLRM-DCNv2), batch 2048, Zipf(1.05) ids.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # run from a checkout without installing
from _harness import (  # noqa: E402
    ServingChild,
    Timing,
    describe_run,
    json_path,
    kernel_summary,
    measure,
    peak_rss_gib,
    print_table,
    write_json,
)

NUM_DENSE = 13
ADAGRAD_EPS = 1e-8


# -- data -------------------------------------------------------------------------------


def zipf_ids(rows: int, n: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` ids in ``[0, rows)`` with P(rank k) ~ k^-alpha, hot rows scattered."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        rank = torch.exp(u * math.log(rows + 1.0))  # bounded continuous 1/k law
    else:
        a = 1.0 - alpha
        rank = ((math.pow(rows + 1.0, a) - 1.0) * u + 1.0).pow(1.0 / a)
    rank = (rank.floor().long() - 1).clamp_(0, rows - 1)
    # 2654435761 is prime, so for any table smaller than it this permutes the ranks.
    return (rank * 2654435761) % rows


def make_batches(args: argparse.Namespace, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` distinct batches (dense, key-major values/lengths, labels), cycled."""
    gen = torch.Generator().manual_seed(args.seed)
    bag_ids = args.batch * args.pooling
    return [
        {
            "dense": torch.randn(args.batch, NUM_DENSE, generator=gen),
            "values": torch.cat(
                [zipf_ids(args.rows, bag_ids, args.zipf, gen) for _ in range(args.tables)]
            ),
            "lengths": torch.full((args.tables * args.batch,), args.pooling, dtype=torch.int64),
            "labels": (torch.rand(args.batch, generator=gen) < 0.25).float(),
        }
        for _ in range(n)
    ]


def model_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """Layer sizes of the benchmarked model (scaled down under --smoke)."""
    if args.smoke:
        return {"bottom": (32, args.dim), "top_dlrm": (32, 1), "top_dcn": (32, 16, 1), "rank": 8}
    return {
        "bottom": (512, 256, args.dim),
        "top_dlrm": (512, 256, 1),
        "top_dcn": (1024, 1024, 512, 256, 1),
        "rank": 512,
    }


# -- tetrarec ---------------------------------------------------------------------------


def build_embeddings(args: argparse.Namespace) -> Any:
    """The tetrarec embedding module the bench uses (fused unless --embedding reference)."""
    from tetrarec.embedding import EmbeddingBagCollection, SparseOptimizerSpec, TableConfig
    from tetrarec.types import OptimizerKind

    tables = [
        TableConfig(name=f"t{i}", num_embeddings=args.rows, dim=args.dim, precision=args.precision)
        for i in range(args.tables)
    ]
    if args.embedding == "fused":
        from tetrarec.kernels import FusedEmbeddingBagCollection

        spec = SparseOptimizerSpec(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=args.lr, eps=ADAGRAD_EPS)
        emb = FusedEmbeddingBagCollection(tables, spec, seed=args.seed)
    else:
        emb = EmbeddingBagCollection(tables, seed=args.seed)
    return emb


def dense_variant(variant: str) -> tuple[str, str]:
    """``(dense precision, bf16 matmul)`` of a ``--dense-dtype`` entry.

    ``fp32``; ``bf16`` (BF16 products, native where this CPU has BF16 units, else
    emulated on FP32 kernels); ``bf16-native`` (torch.autocast); ``bf16-emulated``.
    """
    precision, _, matmul = variant.partition("-")
    if precision not in ("fp32", "bf16") or (matmul and precision == "fp32"):
        raise SystemExit(
            f"bad --dense-dtype entry {variant!r}: fp32, bf16, bf16-native, bf16-emulated"
        )
    return precision, matmul or "auto"


def bf16_matmul_used(variant: str) -> str:
    """What a variant's BF16 products ran as on this machine ("" for FP32)."""
    from tetrarec.models.precision import has_native_bf16

    precision, matmul = dense_variant(variant)
    if precision == "fp32":
        return ""
    if matmul == "auto":
        return "native" if has_native_bf16("cpu") else "emulated"
    return matmul


def build_tetrarec(
    args: argparse.Namespace, dense_dtype: str, emb: Any = None
) -> tuple[Any, Any, Any]:
    """Our model (around ``emb`` if given); returns (model, dense opt, sparse opt or None).

    ``dense_dtype`` is a ``--dense-dtype`` entry (see ``dense_variant``).
    """
    from tetrarec.models import DLRMConfig, build_model

    precision, matmul = dense_variant(dense_dtype)
    emb = build_embeddings(args) if emb is None else emb
    s = model_sizes(args)
    cfg = DLRMConfig(
        num_dense=NUM_DENSE,
        bottom_mlp=s["bottom"],
        top_mlp=s["top_dlrm"] if args.model == "dlrm" else s["top_dcn"],
        arch=args.model,
        interaction_impl=args.interaction,
        dcn_layers=3,
        dcn_low_rank=s["rank"],
        dense_precision=precision,
        bf16_matmul=matmul,
        seed=args.seed,
    )
    model = build_model(cfg, emb)
    dense_opt = torch.optim.Adagrad(list(model.dense_parameters()), lr=args.lr, fused=True)
    sparse_opt = None
    if not hasattr(emb, "fused_optimizer"):  # reference path: element-wise Adagrad on sparse grads
        sparse_opt = torch.optim.Adagrad(emb.sparse_parameters(), lr=args.lr)
    return model, dense_opt, sparse_opt


def tetrarec_steps(args: argparse.Namespace, dense_dtypes: list[str]) -> dict[str, Any]:
    """``{dense dtype: zero-argument training step}``; the variants share one embedding
    module (so one copy of the tables) and the same cycled batches."""
    from tetrarec.sparse import SparseFeatures

    emb = build_embeddings(args)
    keys = tuple(f"t{i}" for i in range(args.tables))
    batches = [
        (
            b["dense"],
            SparseFeatures.from_lengths(keys, b["values"], b["lengths"]).with_value_counts(),
            b["labels"],
        )
        for b in make_batches(args, args.num_batches)
    ]
    steps = {}
    for d in dense_dtypes:
        model, dense_opt, sparse_opt = build_tetrarec(args, d, emb)
        steps[d] = train_step(model, [dense_opt] + ([sparse_opt] if sparse_opt else []), batches)
    return steps


def train_step(model: Any, optimizers: list[Any], batches: list[Any]) -> Any:
    """A zero-argument step: forward, BCE-with-logits, backward, optimizer steps."""
    loss_fn = torch.nn.BCEWithLogitsLoss()
    it = [0]

    def step() -> None:
        dense, sparse, labels = batches[it[0] % len(batches)]
        it[0] += 1
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss_fn(model(dense, sparse).reshape(-1), labels).backward()
        for opt in optimizers:
            opt.step()

    return step


# -- TorchRec ---------------------------------------------------------------------------


def torchrec_steps(args: argparse.Namespace) -> dict[str, Any]:
    """TorchRec's DLRM / DLRM_DCN over its fused (FBGEMM TBE) embedding collection."""
    import torchrec.optim as trec_optim
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(args.seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"t{i}"]
        )
        for i in range(args.tables)
    ]
    # EXACT_ROWWISE_ADAGRAD in FBGEMM's CPU TBE, applied in backward.
    ebc = FusedEmbeddingBagCollection(
        tables=tables,
        optimizer_type=trec_optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": args.lr, "eps": ADAGRAD_EPS},
    )
    s = model_sizes(args)
    common = {"embedding_bag_collection": ebc, "dense_in_features": NUM_DENSE}
    common["dense_arch_layer_sizes"] = list(s["bottom"])
    if args.model == "dlrm":
        model = DLRM(**common, over_arch_layer_sizes=list(s["top_dlrm"]))
    else:
        model = DLRM_DCN(
            **common,
            over_arch_layer_sizes=list(s["top_dcn"]),
            dcn_num_layers=3,
            dcn_low_rank_dim=s["rank"],
        )
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]
    dense_opt = torch.optim.Adagrad(dense_params, lr=args.lr, fused=True)
    keys = [f"t{i}" for i in range(args.tables)]
    kjt = KeyedJaggedTensor.from_lengths_sync
    batches = [
        (b["dense"], kjt(keys=keys, values=b["values"], lengths=b["lengths"]), b["labels"])
        for b in make_batches(args, args.num_batches)
    ]
    return {"fp32": train_step(model, [dense_opt], batches)}


# -- driver -----------------------------------------------------------------------------
#
# Each implementation lives in its own child process (its own peak RSS, its own tables).
# The parent starts them all, then times them in alternating rounds (A B A B ...): on a
# shared, noisy machine every implementation sees the same mix of quiet and busy spells,
# so the ratios hold even when the absolute times drift. Protocol, one line each:
#   child -> parent  "@@ready KERNELS"    after building and warming up (the kernel
#                                         path that ran: see _harness.kernel_summary)
#   parent -> child  "run VARIANT K"      child -> parent "@@times [s, s, ...]"
#   parent -> child  "quit"               child -> parent "@@rss GIB"


def build_steps(args: argparse.Namespace, impl: str, variants: list[str]) -> dict[str, Any]:
    """``{variant: step}`` for one implementation, warmed up."""
    torch.set_num_threads(args.threads)
    steps = torchrec_steps(args) if impl == "torchrec" else tetrarec_steps(args, variants)
    for step in steps.values():
        measure(step, warmup=args.warmup, iters=0)
    return steps


def profile_steps(impl: str, args: argparse.Namespace, steps: dict[str, Any]) -> None:
    from torch.profiler import ProfilerActivity, profile

    for variant, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        print(f"--- profile: {impl} {args.model} {variant} (3 steps) ---\n{table}", file=sys.stderr)


def serve(args: argparse.Namespace) -> None:
    """Child side of the protocol above."""
    steps = build_steps(args, args.impl, args.dense_dtype.split(","))
    print("@@ready " + json.dumps(kernel_summary()), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            timing = measure(steps[cmd[1]], warmup=0, iters=int(cmd[2]))
            print("@@times " + json.dumps(timing.seconds), flush=True)
        elif cmd[0] == "quit":
            if args.profile:
                profile_steps(args.impl, args, steps)
            print(f"@@rss {peak_rss_gib()}", flush=True)
            return


class _Child:
    """A serving child process (or, under --smoke, the same calls in this process)."""

    def __init__(self, args: argparse.Namespace, impl: str, variants: list[str]) -> None:
        self.impl, self.args = impl, args
        self.child: ServingChild | None = None
        if args.smoke:
            self.steps = build_steps(args, impl, variants)
            self.kernels = kernel_summary()
            return
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", "--impl", impl]
        argv += [*forwarded_argv(args), "--dense-dtype", ",".join(variants)]
        self.child = ServingChild(argv, f"{impl} child")
        self.kernels: dict[str, Any] = json.loads(self.child.expect("@@ready"))

    def run(self, variant: str, iters: int) -> list[float]:
        if self.child is None:
            return measure(self.steps[variant], warmup=0, iters=iters).seconds
        self.child.send(f"run {variant} {iters}")
        return list(json.loads(self.child.expect("@@times")))

    def finish(self) -> float:
        if self.child is None:
            if self.args.profile:
                profile_steps(self.impl, self.args, self.steps)
            return peak_rss_gib()
        return self.child.quit()


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    argv = []
    for name in ("model", "pooling", "tables", "rows", "dim", "batch", "zipf", "threads"):
        argv += [f"--{name}", str(getattr(args, name))]
    for name in ("warmup", "seed", "embedding", "precision", "interaction", "num_batches", "lr"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv + (["--profile"] if args.profile else [])


def torchrec_available() -> bool:
    try:
        import torchrec.models.dlrm  # noqa: F401
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except Exception as e:  # an optional baseline: any import failure means "skip it"
        print(f"TorchRec not importable ({type(e).__name__}: {e}); measuring tetrarec only")
        return False
    return True


def run_all(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start every implementation, time them in alternating rounds, add ratios.

    Returns:
        The result rows, and the tetrarec child's kernel summary.
    """
    plan = []
    if args.impl in ("all", "tetrarec"):
        plan.append(("tetrarec", args.dense_dtype.split(",")))
    if args.impl in ("all", "torchrec") and torchrec_available():
        plan.append(("torchrec", ["fp32"]))
    children = [_Child(args, impl, variants) for impl, variants in plan]
    times: dict[tuple[str, str], list[float]] = {}
    per_round = max(1, args.iters // args.rounds)
    for _ in range(args.rounds):
        for child, (impl, variants) in zip(children, plan):
            for v in variants:
                times.setdefault((impl, v), []).extend(child.run(v, per_round))
    rss = {impl: child.finish() for child, (impl, _) in zip(children, plan)}
    kernels = {impl: child.kernels for child, (impl, _) in zip(children, plan)}
    results = []
    for (impl, variant), secs in times.items():
        t = Timing(secs)
        results.append(
            {
                "impl": impl,
                "model": args.model,
                "dense_dtype": variant,
                "bf16_matmul": bf16_matmul_used(variant),
                "embedding": args.embedding if impl == "tetrarec" else "torchrec-fused",
                # the tetrarec kernel path that ran ("fbgemm" for TorchRec's fused tables)
                "kernels": kernels[impl]["kernels"] if impl == "tetrarec" else "fbgemm",
                "pooling": args.pooling,
                "median_ms": t.median * 1e3,
                "p90_ms": t.p90 * 1e3,
                "min_ms": min(secs) * 1e3,
                "samples_per_s": args.batch / t.median,
                "peak_rss_gib": rss[impl],
            }
        )
    base = next((r for r in results if r["impl"] == "torchrec"), None)
    for r in results:
        if base is not None:
            r["vs_torchrec_fp32"] = r["samples_per_s"] / base["samples_per_s"]
    return results, kernels.get("tetrarec", {"kernels": "none"})


# -- BF16 accuracy ----------------------------------------------------------------------


def auc_check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train the FP32 and the BF16 dense paths from one seed on the same synthetic
    batches; compare their eval AUC (the target: within 0.001). One check per seed of
    ``--auc-seeds``; the BF16 variants are the non-FP32 entries of ``--dense-dtype``
    (default ``bf16``)."""
    torch.set_num_threads(args.threads)
    variants = [v for v in args.dense_dtype.split(",") if dense_variant(v)[0] != "fp32"]
    # The last run is a control: FP32 again, with the reference interaction (the same
    # math, other rounding). Its AUC gap to the first run is the noise floor of the check.
    runs = [("fp32", "fast")] + [(v, "fast") for v in variants or ["bf16"]]
    runs.append(("fp32", "reference"))
    results = []
    for seed in (int(s) for s in args.auc_seeds.split(",")):
        results += _auc_runs(argparse.Namespace(**{**vars(args), "seed": seed}), runs)
    cols = ["impl", "model", "seed", "dense_dtype", "bf16_matmul", "interaction", "steps"]
    print_table(results, [*cols, "auc", "log_loss", "auc_diff_vs_fp32"])
    for r in results:
        if r["dense_dtype"] != "fp32" or r["interaction"] == "reference":
            verdict = "PASS" if r["auc_diff_vs_fp32"] <= 0.001 else "FAIL"
            what = r["dense_dtype"] if r["dense_dtype"] != "fp32" else "FP32 control"
            print(
                f"seed {r['seed']}: {what} eval AUC {r['auc']:.5f} vs FP32 "
                f"{r['fp32_auc']:.5f}: differs by "
                f"{r['auc_diff_vs_fp32']:.5f}"
                + (f" (target <= 0.001): {verdict}" if r["dense_dtype"] != "fp32" else "")
            )
    return results


def _auc_runs(args: argparse.Namespace, runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Train each ``(dense variant, interaction)`` of ``runs`` from ``args.seed``."""
    from tetrarec.data.config import SyntheticConfig
    from tetrarec.data.synthetic import SyntheticDataset
    from tetrarec.embedding import TableConfig
    from tetrarec.train.metrics import compute_metrics

    tables = [
        TableConfig(name=f"t{i}", num_embeddings=args.rows, dim=args.dim)
        for i in range(args.tables)
    ]
    n_train = args.auc_steps * args.batch
    cfg = SyntheticConfig(
        num_samples=n_train,
        eval_samples=args.auc_eval,
        zipf=args.zipf,
        seed=args.seed,
        pooling=args.pooling,
        num_dense=NUM_DENSE,
    )
    train = SyntheticDataset(cfg, tables, num_samples=n_train)
    held_out = SyntheticDataset(cfg, tables, num_samples=args.auc_eval, row_offset=n_train)
    batches = [
        (b.dense, b.sparse, b.labels)
        for b in (
            train.read(np.arange(i * args.batch, (i + 1) * args.batch))
            for i in range(args.auc_steps)
        )
    ]
    eval_batch = held_out.read(np.arange(args.auc_eval))
    results = []
    for variant, interaction in runs:
        run_args = argparse.Namespace(**{**vars(args), "interaction": interaction})
        model, dense_opt, sparse_opt = build_tetrarec(run_args, variant)
        step = train_step(model, [dense_opt] + ([sparse_opt] if sparse_opt else []), batches)
        for _ in batches:
            step()
        with torch.no_grad():
            m = compute_metrics(model(eval_batch.dense, eval_batch.sparse), eval_batch.labels)
        results.append(
            {
                "impl": "tetrarec",
                "model": args.model,
                "seed": args.seed,
                "dense_dtype": variant,
                "bf16_matmul": bf16_matmul_used(variant),
                "interaction": interaction,
                "auc": m.auc,
                "log_loss": m.log_loss,
                "steps": args.auc_steps,
            }
        )
        del model, dense_opt, sparse_opt
    for r in results:
        r["fp32_auc"] = results[0]["auc"]
        r["auc_diff_vs_fp32"] = abs(r["auc"] - r["fp32_auc"])
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=["dlrm", "dcn"], default="dlrm")
    p.add_argument("--pooling", type=int, default=1, help="ids per bag")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument(
        "--precision", default="fp32", help="tetrarec table rows: fp32|fp16|bf16|int8|int4"
    )
    p.add_argument(
        "--dense-dtype",
        default="fp32",
        help="a list of fp32, bf16 (native BF16 products where the CPU has them, else "
        "emulated), bf16-native, bf16-emulated; e.g. fp32,bf16",
    )
    p.add_argument("--embedding", choices=["fused", "reference"], default="fused")
    p.add_argument("--interaction", choices=["fast", "reference"], default="fast")
    p.add_argument("--impl", choices=["all", "tetrarec", "torchrec"], default="all")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--num-batches", type=int, default=4, help="distinct batches, cycled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table")
    p.add_argument("--auc-check", action="store_true", help="FP32 vs BF16 eval AUC")
    p.add_argument("--auc-steps", type=int, default=300, help="training steps per run")
    p.add_argument("--auc-eval", type=int, default=100_000, help="held-out samples")
    p.add_argument("--auc-seeds", default="0", help="seeds of the AUC check, e.g. 0,1,2")
    p.add_argument("--lr", type=float, default=0.01, help="dense and sparse Adagrad lr")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps")
    p.add_argument("--json", type=json_path, default=None)
    p.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.tables, args.rows, args.dim, args.batch = 4, 1000, 8, 64
        args.iters, args.warmup, args.rounds, args.threads = 2, 1, 1, 1
        args.auc_steps, args.auc_eval = 5, 256
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.auc_check:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "serve")}
        results = auc_check(args)
        print(describe_run())
        write_json(args.json, config, results)
        return
    if args.serve:  # child: one implementation, timed on the parent's command
        serve(args)
        return
    results, kernels = run_all(args)
    print(describe_run(kernels))
    cols = ["impl", "model", "dense_dtype", "bf16_matmul", "embedding", "kernels", "pooling"]
    cols += ["median_ms"]
    cols += ["p90_ms"]
    cols += ["min_ms", "samples_per_s", "peak_rss_gib"]
    print_table(results, cols + (["vs_torchrec_fp32"] if "vs_torchrec_fp32" in results[0] else []))
    config = {k: v for k, v in vars(args).items() if k not in ("json", "serve")}
    write_json(args.json, config, results, kernels=kernels)


if __name__ == "__main__":
    main()
