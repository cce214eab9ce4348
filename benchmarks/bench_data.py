"""Data throughput against the demo model's training throughput, in one run.

Measures, in rows per second:

- ``criteo-parse`` / ``criteo-parse-gz``: raw Criteo TSV parsing (plain and gzip) of a
  file of ``--rows`` rows made by repeating the real Kaggle sample's lines (``--sample``;
  where that file is missing, synthetic Criteo-shaped lines instead: the output and the
  JSON's ``config.criteo_sample`` say which);
- ``preprocess``: ``preprocess_criteo`` of the plain file (parse + write .npy);
- ``binary-loader``: the preprocessed format through ``BatchLoader`` (batch 2048,
  shuffle on, prefetch 2), i.e. what training reads;
- ``synthetic-loader``: the demo's synthetic source through the same loader;

and reports each as a ratio to the training samples/s of the demo DLRM (one training
step: forward, loss, backward, optimizer steps, on pre-built batches), measured in the
same process (or given with ``--train-samples-per-s`` when the trainer is not
importable). The loader must not be the bottleneck: ratio >= 5.

    .venv/bin/python benchmarks/bench_data.py --rows 500000 --json out.json
"""

from __future__ import annotations

import argparse
import gzip
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # run from a checkout without installing
from _harness import (  # noqa: E402
    describe_run,
    json_path,
    kernel_summary,
    measure,
    print_table,
    unwind_on_signals,
    write_json,
)

from tetrarec.data import (  # noqa: E402
    BatchLoader,
    ColumnsDataset,
    DenseKind,
    DenseSpec,
    DenseTransform,
    SyntheticConfig,
    SyntheticDataset,
    TransformedDataset,
    iter_criteo_blocks,
    open_binary,
    preprocess_criteo,
)
from tetrarec.embedding import TableConfig  # noqa: E402

SAMPLE = (
    _HERE.parent.parent / "shared/data/criteo-kaggle-dac-sample/criteo_kaggle_dac_sample.tsv.gz"
)


def sample_lines(sample: Path) -> tuple[list[bytes], str]:
    """The real sample's lines, or synthetic Criteo lines where it is absent.

    Returns:
        The lines, and ``"real"`` or ``"synthetic"``: which they are.
    """
    if sample.exists():
        return gzip.decompress(sample.read_bytes()).splitlines(keepends=True), "real"
    rng = np.random.default_rng(0)
    out = []
    for _ in range(10_000):
        dense = [str(int(x)) if x >= 0 else "" for x in rng.integers(-2, 500, 13)]
        cats = [f"{int(x):08x}" for x in rng.integers(0, 2**32, 26)]
        out.append(("\t".join([str(int(rng.random() < 0.25)), *dense, *cats]) + "\n").encode())
    return out, "synthetic"


def make_files(tmp: Path, rows: int, lines: list[bytes]) -> tuple[Path, Path]:
    reps, rest = divmod(rows, len(lines))
    data = b"".join(lines) * reps + b"".join(lines[:rest])
    plain, gz = tmp / "criteo.tsv", tmp / "criteo.tsv.gz"
    plain.write_bytes(data)
    gz.write_bytes(gzip.compress(data, compresslevel=6))
    return plain, gz


def rows_per_s(fn: Callable[[], int], repeats: int) -> float:
    """Best-of-``repeats`` rows/s of ``fn`` (which returns the rows it handled)."""
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = fn()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def parse_all(path: Path) -> int:
    return sum(b.rows for b in iter_criteo_blocks(path))


def loader_rows(dataset: Any, batches: int, batch: int) -> Callable[[], int]:
    def run() -> int:
        loader = BatchLoader(dataset, batch_size=batch, shuffle=True, seed=0, prefetch=2)
        n = 0
        for i, b in enumerate(loader):
            n += b.batch_size
            if i + 1 == batches:
                break
        loader.close()
        return n

    return run


def demo_train_samples_per_s(steps: int) -> tuple[float, str]:
    """Training samples/s of the demo DLRM on pre-built synthetic batches."""
    from tetrarec.config.tables import build_tables
    from tetrarec.train.build import build_parts
    from tetrarec.train.demo import demo_config

    cfg = demo_config()
    parts = build_parts(cfg, num_dense=13)
    ds = SyntheticDataset(cfg.data.synthetic, build_tables(cfg.model), num_samples=10**6)
    bs = cfg.data.batch_size
    batches = [ds.read(np.arange(i * bs, (i + 1) * bs)) for i in range(4)]
    step = [0]

    def train_step() -> None:
        b = batches[step[0] % len(batches)]
        step[0] += 1
        logits = parts.model(b.dense, b.sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
        parts.backward_and_step(loss)

    timing = measure(train_step, warmup=3, iters=steps)
    return bs / timing.median, f"demo DLRM ({cfg.model.embedding.value} embeddings, batch {bs})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000, help="rows of the raw test file")
    ap.add_argument("--batch", type=int, default=2048, help="loader global batch")
    ap.add_argument(
        "--train-samples-per-s",
        type=float,
        default=None,
        help="use this training rate instead of measuring the demo model",
    )
    ap.add_argument(
        "--sample", type=Path, default=SAMPLE, help="the raw Criteo sample whose lines are repeated"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (for the smoke test)")
    ap.add_argument("--json", type=json_path, default=None, help="write results here")
    args = ap.parse_args(argv)
    rows = 5_000 if args.smoke else args.rows
    repeats = 1 if args.smoke else 2
    with tempfile.TemporaryDirectory(prefix="bench-data-") as d:
        tmp = Path(d)
        lines, source = sample_lines(args.sample)
        if source == "synthetic":
            print(
                f"WARNING: {args.sample} not found: parsing synthetic Criteo-shaped lines, "
                "not the real sample",
                file=sys.stderr,
            )
        plain, gz = make_files(tmp, rows, lines)
        results = [
            {"impl": "criteo-parse", "rows_per_s": rows_per_s(lambda: parse_all(plain), repeats)},
            {"impl": "criteo-parse-gz", "rows_per_s": rows_per_s(lambda: parse_all(gz), repeats)},
        ]
        t0 = time.perf_counter()
        preprocess_criteo([plain], tmp / "bin", progress=False)
        results.append({"impl": "preprocess", "rows_per_s": rows / (time.perf_counter() - t0)})
        tables = [TableConfig(name=f"C{i}", num_embeddings=20_000, dim=16) for i in range(1, 27)]
        cols = open_binary(tmp / "bin")
        # What training reads: the raw columns plus Criteo's default log1p at read time.
        log1p = DenseSpec(
            columns=tuple(f"I{i}" for i in range(1, 14)), kinds=(DenseKind.LOG1P,) * 13
        )
        binary = TransformedDataset(
            ColumnsDataset(labels=cols.labels, dense=cols.dense, sparse=cols.sparse, tables=tables),
            DenseTransform.without_statistics(log1p),
        )
        batches = max(1, min(rows // args.batch, 200))
        results.append(
            {
                "impl": "binary-loader",
                "rows_per_s": rows_per_s(loader_rows(binary, batches, args.batch), repeats),
            }
        )
        synthetic = SyntheticDataset(SyntheticConfig(), tables, num_samples=max(rows, args.batch))
        batches = 2 if args.smoke else 50
        results.append(
            {
                "impl": "synthetic-loader",
                "rows_per_s": rows_per_s(loader_rows(synthetic, batches, args.batch), 1),
            }
        )
        del cols, binary
    if args.train_samples_per_s is not None:
        train_rate, baseline = args.train_samples_per_s, "--train-samples-per-s"
    else:
        train_rate, baseline = demo_train_samples_per_s(3 if args.smoke else 20)
    for r in results:
        r["ratio_to_train"] = r["rows_per_s"] / train_rate
    results.append(
        {
            "impl": "train (baseline)",
            "rows_per_s": train_rate,
            "ratio_to_train": 1.0,
            "baseline": baseline,
            "kernels": kernel_summary()["kernels"],
        }
    )
    what = f"the real sample {args.sample}" if source == "real" else "SYNTHETIC lines"
    print(f"raw file: {rows} rows repeating {what}; loader batch {args.batch}")
    print(f"baseline: {baseline}; {describe_run()}")
    print_table(results, ["impl", "rows_per_s", "ratio_to_train"])
    config = {
        "rows": rows,
        "batch": args.batch,
        "smoke": args.smoke,
        "baseline": baseline,
        "criteo_sample": source,
        "criteo_sample_path": str(args.sample),
    }
    write_json(args.json, config, results)


if __name__ == "__main__":
    with unwind_on_signals("bench_data"):  # SIGTERM deletes the scratch too
        main()
