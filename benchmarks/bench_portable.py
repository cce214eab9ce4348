"""The portable embedding step: the per-table loop against the batched path, alternated.

One training step (``pool_ids`` + ``update_ids``: forward, backward, fused Adagrad update)
of a ``FusedEmbeddingBagCollection`` on the CPU's portable paths: ``before`` is the
per-table loop (``kernels/reference.py``, ``TETRAREC_KERNELS=reference``: what the CPU
runs without the compiled kernels), ``after`` the batched path over all tables
(``kernels/reference_batched.py``, ``TETRAREC_KERNELS=batched``: what a GPU runs, with no
host syncs in the step; on a CPU its full-batch temporaries overflow the caches).
Rounds alternate the two on the same module and batch; each row reports the median step
and ``speedup`` (before / after, the median over rounds of the per-round ratio).

    python benchmarks/bench_portable.py [--threads 1] [--rows-w 100000] [--json out.json]

Shapes: W (26 tables x ``--rows-w`` rows x 64, batch 2048, pooling 20; the issue's W has
1M rows) and many small tables (200 x 10k x 16, batch 2048, pooling 1..5).
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

os.environ["TETRAREC_KERNELS"] = "reference"  # a portable path, before tetrarec loads

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import cpu_summary, json_path, print_table, write_json

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels.tbe import FusedEmbeddingBagCollection
from tetrarec.types import OptimizerKind


@dataclass(frozen=True)
class Shape:
    """One benchmarked shape: T tables of E rows and dim D, batch B, bag lengths L."""

    name: str
    tables: int
    rows: int
    dim: int
    batch: int
    pooling_min: int
    pooling_max: int


def shapes(args: argparse.Namespace) -> list[Shape]:
    """W and the 200-table shape (tiny ones with ``--smoke``)."""
    if args.smoke:
        return [Shape("W-smoke", 3, 100, 8, 16, 3, 3), Shape("many-smoke", 20, 50, 4, 16, 1, 5)]
    return [
        Shape("W", 26, args.rows_w, 64, 2048, 20, 20),
        Shape("200 tables", 200, 10_000, 16, 2048, 1, 5),
    ]


def batch_of(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-major ``(values, lengths)``: uniform ids, lengths uniform in the pooling range."""
    g = torch.Generator().manual_seed(seed)
    n_bags = shape.tables * shape.batch
    lengths = torch.randint(shape.pooling_min, shape.pooling_max + 1, (n_bags,), generator=g)
    values = torch.randint(0, shape.rows, (int(lengths.sum()),), generator=g)
    return values, lengths


#: Each timed implementation and the ``TETRAREC_KERNELS`` mode that runs it on the CPU.
IMPLS = {"before (per-table loop)": "reference", "after (batched)": "batched"}


def use(mode: str) -> None:
    """Run the ops' CPU kernels on the portable path of ``mode`` (read at each call)."""
    os.environ["TETRAREC_KERNELS"] = mode


def time_step(
    ebc: FusedEmbeddingBagCollection, values: torch.Tensor, lengths: torch.Tensor
) -> float:
    t0 = time.perf_counter()
    out = ebc.pool_ids(values, lengths, None)
    ebc.update_ids(out, values, lengths, None)
    return time.perf_counter() - t0


def measure(shape: Shape, rounds: int) -> list[dict[str, Any]]:
    tables = [
        TableConfig(name=f"t{i}", num_embeddings=shape.rows, dim=shape.dim)
        for i in range(shape.tables)
    ]
    spec = SparseOptimizerSpec(kind=OptimizerKind.ADAGRAD, lr=0.01)
    ebc = FusedEmbeddingBagCollection(tables, spec, seed=0)
    values, lengths = batch_of(shape)
    times: dict[str, list[float]] = {k: [] for k in IMPLS}
    for mode in IMPLS.values():  # warm-up
        use(mode)
        time_step(ebc, values, lengths)
    for r in range(rounds):
        order = list(IMPLS) if r % 2 == 0 else list(reversed(IMPLS))
        for name in order:
            use(IMPLS[name])
            times[name].append(time_step(ebc, values, lengths))
    ratios = [b / a for b, a in zip(*times.values())]
    rows = []
    for name, ts in times.items():
        rows.append({
            "impl": name, "kernels": "portable", "mode": IMPLS[name], "shape": shape.name,
            **asdict(shape),
            "ids": values.numel(), "step_ms": 1e3 * statistics.median(ts),
            "rounds_ms": [1e3 * t for t in ts],
        })  # fmt: skip
    rows[-1]["speedup"] = statistics.median(ratios)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows-w", type=int, default=100_000, help="rows per table of W")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the test suite's run)")
    p.add_argument("--json", type=json_path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [row for s in shapes(args) for row in measure(s, args.rounds)]
    cpu = cpu_summary()
    where = "kernels: portable (before: TETRAREC_KERNELS=reference, after: =batched)"
    print(f"CPU: {cpu['model']}; threads {args.threads}; {where}")
    cols = ["shape", "impl", "tables", "rows", "dim", "batch", "ids", "step_ms", "speedup"]
    print_table(results, cols)
    write_json(args.json, vars(args), results, kernels={"ran": "portable"})


if __name__ == "__main__":
    main()
