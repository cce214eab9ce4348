"""Topology files: presets load, bad fields are named, resizing keeps whole nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tetrarec.planner import Tier, Topology, preset_names

GOOD = """
name = "t"
nodes = 2
ranks_per_node = 4
collective_latency_s = 1e-5
intra_node_bandwidth = 1e11
inter_node_bandwidth = 1e10
[rank]
device_memory = 1e9
host_memory = 4e9
ssd = 0
device_bandwidth = 1e12
host_bandwidth = 1e10
ssd_bandwidth = 0
matmul_flops = 1e13
"""


def test_presets_load_with_the_documented_shapes() -> None:
    """Catches a preset file that is missing, malformed or has the wrong shape."""
    assert {"this-machine", "zionex-16x8", "gpu-node-8"} <= set(preset_names())
    cpu = Topology.preset("this-machine")
    assert (cpu.world_size, cpu.tiers[0]) == (2, Tier.HOST)  # no device: host is fast
    zionex = Topology.preset("zionex-16x8")
    assert (zionex.nodes, zionex.ranks_per_node) == (16, 8)
    assert zionex.rank.device_memory == 40e9
    assert zionex.tiers == (Tier.DEVICE, Tier.HOST, Tier.SSD)
    assert Topology.preset("gpu-node-8").world_size == 8


def test_load_and_bad_fields_are_named(tmp_path: Path) -> None:
    """Catches a loader that accepts a typo or a negative size silently."""
    path = tmp_path / "t.toml"
    path.write_text(GOOD)
    topo = Topology.load(path)
    assert topo.world_size == 8
    assert topo.tiers == (Tier.DEVICE, Tier.HOST)
    path.write_text(GOOD.replace("host_bandwidth = 1e10", "host_bandwidth = -1"))
    with pytest.raises(ValueError, match=r"rank\.host_bandwidth"):
        Topology.load(path)
    path.write_text(GOOD.replace("nodes = 2", "nodez = 2"))
    with pytest.raises(ValueError, match="nodez"):
        Topology.load(path)
    path.write_text(GOOD.replace("host_bandwidth = 1e10", "host_bandwidth = 0"))
    with pytest.raises(ValueError, match=r"host_bandwidth must be > 0"):
        Topology.load(path)
    with pytest.raises(ValueError, match="zionex-16x8"):
        Topology.preset("nope")
    # Bug caught: nan passed the ">= 0" checks (a comparison with nan is false), and the
    # planner then printed a step of "nan ms" and put every table on rank 0.
    for key in ("host_bandwidth = 1e10", "collective_latency_s = "):
        line = next(ln for ln in GOOD.splitlines() if ln.startswith(key))
        path.write_text(GOOD.replace(line, f"{line.split('=')[0]}= nan"))
        with pytest.raises(ValueError, match=rf"{line.split()[0]} must be a number >= 0, got nan"):
            Topology.load(path)


def test_resized_keeps_whole_nodes_or_one_partial_node() -> None:
    """Catches a resize that makes a world the nodes cannot hold."""
    z = Topology.preset("zionex-16x8")
    assert (z.resized(16).nodes, z.resized(16).ranks_per_node) == (2, 8)
    assert (z.resized(4).nodes, z.resized(4).ranks_per_node) == (1, 4)
    with pytest.raises(ValueError, match="world size 12"):
        z.resized(12)
    cpu = Topology.preset("this-machine").resized(4, 4)
    assert (cpu.nodes, cpu.ranks_per_node) == (1, 4)
