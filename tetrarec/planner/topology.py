"""``Topology``: the machines a plan is made for, read from TOML.

All sizes are bytes, bandwidths bytes per second, times seconds::

    name = "this-machine"
    nodes = 1
    ranks_per_node = 2
    collective_latency_s = 5e-5        # per collective call
    intra_node_bandwidth = 5e9         # per rank, one direction
    inter_node_bandwidth = 1.25e9      # per rank, one direction
    cores_per_node = 2                 # optional: CPU cores the node's ranks share
    [rank]
    device_memory = 0                  # 0: no device (CPU-only machine)
    host_memory = 8e9
    ssd = 100e9
    device_bandwidth = 0               # random-row gather bandwidth of each tier
    host_bandwidth = 10e9
    ssd_bandwidth = 1e9
    matmul_flops = 5e10                # dense matrix rate (FP32)
    lookup_ids_per_s = 5e7             # optional: per-id lookup work (0: not charged)
    row_route_s_per_id = 2e-8          # optional: a sharding group's host-side work per
    row_route_s_per_value = 1e-9       #   id and per pooled value (also block_, replicated_)

A tier with capacity 0 does not exist; on a machine without a device the host memory is
the fast tier. Presets live in ``presets/*.toml`` (``Topology.preset(name)``).
"""

from __future__ import annotations

import enum
import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["PRESETS_DIR", "RankResources", "Tier", "Topology", "preset_names"]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"


class Tier(enum.Enum):
    """A memory tier rows can live in, fastest first."""

    DEVICE = "device"
    HOST = "host"
    SSD = "ssd"


TIER_ORDER = (Tier.DEVICE, Tier.HOST, Tier.SSD)


@dataclass(frozen=True, kw_only=True)
class RankResources:
    """Capacities and bandwidths of one rank (see the module docstring).

    ``lookup_ids_per_s`` is the rate of the lookup's per-id work apart from moving rows
    (sorting ids, summing their gradients: ids that repeat a row in a step cost this,
    not a row read); 0 leaves it out.

    ``<group>_route_s_per_id`` and ``<group>_route_s_per_value`` are the host-side
    seconds a sharding group (``block``: TW/CW/TWCW, ``row``: RW/TWRW, ``replicated``:
    DP) spends on each id it routes and each pooled value it moves, beyond the kernels
    and the link (bucketizing, regrouping, copies, partial sums; units in
    ``cost.route_seconds``); ``split`` is what the column blocks of a split table
    (CW/TWCW, more than one block) add with a row-wise optimizer: the rows' gradient
    shares computed, exchanged and added to the row state before the update;
    ``<group>_route_s_per_step`` is what the group costs per step beyond
    ``collective_latency_s`` per collective (``cost.group_seconds``); 0 leaves them out.

    Raises:
        ValueError: naming a negative field, or a tier with capacity but no bandwidth.
    """

    device_memory: float = 0.0
    host_memory: float = 0.0
    ssd: float = 0.0
    device_bandwidth: float = 0.0
    host_bandwidth: float = 0.0
    ssd_bandwidth: float = 0.0
    matmul_flops: float
    lookup_ids_per_s: float = 0.0
    block_route_s_per_id: float = 0.0
    block_route_s_per_value: float = 0.0
    row_route_s_per_id: float = 0.0
    row_route_s_per_value: float = 0.0
    replicated_route_s_per_id: float = 0.0
    replicated_route_s_per_value: float = 0.0
    block_route_s_per_step: float = 0.0
    row_route_s_per_step: float = 0.0
    replicated_route_s_per_step: float = 0.0
    split_route_s_per_id: float = 0.0
    split_route_s_per_value: float = 0.0
    split_route_s_per_step: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"topology rank.{f.name} must be a number >= 0, got {value!r}")
            object.__setattr__(self, f.name, float(value))
        for tier in TIER_ORDER:
            if self.capacity(tier) > 0 and self.bandwidth(tier) <= 0:
                raise ValueError(
                    f"topology rank.{tier.value}_bandwidth must be > 0 when the tier has "
                    f"capacity ({self.capacity(tier):.3g} bytes)"
                )
        if not any(self.capacity(t) > 0 for t in TIER_ORDER):
            raise ValueError(
                "topology rank: device_memory, host_memory and ssd are all 0: no tier to place "
                "rows in"
            )
        if self.matmul_flops <= 0:
            raise ValueError("topology rank.matmul_flops must be > 0")

    def capacity(self, tier: Tier) -> float:
        """Bytes of ``tier`` per rank (0: the tier does not exist)."""
        return {Tier.DEVICE: self.device_memory, Tier.HOST: self.host_memory, Tier.SSD: self.ssd}[
            tier
        ]

    def route_rates(self, group: str) -> tuple[float, float]:
        """(seconds per id, seconds per pooled value) of sharding group ``group``'s routing."""
        return (
            float(getattr(self, f"{group}_route_s_per_id")),
            float(getattr(self, f"{group}_route_s_per_value")),
        )

    def bandwidth(self, tier: Tier) -> float:
        """Random-row gather bandwidth of ``tier`` (bytes/s)."""
        return {
            Tier.DEVICE: self.device_bandwidth,
            Tier.HOST: self.host_bandwidth,
            Tier.SSD: self.ssd_bandwidth,
        }[tier]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Nodes x ranks per node, each rank with ``rank``'s resources (module docstring).

    Args:
        name: what reports call it.
        nodes: nodes.
        ranks_per_node: ranks on each node.
        collective_latency_s: fixed time of one collective call.
        intra_node_bandwidth: bytes/s per rank, one direction, to a rank of its node.
        inter_node_bandwidth: bytes/s per rank, one direction, to another node.
        rank: each rank's memory tiers, their bandwidths and its matrix rate.
        cores_per_node: CPU cores a node's ranks share, when they compute on CPU cores
            and are more than the cores (then ``rank``'s rates are those of a rank
            while every rank of its node is busy, and a rank whose node-mates wait runs
            faster; ``cost.shared_compute``). 0: each rank has its own processor.

    Raises:
        ValueError: naming the field that is out of range.
    """

    name: str
    nodes: int
    ranks_per_node: int
    collective_latency_s: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    rank: RankResources
    cores_per_node: int = 0

    def __post_init__(self) -> None:
        for f in ("nodes", "ranks_per_node"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"topology {f} must be an integer >= 1, got {value!r}")
        cores = self.cores_per_node
        if not isinstance(cores, int) or isinstance(cores, bool) or cores < 0:
            raise ValueError(f"topology cores_per_node must be an integer >= 0, got {cores!r}")
        for f in ("collective_latency_s", "intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, f)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"topology {f} must be a number >= 0, got {value!r}")
            object.__setattr__(self, f, float(value))
        if self.world_size > 1 and self.intra_node_bandwidth <= 0 and self.ranks_per_node > 1:
            raise ValueError("topology intra_node_bandwidth must be > 0 with several ranks a node")
        if self.nodes > 1 and self.inter_node_bandwidth <= 0:
            raise ValueError("topology inter_node_bandwidth must be > 0 with several nodes")

    @property
    def world_size(self) -> int:
        """All ranks."""
        return self.nodes * self.ranks_per_node

    @property
    def cores_shared(self) -> bool:
        """Whether a node's ranks outnumber the cores they share."""
        return 0 < self.cores_per_node < self.ranks_per_node

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers that exist (capacity > 0), fastest first."""
        return tuple(t for t in TIER_ORDER if self.rank.capacity(t) > 0)

    @property
    def fast_tier(self) -> Tier:
        """The fastest tier (device memory, or host memory on a machine without one)."""
        return self.tiers[0]

    def node_of(self, rank: int) -> int:
        """The node of ``rank``."""
        return rank // self.ranks_per_node

    def resized(self, world_size: int, ranks_per_node: int | None = None) -> Topology:
        """The same machines with ``world_size`` ranks.

        With ``ranks_per_node``, nodes of that many ranks (each rank keeps its
        resources: on a CPU machine a rank is a process). Otherwise whole nodes when
        ``world_size`` is a multiple of ``ranks_per_node``; fewer ranks than one node
        holds use one node of ``world_size`` ranks.

        Raises:
            ValueError: when ``world_size`` is neither (or not a multiple of the given
                ``ranks_per_node``).
        """
        if ranks_per_node is not None:
            if ranks_per_node < 1 or world_size % ranks_per_node:
                raise ValueError(
                    f"world size {world_size} is not a multiple of {ranks_per_node} ranks per node"
                )
            return replace(self, nodes=world_size // ranks_per_node, ranks_per_node=ranks_per_node)
        if world_size == self.world_size:
            return self
        if world_size >= 1 and world_size % self.ranks_per_node == 0:
            return replace(self, nodes=world_size // self.ranks_per_node)
        if 1 <= world_size < self.ranks_per_node:
            return replace(self, nodes=1, ranks_per_node=world_size)
        raise ValueError(
            f"world size {world_size} does not fit topology {self.name!r}: use a multiple of "
            f"its {self.ranks_per_node} ranks per node, or fewer ranks than one node"
        )

    # -- files ------------------------------------------------------------------------------

    @staticmethod
    def from_dict(values: dict[str, Any], where: str = "topology") -> Topology:
        """Build from the TOML layout of the module docstring.

        Raises:
            ValueError: naming ``where``, an unknown or missing field, or a bad value.
        """
        top = {f.name for f in fields(Topology)}
        per_rank = {f.name for f in fields(RankResources)}
        unknown = sorted(set(values) - top)
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; valid: {sorted(top)}")
        rank_values = values.get("rank")
        if not isinstance(rank_values, dict):
            raise ValueError(f"{where}: needs a [rank] table with {sorted(per_rank)}")
        unknown = sorted(set(rank_values) - per_rank)
        if unknown:
            raise ValueError(f"{where}: unknown fields rank.{unknown}; valid: {sorted(per_rank)}")
        missing = sorted(top - set(values) - {"name", "cores_per_node"})
        if missing:
            raise ValueError(f"{where}: missing fields {missing}")
        try:
            rank = RankResources(**rank_values)
            rest = {k: v for k, v in values.items() if k != "rank"}
            rest.setdefault("name", where)
            return Topology(rank=rank, **rest)
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from e
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e

    @staticmethod
    def load(path: str | Path) -> Topology:
        """Read a topology TOML file.

        Raises:
            ValueError: on bad TOML or values (naming the file and the field).
            FileNotFoundError: if it does not exist.
        """
        path = Path(path)
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not TOML: {e}") from e
        return Topology.from_dict(values, str(path))

    @staticmethod
    def preset(name: str) -> Topology:
        """A topology of ``presets/`` by name (``this-machine``, ``zionex-16x8``, ...).

        Raises:
            ValueError: for an unknown name, listing the presets.
        """
        path = PRESETS_DIR / f"{name}.toml"
        if not path.is_file():
            raise ValueError(f"unknown topology preset {name!r}; valid: {preset_names()}")
        return Topology.load(path)

    @staticmethod
    def resolve(spec: str) -> Topology:
        """A preset name or a TOML file path.

        Raises:
            ValueError: if ``spec`` is neither.
        """
        if spec in preset_names():
            return Topology.preset(spec)
        path = Path(spec)
        if path.is_file():
            return Topology.load(path)
        raise ValueError(
            f"topology {spec!r} is neither a file nor a preset; presets: {preset_names()}"
        )

    def describe(self) -> str:
        """One line: the shape and each tier per rank."""
        tiers = ", ".join(
            f"{t.value} {_gb(self.rank.capacity(t))} @ {_gb(self.rank.bandwidth(t))}/s"
            for t in self.tiers
        )
        return (
            f"topology {self.name}: {self.nodes} node(s) x {self.ranks_per_node} ranks; "
            f"per rank: {tiers}; matmul {self.rank.matmul_flops / 1e12:.3g} TFLOP/s"
        )


def preset_names() -> list[str]:
    """The preset topologies, sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def _gb(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e12:.3g} TB"
    if n >= 1e9 or n == 0 or math.isclose(n, 0):
        return f"{n / 1e9:.3g} GB"
    return f"{n / 1e6:.3g} MB"
