"""Every benchmark script runs end to end at tiny size (``--smoke``), so none rots.

Timings are never asserted; the JSON layout is, and that each report says what ran: the
CPU, the kernel path (a portable run is never labelled as the compiled kernel), the
optimizer of each implementation and which data was parsed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tetrarec.kernels._build import compiled_cpu_kernels

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))
# Runs on the real samples in ../shared/data; its smoke run (through the CLI) lives in
# tests/integration/test_integration_train.py, which skips when the data is absent.
NEEDS_SHARED_DATA = {"bench_quality.py"}
# Plan on paper: no kernel runs, and the report says so ("none").
NO_KERNELS = {"bench_planner.py", "bench_tiers.py"}  # tiers: stores, no kernel
# Times the portable paths on purpose (the per-table loop against the batched path),
# whatever is compiled.
PORTABLE_ONLY = {"bench_portable.py"}


def _run(script: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``script --smoke --json`` with ``args``; returns (payload, stdout, stderr)."""
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, proc.stderr


def _bench_module(name: str) -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def _point(row: dict[str, Any]) -> tuple[int, ...]:
    return (row["tables"], row["rows"], row["dim"], row["batch"], row["pooling"])


def test_every_benchmark_is_listed_in_readme() -> None:
    readme = (BENCH / "README.md").read_text()
    missing = [s for s in SCRIPTS if s not in readme]
    assert not missing, f"benchmarks/README.md does not list {missing}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - NEEDS_SHARED_DATA))
def test_benchmark_smoke(script: str, tmp_path: Path) -> None:
    """Fails if a script breaks, or its report forgets the CPU or the kernel path."""
    payload, stdout, _ = _run(script, tmp_path)
    assert payload["results"], payload
    for row in payload["results"]:
        assert "impl" in row
    cpu = payload["env"]["cpu"]
    assert cpu["model"]
    assert isinstance(cpu["flags"], list)
    assert cpu["model"] in stdout  # the printed report names the CPU too
    expected = "compiled" if compiled_cpu_kernels() is not None else "portable"
    if script in NO_KERNELS:
        expected = "none"
    if script in PORTABLE_ONLY:
        expected = "portable"
    paths = ("compiled", "portable", "none")  # tetrarec's; FBGEMM's rows say "fbgemm"
    ran = [r["kernels"] for r in payload["results"] if r.get("kernels") in paths]
    assert ran, "no row says which tetrarec kernel path ran"
    assert set(ran) == {expected}, ran
    if script in PORTABLE_ONLY:  # before: the per-table loop, after: what a GPU runs
        modes = {r["impl"].split()[0]: r["mode"] for r in payload["results"]}
        assert modes == {"before": "reference", "after": "batched"}, modes
    if script == "bench_data.py":
        sample = _bench_module("bench_data").SAMPLE
        assert payload["config"]["criteo_sample"] == ("real" if sample.exists() else "synthetic")


@pytest.mark.timeout(300)
def test_embedding_bench_labels_the_portable_path_and_names_optimizers(tmp_path: Path) -> None:
    """Fails if a portable run is labelled as the compiled kernel, if an implementation
    does not run the optimizer asked for (or the torch baseline does not name its own),
    or if the sweep's breakdown (forward alone, gather floor) is missing."""
    payload, stdout, _ = _run(
        "bench_embedding.py",
        tmp_path,
        "--sweep",
        "--workers",
        "process",  # the worker protocol too (the plain smoke run keeps them in-process)
        "--optimizer",
        "adagrad",
        "--impls",
        "tetrarec,torch,fbgemm",
        env={"TETRAREC_KERNELS": "reference"},
    )
    rows = payload["results"]
    ours = [r for r in rows if r["base_impl"].startswith("tetrarec-")]
    assert ours
    assert all(r["kernels"] == "portable" and "-portable" in r["impl"] for r in ours)
    assert "NOT the compiled kernel" in stdout
    optimizers = {r["base_impl"]: r["optimizer"] for r in rows}
    assert optimizers["tetrarec-fp32"] == "adagrad"
    assert optimizers["torch-embeddingbag"] == "Adagrad"
    if "fbgemm-cpu" in optimizers:  # an optional peer
        assert optimizers["fbgemm-cpu"] == "EXACT_ADAGRAD"
        assert all("vs_fbgemm" in r for r in ours if r["variant"] == "step")
    assert {r["variant"] for r in ours if r["base_impl"] == "tetrarec-fp32"} == {
        "step",
        "forward",
        "gather",
    }
    points = {_point(r) for r in rows}
    assert len(points) == len(payload["config"]["points"]) == 2
    rounds = payload["config"]["rounds"]
    for r in rows:  # one median per round, timed in the same group
        assert len(r["round_ms"]) == len(r["round_started_s"]) == rounds
        assert r["base_impl"] in r["group"]
    for point in points:  # interleaved: every run of round k starts before any of k + 1
        starts = [r["round_started_s"] for r in rows if _point(r) == point]
        for k in range(rounds - 1):
            assert max(s[k] for s in starts) < min(s[k + 1] for s in starts), starts


def test_embedding_sweep_fits_in_8_gib() -> None:
    """Fails if a sweep point cannot hold tetrarec's and FBGEMM's tables together in
    8 GiB (the sweep would then not interleave them, or run out of memory)."""
    bench = _bench_module("bench_embedding")
    args = bench.parse_args(["--sweep"])
    for point in bench.sweep_points():
        gib = sum(
            bench.estimate_gib(i, point, args.optimizer) for i in ("fbgemm-cpu", "tetrarec-fp32")
        )
        assert gib <= args.max_gib == 8.0, (point, gib)
        assert bench.plan_groups(["fbgemm-cpu", "tetrarec-fp32"], point, args) == [
            ["fbgemm-cpu", "tetrarec-fp32"]
        ]


def test_embedding_groups_keep_the_anchor_beside_each_implementation() -> None:
    """Fails if implementations that do not fit together are timed without the
    baseline they are compared with."""
    bench = _bench_module("bench_embedding")
    args = bench.parse_args(["--max-gib", "14"])
    w = bench.Point(26, 1_000_000, 64, 2048, 20)
    impls = ["fbgemm-cpu", "torch-embeddingbag", "tetrarec-fp32", "tetrarec-fp16", "tetrarec-int8"]
    groups = bench.plan_groups(impls, w, args)
    assert sorted(i for g in groups for i in g if i != "fbgemm-cpu") == sorted(impls[1:])
    for g in groups:
        fits = sum(bench.estimate_gib(i, w, args.optimizer) for i in g) <= 14
        assert fits or len(g) == 1, g
        assert g[0] == "fbgemm-cpu" or len(g) == 1, g


@pytest.mark.timeout(300)
def test_data_bench_says_when_the_criteo_sample_was_missing(tmp_path: Path) -> None:
    """Fails if synthetic lines are parsed and reported as the real Criteo sample."""
    missing = tmp_path / "no-such-sample.tsv.gz"
    payload, stdout, stderr = _run("bench_data.py", tmp_path, "--sample", str(missing))
    assert payload["config"]["criteo_sample"] == "synthetic"
    assert payload["config"]["criteo_sample_path"] == str(missing)
    assert "SYNTHETIC" in stdout
    assert "not found" in stderr


@pytest.mark.timeout(300)
def test_sharding_bench_profiles_each_rank_and_counts_bytes_per_timed_step(tmp_path: Path) -> None:
    """Fails if ``--profile`` writes no per-rank table, or if the profiled steps are
    counted in the bytes per step (they run after the timed rounds)."""
    prof = tmp_path / "prof"
    payload, _, _ = _run(
        "bench_sharding.py", tmp_path, "--types", "table_wise", "--profile", str(prof)
    )
    tables = sorted(p.name for p in prof.iterdir())
    assert tables == ["rank0-tetrarec.txt", "rank1-tetrarec.txt"], tables
    assert "tetrarec/input_dist" in (prof / "rank0-tetrarec.txt").read_text()
    plain, _, _ = _run("bench_sharding.py", tmp_path, "--types", "table_wise")
    sharded = [r for r in payload["results"] if r["world_size"] == 2]
    assert (
        sharded[0]["bytes_per_step"]
        == next(r for r in plain["results"] if r["world_size"] == 2)["bytes_per_step"]
    )
    assert len(sharded[0]["step_ms"]) == payload["config"]["rounds"] * payload["config"]["steps"]
