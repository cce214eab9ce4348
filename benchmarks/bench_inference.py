"""Low-precision inference: model bytes, accuracy and batch-scoring speed per variant.

On (a) the real Criteo Kaggle sample (``examples/criteo_kaggle_sample.toml`` trained as
written in a temp dir; its best checkpoint exported) and (b) the cache issue's synthetic
benchmark data (``bench_cache.synthetic_config``: 26 tables x 20k rows x 64, 600k train
/ 200k eval rows, batch 2048), the FP32 model is exported and quantized as::

    fp32                 as exported
    int8-emb             every table INT8 (row-wise scale and bias)
    int8-emb+int8-mlp    and the dense layers INT8 (skipped, with the reason printed and
                         a row saying so, while "int8" is not in DENSE_FORMATS)
    int4-emb             every table INT4
    searched             tetrarec.inference.accuracy.search at --budget-ne (0.05% NE),
                         dense layers INT8 when that format exists; searched on the first
                         --search-rows evaluation rows, measured on all of them

Each variant's ``model_bytes`` (every tensor of the model file), AUC and NE on the
evaluation rows, ``samples_per_s`` of batch scoring at ``--batch`` rows per call (the
median over ``--rounds`` rounds; each round times every variant, starting with the next
one each round, on the same pre-read batches), ``latency_ms_p50``/``p99`` of one call,
and the ratios to fp32: ``bytes_ratio``, ``speedup``, ``ne_change_pct``, ``auc_change``.

    tetrarec bench inference [--json PATH] [--datasets criteo,synthetic] [--rounds 5]
    python benchmarks/bench_inference.py --smoke     # tiny synthetic sizes, well under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _harness import (
    describe_run,
    environment,
    json_path,
    kernel_summary,
    print_table,
    unwind_on_signals,
    write_json,
)
from bench_cache import CRITEO_DATA, CRITEO_RECIPE, ROOT, synthetic_config

from tetrarec.config import RunConfig
from tetrarec.inference import InferenceModel, load
from tetrarec.inference.accuracy import Reference, reference, search
from tetrarec.inference.dense import DENSE_FORMATS
from tetrarec.inference.export import export_checkpoint
from tetrarec.inference.prune import count_ids, training_dataset
from tetrarec.inference.quantize import QuantSpec, quantize_model, quantize_tables, tables_at
from tetrarec.inference.scoring import batches, model_dataset
from tetrarec.train import train
from tetrarec.types import Precision

VARIANTS = (
    "fp32",
    "int8-emb",
    "int8-emb+int8-mlp",
    "int8-emb+int8-mlp-dynamic",
    "int8-emb+int8-mlp+pruned",
    "int4-emb",
    "searched",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny synthetic sizes")
    p.add_argument("--json", type=json_path, metavar="PATH")
    p.add_argument("--datasets", default="criteo,synthetic", help="criteo, synthetic or both")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (variants alternate)")
    p.add_argument("--timed-batches", type=int, default=8, help="scoring calls per round")
    p.add_argument("--budget-ne", type=float, default=0.05, help="NE budget, %% (searched)")
    p.add_argument("--search-rows", type=int, default=50_000, help="rows the search scores")
    g = p.add_argument_group("synthetic data (bench_cache's trade-off sizes)")
    g.add_argument("--train-samples", type=int, default=600_000)
    g.add_argument("--eval-samples", type=int, default=200_000)
    g.add_argument("--tables", type=int, default=26)
    g.add_argument("--rows", type=int, default=20_000, help="rows per synthetic table")
    g.add_argument("--dim", type=int, default=64)
    g.add_argument("--batch", type=int, default=2048, help="training and scoring batch")
    args = p.parse_args(argv)
    if args.smoke:
        args.train_samples, args.eval_samples = 8192, 4096
        args.tables, args.rows, args.dim, args.batch = 4, 500, 16, 512
        args.rounds, args.timed_batches, args.search_rows = 2, 2, 2048
        args.datasets = "synthetic"
    args.dataset_list = [d.strip() for d in args.datasets.split(",") if d.strip()]
    unknown = set(args.dataset_list) - {"criteo", "synthetic"}
    if unknown:
        p.error(f"--datasets: unknown {sorted(unknown)}; valid: criteo, synthetic")
    return args


def _train_and_export(config: RunConfig, scratch: Path) -> InferenceModel:
    """Train ``config`` with its checkpoints in ``scratch``; the best (else last) exported."""
    config = config.with_overrides(
        [
            f"train.checkpoint_dir={str(scratch / 'ckpt')!r}",
            "train.progress=false",
            "train.json=none",
            "train.tensorboard_dir=none",
            "train.keep_checkpoints=1",
        ]
    )
    result = train(config)
    checkpoint = result.best_checkpoint or result.checkpoint
    if checkpoint is None:
        raise SystemExit("bench_inference: the training run wrote no checkpoint")
    export_checkpoint(checkpoint, scratch / "model")
    return load(scratch / "model")


def fp32_model(name: str, args: argparse.Namespace, scratch: Path) -> InferenceModel:
    """The dataset's trained FP32 model, exported and loaded."""
    if name == "synthetic":
        return _train_and_export(synthetic_config(args), scratch)
    if not (ROOT / CRITEO_DATA).is_file():
        raise SystemExit(f"bench_inference: {ROOT / CRITEO_DATA} is not there")
    here = Path.cwd()
    os.chdir(ROOT)  # the recipe's data path is relative to the repository root
    try:
        config = RunConfig.from_toml(CRITEO_RECIPE)
        config = config.with_overrides([f"train.threads={args.threads}"])
        return _train_and_export(config, scratch)
    finally:
        os.chdir(here)


def variants(
    model: InferenceModel, ref: Reference, args: argparse.Namespace
) -> tuple[dict[str, InferenceModel], dict[str, str], dict[str, Any]]:
    """``{variant: model}``, ``{variant: why skipped}`` and the search's summary."""
    # Each table at the precision, or where it would store the table larger (a first-order
    # term's dim-1 tables), at its smallest (FP16): tables_at.
    int8 = tables_at(model, Precision.INT8)
    out = {
        "fp32": model,
        "int8-emb": quantize_tables(model, int8),
        "int4-emb": quantize_tables(model, tables_at(model, Precision.INT4)),
    }
    skipped = {}
    has_int8_mlp = "int8" in DENSE_FORMATS
    # INT8 activations as `tetrarec quantize` does them by default: static, calibrated on
    # batches of training rows (a row's score then does not depend on its batch), and the
    # dynamic ones (per batch, no calibration data) beside them.
    calibration = list(itertools.islice(batches(training_dataset(model), batch_size=2048), 8))
    static = {"activations": "static"}
    if has_int8_mlp:
        spec = QuantSpec(tables=int8, mlp="int8", mlp_settings=static)
        out["int8-emb+int8-mlp"] = quantize_model(model, spec, calibration=calibration)
        dynamic = dataclasses.replace(spec, mlp_settings={"activations": "dynamic"})
        out["int8-emb+int8-mlp-dynamic"] = quantize_model(model, dynamic)
        # ... and the rows no training row touched pruned (they read as zeros).
        counts = count_ids(model, training_dataset(model))
        pruned = dataclasses.replace(spec, prune_min_count=1, prune_counts=counts)
        out["int8-emb+int8-mlp+pruned"] = quantize_model(model, pruned, calibration=calibration)
    else:
        for name in VARIANTS:
            if name.startswith("int8-emb+int8-mlp"):
                skipped[name] = (
                    f"no INT8 dense format in this tree (DENSE_FORMATS: {sorted(DENSE_FORMATS)})"
                )
    mlp = "int8" if has_int8_mlp else "fp32"
    settings = static if has_int8_mlp else {}
    quantize = functools.partial(quantize_model, calibration=calibration)
    found = search(ref, args.budget_ne, mlp=mlp, mlp_settings=settings, quantize=quantize)
    out["searched"] = found.model
    summary = {
        "budget_ne_pct": args.budget_ne,
        "search_rows": ref.num_rows,
        "mlp": mlp,
        "fits": found.fits,
        "search_ne_pct": found.deltas.ne_pct,
        "tables": {c.table: c.precision for c in found.choices},
        "steps": len(found.steps),
    }
    return out, skipped, summary


def time_variants(
    models: dict[str, InferenceModel], ref: Reference, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Batch-scoring samples/s (median over rounds) and per-call latency of each model."""
    batches = ref.rows[: args.timed_batches]
    samples = sum(b.labels.numel() for b in batches)
    names = list(models)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    calls: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up: kernels loaded, pages touched
        for b in batches[:2]:
            models[n].logits(b.dense, b.sparse)
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            total = 0.0
            for b in batches:
                t0 = time.perf_counter()
                models[n].logits(b.dense, b.sparse)
                dt = time.perf_counter() - t0
                calls[n].append(dt)
                total += dt
            per_round[n].append(samples / total)
    return {
        n: {
            "samples_per_s": statistics.median(per_round[n]),
            "latency_ms_p50": float(np.percentile(calls[n], 50) * 1e3),
            "latency_ms_p99": float(np.percentile(calls[n], 99) * 1e3),
            "rounds": args.rounds,
            "calls": len(calls[n]),
            "batch": int(batches[0].labels.numel()),
        }
        for n in names
    }


def run_dataset(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant on one dataset: one result row each (skipped ones say why)."""
    scratch = Path(tempfile.mkdtemp(prefix="tetrarec-bench-inference-"))
    try:
        model = fp32_model(name, args, scratch)
        if name == "criteo":
            os.chdir(ROOT)  # its data path is relative to the root (main changes back)
        dataset = model_dataset(model)
        ref = reference(model, dataset, batch_size=args.batch)
        search_ref = reference(model, dataset, eval_rows=args.search_rows, batch_size=args.batch)
        models, skipped, summary = variants(model, search_ref, args)
        print(f"  {name}: search {summary}", file=sys.stderr, flush=True)
        timing = time_variants(models, ref, args)
        rows = []
        fp32 = ref.measure(model)
        for v in VARIANTS:
            base = {"dataset": name, "variant": v, "impl": f"tetrarec-{v}"}
            if v in skipped:
                print(f"  {name} {v}: SKIPPED: {skipped[v]}", flush=True)
                rows.append({**base, "skipped": skipped[v], "kernels": kernel_summary()["kernels"]})
                continue
            m = models[v]
            d = ref.measure(m)
            row = {
                **base,
                "model_bytes": d.model_bytes,
                "auc": d.metrics.auc,
                "ne": d.metrics.ne,
                **timing[v],
                "bytes_ratio": d.model_bytes / fp32.model_bytes,
                "speedup": timing[v]["samples_per_s"] / timing["fp32"]["samples_per_s"],
                "ne_change_pct": d.ne_pct,
                "auc_change": d.auc,
                "calibration_change": d.calibration,
                "eval_rows": ref.num_rows,
                "tables": {t: p.value for t, p in m.table_precisions().items()},
                "dense": dict(m.manifest.dense),
                "backend": m.embeddings.backend,
                "kernels": kernel_summary()["kernels"],
            }
            if v == "searched":
                row["search"] = summary
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    here = Path.cwd()
    rows: list[dict[str, Any]] = []
    with unwind_on_signals("bench_inference"):
        try:
            for name in args.dataset_list:
                rows += run_dataset(name, args)
        finally:
            os.chdir(here)
    kernels = kernel_summary()
    print(describe_run(kernels))
    print_table(
        [r for r in rows if "skipped" not in r],
        ["dataset", "variant", "model_bytes", "bytes_ratio", "auc", "auc_change", "ne",
         "ne_change_pct", "samples_per_s", "speedup", "latency_ms_p50", "latency_ms_p99"],
        digits={"auc": 4, "ne": 4, "auc_change": 5, "ne_change_pct": 4, "bytes_ratio": 3},
    )  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(f"{r['dataset']} {r['variant']}: skipped: {r['skipped']}")
    config = {k: v for k, v in vars(args).items() if k != "dataset_list"}
    machine = {**environment(), "kernels": kernels}
    write_json(args.json, config, rows, kernels=kernels, machine=machine)


if __name__ == "__main__":
    main()
