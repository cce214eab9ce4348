"""Inference kernels: the dense formats' MLPs and the two lookup paths of quantized tables.

Two measurements, each in alternated rounds (every variant once per round, in turn) so
that the machine's drift hits them all alike; the figure is the median over rounds of
each variant's median time, and its ratio to the baseline of the same round:

- **dense**: one MLP at batch ``--batch``: FP32 (``F.linear``, the trained model's own
  module) against the INT8 MLP with dynamic and with static activations
  (``QuantInt8MLP``, FBGEMM) and the BF16 MLP (``QuantBF16MLP``, native BF16 where the
  CPU has BF16 units, else emulated). Shapes: the Criteo examples' bottom 13-512-256-64
  and top 415-512-256-1 (F = 26: 26*27/2 + 64 inputs), and sharded_mixed.toml's bottom
  13-64-16 and top 52-64-32-1 (F = 8). Ratio: time / FP32's.
- **tables**: ``InferenceEmbeddingBags`` at batch ``--batch`` with every table in one
  precision (FP32, FP16, INT8, INT4), lookup backend ``tetrarec`` (the compiled
  ``tbe_forward``) against ``torch`` (PyTorch's ``quantized::embedding_bag_*_rowwise``
  for INT8/INT4; its float tables run tetrarec's kernel too, as the row's ``path`` says).
  Shapes: 26 tables x 20k rows x dim 64, pooling 20 (the synthetic cache benchmark's),
  and 26 tables x 100k rows x dim 16, pooling 1 (Criteo-like). Ratio: time / tetrarec's.

- **interaction**: the dot interaction at batch ``--batch``, one call on ``(B, D)`` and
  ``(B, F*D)``: ``tetrarec::dot_interaction`` (FP32, the training kernel) against
  ``tetrarec::dot_interaction_bf16`` (BF16 products, FP32 sums: the lower dense
  formats'). Shapes: F = 26 features (27 rows with the bottom output) at D = 64 (the
  synthetic model) and D = 16 (the Criteo sample model). Ratio: time / FP32's; the
  error column is the largest difference from FP32 over the largest FP32 output.

Prints the CPU (its AVX2 / AVX-512 / VNNI / AMX flags), torch's quantized engine and
which path ran; ``--json`` writes every row.

    python benchmarks/bench_inference_kernels.py [--smoke] [--json out.json]
        [--only dense|tables|interaction] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import (
    describe_run,
    json_path,
    kernel_summary,
    measure,
    print_table,
    unwind_on_signals,
    write_json,
)

from tetrarec.embedding import TableConfig
from tetrarec.inference.embeddings import InferenceEmbeddingBags
from tetrarec.inference.quantize import convert_rows
from tetrarec.inference.quantized_mlp import (
    ActivationRanges,
    MLPWeights,
    QuantBF16MLP,
    QuantInt8MLP,
    quantize_weights,
)
from tetrarec.kernels import ops
from tetrarec.models import MLP
from tetrarec.models.precision import has_native_bf16
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

# (name, in, sizes, final_activation, fp32_last_layer)
MLP_SHAPES = [
    ("criteo bottom", 13, (512, 256, 64), True, False),
    ("criteo top", 26 * 27 // 2 + 64, (512, 256, 1), False, True),
    ("sharded_mixed bottom", 13, (64, 16), True, False),
    ("sharded_mixed top", 8 * 9 // 2 + 16, (64, 32, 1), False, True),
]
SMOKE_MLP_SHAPES = [("tiny top", 20, (16, 8, 1), False, True)]
# (name, tables, rows, dim, pooling)
TABLE_SHAPES = [
    ("synthetic 26x20k d64 L20", 26, 20_000, 64, 20),
    ("criteo 26x100k d16 L1", 26, 100_000, 16, 1),
]
SMOKE_TABLE_SHAPES = [("tiny 3x100 d8 L2", 3, 100, 8, 2)]
TABLE_PRECISIONS = (Precision.FP32, Precision.FP16, Precision.INT8, Precision.INT4)


def _rounds(
    variants: dict[str, Callable[[], Any]], *, rounds: int, iters: int
) -> dict[str, list[float]]:
    """Each variant's median seconds per round, the variants alternated within a round."""
    out: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            out[name].append(measure(fn, warmup=2, iters=iters).median)
    return out


def _summarize(times: dict[str, list[float]], baseline: str) -> dict[str, tuple[float, float]]:
    """``{variant: (median ms, median over rounds of time / baseline's)}``."""
    base = times[baseline]
    return {
        k: (statistics.median(v) * 1e3, statistics.median(t / b for t, b in zip(v, base)))
        for k, v in times.items()
    }


def dense_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The dense measurement (see the module docstring)."""
    shapes = SMOKE_MLP_SHAPES if args.smoke else MLP_SHAPES
    gen = torch.Generator().manual_seed(0)
    native = has_native_bf16("cpu")
    rows = []
    for name, fan_in, sizes, final_activation, fp32_last in shapes:
        mlp = MLP(fan_in, sizes, final_activation=final_activation, fp32_last_layer=fp32_last)
        mlp.eval().requires_grad_(False)
        weights = MLPWeights(
            weights=tuple(layer.weight.detach() for layer in mlp.linears),
            biases=tuple(layer.bias.detach() for layer in mlp.linears),
            final_activation=final_activation,
            fp32_last_layer=fp32_last,
        )
        x = torch.randn(args.batch, fan_in, generator=gen).relu_()
        ranges = ActivationRanges(weights)
        ranges.observe(x)
        int8 = quantize_weights(weights)
        variants: dict[str, torch.nn.Module] = {
            "fp32": mlp,
            "int8 dynamic": QuantInt8MLP(int8, activations="dynamic"),
            "int8 static": QuantInt8MLP(int8, activations="static", qparams=ranges.qparams()),
            "bf16": QuantBF16MLP(weights),
        }
        with torch.inference_mode():
            ref = mlp(x)
            err = {k: float((m(x) - ref).abs().max()) for k, m in variants.items()}
            times = _rounds(
                {k: (lambda m=m, x=x: m(x)) for k, m in variants.items()},
                rounds=args.rounds,
                iters=args.iters,
            )
        for impl, (ms, ratio) in _summarize(times, "fp32").items():
            path = {"fp32": "torch F.linear", "bf16": "native bf16" if native else "emulated bf16"}
            rows.append(
                {
                    "kind": "dense",
                    "shape": f"{name} {fan_in}-{'-'.join(map(str, sizes))}",
                    "batch": args.batch,
                    "impl": impl,
                    "path": path.get(impl, f"quantized ({torch.backends.quantized.engine})"),
                    "kernels": "fbgemm" if impl.startswith("int8") else "torch",
                    "ms": ms,
                    "ratio_to_fp32": ratio,
                    "max_abs_err": err[impl],
                }
            )
    return rows


# (name, F, D)
INTERACTION_SHAPES = [("synthetic F26 d64", 26, 64), ("criteo F26 d16", 26, 16)]
SMOKE_INTERACTION_SHAPES = [("tiny F3 d8", 3, 8)]


def interaction_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The interaction measurement (see the module docstring)."""
    shapes = SMOKE_INTERACTION_SHAPES if args.smoke else INTERACTION_SHAPES
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, features, dim in shapes:
        x = torch.randn(args.batch, dim, generator=gen)
        e = torch.randn(args.batch, features * dim, generator=gen)
        variants = {
            "fp32": lambda x=x, e=e: ops.dot_interaction(x, e),
            "bf16": lambda x=x, e=e: ops.dot_interaction_bf16(x, e),
        }
        with torch.inference_mode():
            ref = variants["fp32"]()
            err = {k: float((f() - ref).abs().max() / ref.abs().max()) for k, f in variants.items()}
            times = _rounds(variants, rounds=args.rounds, iters=args.iters)
        for impl, (ms, ratio) in _summarize(times, "fp32").items():
            rows.append(
                {
                    "kind": "interaction",
                    "shape": name,
                    "batch": args.batch,
                    "impl": impl,
                    "ms": ms,
                    "ratio_to_fp32": ratio,
                    "rel_err": err[impl],
                }
            )
    return rows


def _features(
    tables: list[TableConfig], batch: int, pooling: int, gen: torch.Generator
) -> SparseFeatures:
    lengths = torch.full((len(tables) * batch,), pooling, dtype=torch.int32)
    values = torch.cat(
        [torch.randint(t.num_embeddings, (batch * pooling,), generator=gen) for t in tables]
    )
    return SparseFeatures(
        keys=tuple(t.name for t in tables), values=values, lengths=lengths, batch_size=batch
    )


def table_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The tables measurement (see the module docstring)."""
    shapes = SMOKE_TABLE_SHAPES if args.smoke else TABLE_SHAPES
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, num_tables, num_rows, dim, pooling in shapes:
        fp32 = torch.randn(num_rows, dim, generator=gen)  # one table's rows, shared by all
        for precision in TABLE_PRECISIONS:
            tables = [
                TableConfig(name=f"t{i}", num_embeddings=num_rows, dim=dim, precision=precision)
                for i in range(num_tables)
            ]
            stored = convert_rows(fp32, Precision.FP32, precision, dim)
            sf = _features(tables, args.batch, pooling, gen)
            modules = {
                b: InferenceEmbeddingBags(tables, {t.name: stored for t in tables}, backend=b)
                for b in ("tetrarec", "torch")
            }
            with torch.inference_mode():
                ref = modules["tetrarec"](sf).values
                err = {b: float((m(sf).values - ref).abs().max()) for b, m in modules.items()}
                times = _rounds(
                    {b: (lambda m=m, sf=sf: m(sf)) for b, m in modules.items()},
                    rounds=args.rounds,
                    iters=args.iters,
                )
            for backend, (ms, ratio) in _summarize(times, "tetrarec").items():
                path = modules[backend].lookup_paths[precision]
                rows.append(
                    {
                        "kind": "tables",
                        "shape": name,
                        "precision": precision.value,
                        "batch": args.batch,
                        "impl": backend,
                        "path": path,
                        "kernels": "fbgemm",
                        "ms": ms,
                        "ratio_to_tetrarec": ratio,
                        "max_abs_diff": err[backend],
                    }
                )
    kernels = kernel_summary()["kernels"]  # the path that ran (known once a kernel has)
    for row in rows:
        if row["path"] == "tetrarec":
            row["kernels"] = kernels
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run both measurements; print the tables and the CPU; write ``--json``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    p.add_argument("--json", type=json_path, default=None, help="write every row here")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    p.add_argument("--iters", type=int, default=10, help="timed calls per variant and round")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument(
        "--only",
        choices=("dense", "tables", "interaction"),
        default=None,
        help="run one measurement only",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.rounds, args.iters = 64, 1, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def wanted(kind: str) -> bool:
        return args.only in (None, kind)

    with unwind_on_signals("bench_inference_kernels"):
        dense = dense_rows(args) if wanted("dense") else []
        tables = table_rows(args) if wanted("tables") else []
        interaction = interaction_rows(args) if wanted("interaction") else []
    print(describe_run())
    engine = torch.backends.quantized.engine
    print(f"torch {torch.__version__}, quantized engine: {engine}, ", end="")
    print(f"threads: {torch.get_num_threads()}, batch {args.batch}, {args.rounds} rounds")
    for rows, columns in (
        (dense, ["shape", "impl", "path", "ms", "ratio_to_fp32", "max_abs_err"]),
        (tables, ["shape", "precision", "impl", "path", "ms", "ratio_to_tetrarec"]),
        (interaction, ["shape", "impl", "ms", "ratio_to_fp32", "rel_err"]),
    ):
        if rows:  # --only leaves the others empty
            print()
            print_table(rows, columns)
    config = {"batch": args.batch, "rounds": args.rounds, "iters": args.iters}
    config["quantized_engine"] = torch.backends.quantized.engine
    write_json(args.json, config, dense + tables + interaction)


if __name__ == "__main__":
    main()
