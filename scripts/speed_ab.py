"""Before and after: the same benchmarks from two checkouts, alternated in one run.

    git worktree add /tmp/before <commit>
    .venv/bin/python scripts/speed_ab.py --before /tmp/before --after . --rounds 3

Each round runs, from each tree in turn (before, after, before, ...), the one-process
DLRM training step (``benchmarks/bench_dlrm.py --impl tetrarec``) and the table-wise
sharded step at 2 ranks (``benchmarks/bench_sharding.py --types table_wise
--world-sizes 2``), each in its own processes, with this Python. Both trees import their
own ``tetrarec`` (the benchmark runs with the tree as its working directory). Machines
are noisy: a ratio (after / before) per round, and the median of the rounds, is the
figure; one round's ratio says little. Nothing else should run on the machine meanwhile.

Prints a table and writes ``--json``: every round's samples/s per tree and benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCHES = {
    "dlrm one process": [
        "benchmarks/bench_dlrm.py", "--impl", "tetrarec", "--iters", "15", "--warmup", "3",
    ],
    "sharding table_wise 2 ranks": [
        "benchmarks/bench_sharding.py", "--types", "table_wise", "--world-sizes", "2",
        "--torchrec", "no", "--steps", "8", "--rounds", "3",
    ],
}  # fmt: skip


def _run(tree: Path, argv: list[str], extra: list[str], env_seen: dict[str, Any]) -> float:
    """samples/s of the benchmark's tetrarec result (the sharded one at world size > 1).

    ``env_seen`` gets the benchmark's environment (CPU, kernel path) of each tree.
    """
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, *argv, *extra, "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    written = json.loads(out.read_text())
    out.unlink()
    env_seen.setdefault(str(tree), written.get("env", {}))
    results = written["results"]
    ours = [r for r in results if r.get("impl", "tetrarec") == "tetrarec"]
    sharded = [r for r in ours if r.get("world_size", 1) > 1]
    return float((sharded or ours)[0]["samples_per_s"])


def main(argv: list[str] | None = None) -> int:
    """Run the rounds; print and write the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the baseline checkout")
    p.add_argument("--after", default=".", help="the changed checkout (default: here)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", help="one benchmark name (default: both)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more bench flags")
    p.add_argument("--json", help="write the rounds here")
    args = p.parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    names = [args.only] if args.only else list(BENCHES)
    rounds: list[dict[str, Any]] = []
    env_seen: dict[str, Any] = {}
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r}
        for name in names:
            for label, tree in trees.items():
                row[f"{name}/{label}"] = _run(tree, BENCHES[name], args.extra, env_seen)
            ratio = row[f"{name}/after"] / row[f"{name}/before"]
            row[f"{name}/ratio"] = ratio
            print(
                f"round {r}  {name:<28} before {row[f'{name}/before']:>10,.0f}  after "
                f"{row[f'{name}/after']:>10,.0f} samples/s  after/before {ratio:.3f}",
                flush=True,
            )
        rounds.append(row)
    print()
    for tree, env in env_seen.items():
        print(f"{tree}: CPU {env.get('cpu')}; kernels {env.get('kernels')}")
    for name in names:
        ratios = [row[f"{name}/ratio"] for row in rounds]
        print(
            f"{name:<28} median after/before {statistics.median(ratios):.3f} "
            f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})"
        )
    if args.json:
        trees_json = {k: str(v) for k, v in trees.items()}
        out = {"trees": trees_json, "env": env_seen, "rounds": rounds}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
