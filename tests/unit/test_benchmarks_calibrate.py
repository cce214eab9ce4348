"""``bench calibrate`` writes a topology file in the planner's schema, from measurements.

The plain smoke run (``test_benchmarks_smoke.py``) checks the report; this checks the
TOML it writes: it parses, holds every key of the shared schema, and its measured
fields are positive and the same figures as the JSON's rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TOP_KEYS = {
    "name", "nodes", "ranks_per_node", "collective_latency_s", "intra_node_bandwidth",
    "inter_node_bandwidth", "rank", "cores_per_node",
}  # fmt: skip
RANK_KEYS = {
    "device_memory", "host_memory", "ssd", "device_bandwidth", "host_bandwidth",
    "ssd_bandwidth", "matmul_flops", "lookup_ids_per_s",
    "block_route_s_per_id", "block_route_s_per_value", "row_route_s_per_id",
    "row_route_s_per_value", "replicated_route_s_per_id", "replicated_route_s_per_value",
    "block_route_s_per_step", "row_route_s_per_step", "replicated_route_s_per_step",
    "split_route_s_per_id", "split_route_s_per_value", "split_route_s_per_step",
}  # fmt: skip
MEASURED = ("host_memory", "ssd", "host_bandwidth", "ssd_bandwidth", "matmul_flops",
            "lookup_ids_per_s")  # fmt: skip


@pytest.mark.timeout(300)
def test_calibrate_writes_a_topology_of_measured_figures(tmp_path: Path) -> None:
    """Fails if the TOML does not parse, misses or renames a schema key, holds a
    non-positive measured figure (a failed or skipped measurement), or differs from the
    rows it was derived from (latency, all-to-all bandwidth, gather rate)."""
    out, js = tmp_path / "topo.toml", tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_calibrate.py"), "--smoke", "--out", str(out),
         "--json", str(js), "--ssd-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert text.startswith("# written by `tetrarec bench calibrate`")
    topo = tomllib.loads(text)
    assert set(topo) == TOP_KEYS
    assert set(topo["rank"]) == RANK_KEYS
    assert topo["name"].startswith("calibrated-")
    assert (topo["nodes"], topo["ranks_per_node"]) == (1, 2)
    assert topo["collective_latency_s"] > 0
    assert topo["intra_node_bandwidth"] > 0
    assert topo["inter_node_bandwidth"] > 0
    for key in MEASURED:
        assert topo["rank"][key] > 0, key
    assert topo["rank"]["device_memory"] == topo["rank"]["device_bandwidth"] == 0
    rows = json.loads(js.read_text())["results"]

    def row(what: str, impl: str | None = None) -> float:
        return next(r["value"] for r in rows if r["what"] == what and impl in (None, r["impl"]))

    # per-rank rates come from the ranks measured at once
    stage = row("per-rank collective_latency_s")
    assert topo["collective_latency_s"] == pytest.approx(stage, 1e-5)
    assert topo["intra_node_bandwidth"] == pytest.approx(row("all_to_all bandwidth W=2"), 1e-5)
    assert topo["rank"]["host_bandwidth"] == pytest.approx(row("per-rank lookup_bandwidth"), 1e-5)
    assert topo["rank"]["matmul_flops"] == pytest.approx(row("per-rank matmul_flops"), 1e-5)
    ids_rate = row("per-rank lookup_ids_per_s")
    assert topo["rank"]["lookup_ids_per_s"] == pytest.approx(ids_rate, 1e-5)
    assert topo["rank"]["ssd_bandwidth"] == pytest.approx(row("ssd random read"), 1e-5)
    for key in RANK_KEYS:
        if "_route_s_per_" in key:  # fitted slopes: >= 0 (clamped), the rows' figures
            assert topo["rank"][key] >= 0, key
            assert topo["rank"][key] == pytest.approx(row(f"per-rank {key}"), 1e-5, abs=1e-15)


def test_routing_fit_recovers_planted_rates() -> None:
    """Fails if ``fit_routing`` reads the points in other units than the cost model
    charges (``route_seconds``), swaps ids and values, mixes the groups, or keeps a
    fixed per-step cost in the slopes, or forgets to subtract the split group's SGD
    baseline: steps made by the cost model itself with known routing rates plus a
    constant must give those rates back."""
    sys.path.insert(0, str(BENCH))
    from _routing import ROUTE_POINTS, _point_kinds, fit_routing, route_key

    from tetrarec.embedding import TableConfig
    from tetrarec.planner import AccessStats, PlannerInputs, TableSpec, Topology, predict
    from tetrarec.sharding import plan_by_type
    from tetrarec.types import OptimizerKind, ShardingType

    bare = replace(Topology.preset("this-machine"), ranks_per_node=4, cores_per_node=2)
    planted = {
        "block_route_s_per_id": 3e-8,
        "block_route_s_per_value": 2e-9,
        "row_route_s_per_id": 9e-8,
        "row_route_s_per_value": 4e-9,
        "replicated_route_s_per_id": 5e-8,
        "replicated_route_s_per_value": 0.0,
        "block_route_s_per_step": 0.0,  # the block group's is collective_latency_s's
        "row_route_s_per_step": 2e-3,
        "replicated_route_s_per_step": 1e-3,
        "split_route_s_per_id": 7e-8,
        "split_route_s_per_value": 3e-9,
        "split_route_s_per_step": 5e-4,
    }
    routed = replace(bare, rank=replace(bare.rank, **planted))
    steps = {}
    for group, sharding, rows, optimizer in _point_kinds():
        for pooling, dim in ROUTE_POINTS:
            names = [f"r{r}" for r in range(4)]
            specs = tuple(
                TableSpec(name=n, rows=rows, dim=dim, features=(n,),
                          optimizer=OptimizerKind(optimizer),
                          stats=(AccessStats(mean_pooling=pooling),))
                for n in names
            )  # fmt: skip
            plan = plan_by_type(
                [TableConfig(name=n, num_embeddings=rows, dim=dim) for n in names],
                ShardingType(sharding),
                world_size=4,
            )
            inputs = PlannerInputs(tables=specs, batch_size=2048, topology=routed)
            steps[route_key(group, pooling, dim)] = predict(inputs, plan).step_s + 0.004
    got = fit_routing(steps, bare, 2048)
    assert set(got) == set(planted)
    for key, want in planted.items():
        assert got[key] == pytest.approx(want, rel=1e-6, abs=1e-15), key
