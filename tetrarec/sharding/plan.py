"""``ShardingPlan``: where every block of every table lives. Plain frozen data, JSON round trip.

A plan is data: the planner (or a person, by hand) writes it, the sharded collection only
reads it. Each table has a sharding type and its shards; a shard is a block of rows and
columns on one rank::

    {"world_size": 2, "local_world_size": 2,
     "tables": [
       {"table": "C1", "sharding": "table_wise",
        "shards": [{"rank": 1, "rows": [0, 1000], "cols": [0, 64]}]},
       {"table": "C2", "sharding": "row_wise",
        "shards": [{"rank": 0, "rows": [0, 500], "cols": [0, 64]},
                   {"rank": 1, "rows": [500, 999], "cols": [0, 64]}]},
       {"table": "C3", "sharding": "column_wise",
        "shards": [{"rank": 0, "rows": [0, 10], "cols": [0, 40]},
                   {"rank": 1, "rows": [0, 10], "cols": [40, 64]}]},
       {"table": "C4", "sharding": "data_parallel",
        "shards": [{"rank": 0, "rows": [0, 10], "cols": [0, 64]},
                   {"rank": 1, "rows": [0, 10], "cols": [0, 64]}]}]}

``validate`` checks a plan against the tables (every table placed, blocks that tile the
table exactly once, ranks inside the world, the sharding type's own rules, see
``strategy.py``); ``fingerprint`` is the hash every rank compares before the first
collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from tetrarec import jsonio
from tetrarec.embedding import TableConfig
from tetrarec.types import Placement, Precision, ShardingType

__all__ = ["Shard", "ShardingPlan", "TablePlacement", "TablePlan"]


_MAX_WORLD_SIZE = 1 << 20  # far beyond any cluster; a larger number is a damaged file


def _is_int(value: object) -> TypeGuard[int]:
    """A JSON integer: not a float (``1.9`` is no rank), a string or a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bounds(value: object) -> TypeGuard[list[int]]:
    """``[a, b]``: exactly two JSON integers."""
    return isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)


@dataclass(frozen=True, kw_only=True)
class Shard:
    """Rows ``[rows[0], rows[1])`` and columns ``[cols[0], cols[1])`` of a table on ``rank``."""

    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def num_rows(self) -> int:
        """Rows in the block."""
        return self.rows[1] - self.rows[0]

    @property
    def dim(self) -> int:
        """Columns in the block."""
        return self.cols[1] - self.cols[0]

    def to_dict(self) -> dict[str, Any]:
        """Plain values."""
        return {"rank": self.rank, "rows": list(self.rows), "cols": list(self.cols)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Shard:
        """Inverse of ``to_dict``.

        Raises:
            ValueError: on missing keys or malformed ranges.
        """
        bad = ValueError(f"bad shard {d!r}: needs rank, rows [a, b], cols [a, b] (integers)")
        if not isinstance(d, dict):
            raise bad
        rows, cols = d.get("rows"), d.get("cols")
        if not (_is_int(d.get("rank")) and _is_bounds(rows) and _is_bounds(cols)):
            raise bad
        shard = Shard(rank=d["rank"], rows=(rows[0], rows[1]), cols=(cols[0], cols[1]))
        if not (0 <= shard.rows[0] < shard.rows[1] and 0 <= shard.cols[0] < shard.cols[1]):
            raise ValueError(f"shard {d!r} has an empty or negative row or column range")
        return shard


@dataclass(frozen=True, kw_only=True)
class TablePlacement:
    """Where a table's rows live and how they are stored (the planner's choice).

    Args:
        placement: ``device`` or ``host`` memory; ``cached`` (an FP32 cache of hot rows
            in front of rows in host memory); ``ssd`` (the cache in front of rows in a
            memory-mapped file). See ``tetrarec.cache``.
        cache_fraction: the share of the rows cached, hottest first (0 for ``device``
            and ``host``).
        precision: the stored row precision.

    Raises:
        ValueError: for a fraction outside [0, 1], or a cache on an uncached placement.
    """

    placement: Placement
    cache_fraction: float = 0.0
    precision: Precision

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise ValueError(f"cache_fraction must be in [0, 1], got {self.cache_fraction}")
        if self.cache_fraction and self.placement in (Placement.DEVICE, Placement.HOST):
            raise ValueError(f"a {self.placement.value} placement has no cache")

    def describe(self) -> str:
        """``"ssd + 5% cache, int8"``."""
        cache = f" + {self.cache_fraction:.0%} cache" if self.cache_fraction else ""
        return f"{self.placement.value}{cache}, {self.precision.value}"

    def to_dict(self) -> dict[str, Any]:
        """Plain values."""
        return {
            "placement": self.placement.value,
            "cache_fraction": self.cache_fraction,
            "precision": self.precision.value,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TablePlacement:
        """Inverse of ``to_dict``.

        Raises:
            ValueError: on a missing or bad value.
        """
        if not isinstance(d, dict):
            raise ValueError(f"bad placement {d!r}: needs placement and precision")
        try:
            return TablePlacement(
                placement=Placement.parse(d["placement"]),
                cache_fraction=float(d.get("cache_fraction", 0.0)),
                precision=Precision.parse(d["precision"]),
            )
        except (KeyError, TypeError, OverflowError) as e:  # Overflow: float(10**400)
            raise ValueError(f"bad placement {d!r}: needs placement and precision") from e


@dataclass(frozen=True, kw_only=True)
class TablePlan:
    """One table's sharding type and shards, and optionally its placement.

    ``placement`` ``None``: the fast tier, no cache, the table's own precision.
    """

    table: str
    sharding: ShardingType
    shards: tuple[Shard, ...]
    placement: TablePlacement | None = None

    def ranks(self) -> tuple[int, ...]:
        """The ranks holding a shard, in shard order, without repeats."""
        return tuple(dict.fromkeys(s.rank for s in self.shards))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (``placement`` only when set)."""
        d: dict[str, Any] = {
            "table": self.table,
            "sharding": self.sharding.value,
            "shards": [s.to_dict() for s in self.shards],
        }
        if self.placement is not None:
            d["placement"] = self.placement.to_dict()
        return d


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """Where each table's blocks live (see the module docstring).

    Args:
        world_size: ranks the plan was made for.
        local_world_size: ranks per node (for table-row-wise and table-column-wise).
        tables: one ``TablePlan`` per table.

    Raises:
        ValueError: on a bad world size or a table named twice.
    """

    world_size: int
    local_world_size: int
    tables: tuple[TablePlan, ...]

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1:
            raise ValueError(f"bad plan world: {self.world_size} x {self.local_world_size}")
        if self.world_size > _MAX_WORLD_SIZE:  # a typo or damage: checks list every rank
            raise ValueError(f"bad plan world: {self.world_size} ranks (at most {_MAX_WORLD_SIZE})")
        if self.world_size % self.local_world_size:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of the ranks per node "
                f"{self.local_world_size}"
            )
        names = [t.table for t in self.tables]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"the sharding plan places tables {twice} more than once")

    def __iter__(self) -> Iterator[TablePlan]:
        return iter(self.tables)

    def table(self, name: str) -> TablePlan:
        """The plan of table ``name``.

        Raises:
            KeyError: if the plan does not place it.
        """
        for t in self.tables:
            if t.table == name:
                return t
        raise KeyError(f"the sharding plan has no table {name!r}")

    def select(self, names: Sequence[str]) -> ShardingPlan:
        """The part of the plan that places tables ``names`` (in that order).

        A model with several collections (its embedding tables and a first-order
        term's) has one plan; each collection is sharded by its own part.

        Raises:
            ValueError: naming the tables the plan does not place.
        """
        by_name = {t.table: t for t in self.tables}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ValueError(f"the sharding plan does not place tables {missing}")
        return dataclasses.replace(self, tables=tuple(by_name[n] for n in names))

    # -- checks ---------------------------------------------------------------------------

    def validate(self, tables: Sequence[TableConfig]) -> None:
        """Check that the plan places exactly ``tables``, each by its type's rules.

        Raises:
            ValueError: naming the table and what is wrong.
        """
        from tetrarec.sharding.strategy import strategy_of  # the registry imports this module

        by_name = {t.name: t for t in tables}
        unknown = [t.table for t in self.tables if t.table not in by_name]
        if unknown:
            raise ValueError(
                f"the sharding plan names tables {unknown} that the model does not have "
                f"(its tables: {sorted(by_name)})"
            )
        missing = [n for n in by_name if n not in {t.table for t in self.tables}]
        if missing:
            raise ValueError(f"the sharding plan does not place tables {missing}")
        for tp in self.tables:
            bad = [s.rank for s in tp.shards if not 0 <= s.rank < self.world_size]
            if bad:
                raise ValueError(
                    f"table {tp.table!r}: ranks {bad} are outside the plan's world size "
                    f"{self.world_size}"
                )
            strategy_of(tp.sharding, tp.table).validate(by_name[tp.table], tp, self)

    def check_world(self, world_size: int, local_world_size: int) -> None:
        """Refuse to run on another world than the plan's.

        Raises:
            ValueError: naming both worlds.
        """
        if (world_size, local_world_size) != (self.world_size, self.local_world_size):
            raise ValueError(
                f"the sharding plan was made for {self.world_size} ranks "
                f"({self.local_world_size} per node), this run has {world_size} "
                f"({local_world_size} per node): make a plan for this world"
            )

    # -- data -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain values (the JSON form)."""
        return {
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "tables": [t.to_dict() for t in self.tables],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ShardingPlan:
        """Inverse of ``to_dict``.

        Raises:
            ValueError: on malformed values (the message names the table).
        """
        if not isinstance(d, dict) or not isinstance(d.get("tables", []), list):
            raise ValueError(
                'sharding plan: expected an object {"world_size": N, "tables": [...]}, got '
                f"{type(d).__name__ if not isinstance(d, dict) else 'tables ' + repr(d['tables'])}"
            )
        tables = []
        for entry in d.get("tables", []):
            if not isinstance(entry, dict):
                raise ValueError(f"sharding plan: a table entry must be an object, got {entry!r}")
            name = entry.get("table", "?")
            try:
                sharding = ShardingType.parse(entry["sharding"])
                if not isinstance(entry["shards"], list):
                    raise ValueError(f"shards must be a list, got {entry['shards']!r}")
                shards = tuple(Shard.from_dict(s) for s in entry["shards"])
                placement = (
                    TablePlacement.from_dict(entry["placement"]) if "placement" in entry else None
                )
            except (KeyError, ValueError) as e:
                raise ValueError(f"sharding plan, table {name!r}: {e}") from e
            tables.append(
                TablePlan(table=str(name), sharding=sharding, shards=shards, placement=placement)
            )
        world, local = d.get("world_size"), d.get("local_world_size", d.get("world_size"))
        if not (_is_int(world) and _is_int(local)):
            raise ValueError(
                f"sharding plan: world_size and local_world_size must be integers, got "
                f"{world!r} and {local!r}"
            )
        return ShardingPlan(world_size=world, local_world_size=local, tables=tuple(tables))

    def to_json(self) -> str:
        """Indented JSON."""
        return jsonio.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(self.to_json() + "\n")

    @staticmethod
    def load(path: str | Path) -> ShardingPlan:
        """Read a plan written by ``save`` (or by hand).

        Raises:
            ValueError: if the file is not a valid plan (naming the file), or is a
                directory.
            FileNotFoundError: if it does not exist.
        """
        if Path(path).is_dir():
            raise ValueError(f"{path} is a directory; give the plan's JSON file")
        try:
            return ShardingPlan.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from e
        except RecursionError:  # the decoder's stack: arrays nested thousands deep
            raise ValueError(f"{path}: not a sharding plan (JSON nested too deeply)") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def fingerprint(self) -> str:
        """A short hash of the plan (the same on every rank for the same plan)."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def describe(self, tables: Sequence[TableConfig] = ()) -> str:
        """A table a person can read: each table's type and blocks, then bytes per rank.

        Args:
            tables: the table configs, for the per-rank bytes (weights only).
        """
        sizes = {t.name: t for t in tables}
        lines = [f"sharding plan: {self.world_size} ranks, {self.local_world_size} per node"]
        lines.append(f"{'table':<16} {'type':<18} shards (rank: rows x cols)")
        per_rank = [0] * self.world_size
        for tp in self.tables:
            blocks = ", ".join(
                f"{s.rank}: [{s.rows[0]},{s.rows[1]})x[{s.cols[0]},{s.cols[1]})" for s in tp.shards
            )
            where = f"  [{tp.placement.describe()}]" if tp.placement is not None else ""
            lines.append(f"{tp.table:<16} {tp.sharding.value:<18} {blocks}{where}")
            t = sizes.get(tp.table)
            if t is not None:
                for s in tp.shards:
                    prec = tp.placement.precision if tp.placement is not None else t.precision
                    per_rank[s.rank] += s.num_rows * prec.row_bytes(s.dim)
        if tables:
            lines.append(
                "weights per rank: "
                + ", ".join(f"{r}: {b / 2**20:.1f} MiB" for r, b in enumerate(per_rank))
            )
        return "\n".join(lines)
