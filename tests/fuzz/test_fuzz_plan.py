"""Generated plan files (``sharding.plan``): a valid plan, or one ``ValueError`` line.

Plans are drawn valid first (a world, tables, every sharding type's blocks), then
damaged the way a hand edit or a bad tool might: a value anywhere replaced by any JSON
value (huge integers, floats, strings, nesting), a key removed, a shard's bounds moved,
the file cut short or made of any bytes. ``ShardingPlan.load`` then ``validate`` must
give a plan or a ``ValueError`` naming the file (the CLI's exit status 2); a plan that
passes places every table inside its rows and columns and survives ``to_dict`` /
``from_dict``. Never a ``KeyError``, ``TypeError``, ``OverflowError`` or
``RecursionError``.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st
from json_damage import damaged

from tetrarec.embedding import TableConfig
from tetrarec.sharding import ShardingPlan
from tetrarec.types import ShardingType

FUZZ = settings.get_profile("tetrarec-fuzz")
TABLES = [
    TableConfig(name="a", num_embeddings=10, dim=8),
    TableConfig(name="b", num_embeddings=3, dim=4),
]


def _cuts(draw: st.DrawFn, n: int, parts: int) -> list[int]:
    inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(parts, n) - 1)))
    return [0, *inner, n]


@st.composite
def valid_plan(draw: st.DrawFn) -> dict[str, Any]:
    local = draw(st.integers(1, 2))
    world = local * draw(st.integers(1, 2))
    tables = []
    for t in TABLES:
        kind = draw(st.sampled_from(list(ShardingType)))
        rows, cols = [0, t.num_embeddings], [0, t.dim]
        ranks = list(range(world))
        if kind in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
            node = draw(st.integers(0, world // local - 1))  # its blocks stay on one node
            ranks = list(range(node * local, (node + 1) * local))
        if kind == ShardingType.DATA_PARALLEL:
            shards = [{"rank": r, "rows": rows, "cols": cols} for r in ranks]
        elif kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            cut = _cuts(draw, t.num_embeddings, len(ranks))
            shards = [
                {"rank": r, "rows": [lo, hi], "cols": cols}
                for r, lo, hi in zip(ranks, cut, cut[1:])
            ]
        elif kind in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
            cut = _cuts(draw, t.dim, len(ranks))
            shards = [
                {"rank": r, "rows": rows, "cols": [lo, hi]}
                for r, lo, hi in zip(ranks, cut, cut[1:])
            ]
        else:
            shards = [{"rank": draw(st.sampled_from(ranks)), "rows": rows, "cols": cols}]
        entry: dict[str, Any] = {"table": t.name, "sharding": kind.value, "shards": shards}
        if draw(st.booleans()):
            entry["placement"] = draw(
                st.sampled_from(
                    [
                        {"placement": "device", "precision": "fp32"},
                        {"placement": "cached", "cache_fraction": 0.25, "precision": "int8"},
                        {"placement": "ssd", "cache_fraction": 1, "precision": "fp16"},
                    ]
                )
            )
        tables.append(entry)
    return {"world_size": world, "local_world_size": local, "tables": tables}


def damaged_plan() -> st.SearchStrategy[Any]:
    return valid_plan().flatmap(damaged)


def load(path) -> ShardingPlan | ValueError:
    try:
        plan = ShardingPlan.load(path)
        plan.validate(TABLES)
    except ValueError as e:
        error = e
    else:
        event("valid")
        return plan
    assert str(error).startswith(str(path)) or str(error).startswith(("the sharding", "table "))
    assert "\n" not in str(error)
    event("refused")
    return error


def assert_places_inside_the_tables(plan: ShardingPlan) -> None:
    by_name = {t.name: t for t in TABLES}
    for tp in plan:
        t = by_name[tp.table]
        for s in tp.shards:
            assert 0 <= s.rows[0] < s.rows[1] <= t.num_embeddings
            assert 0 <= s.cols[0] < s.cols[1] <= t.dim
            assert 0 <= s.rank < plan.world_size
    assert ShardingPlan.from_dict(plan.to_dict()) == plan


@FUZZ
@given(plan=valid_plan())
def test_valid_plans_load_and_round_trip(tmp_path, plan) -> None:
    """Every sharding type's blocks, placements included: the plan loads, validates and
    round-trips (the generator itself is checked here, so damage below is damage)."""
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    got = ShardingPlan.load(p)
    got.validate(TABLES)
    assert_places_inside_the_tables(got)
    assert got.to_dict()["tables"][0]["shards"] == plan["tables"][0]["shards"]


@FUZZ
@given(plan=damaged_plan())
def test_damaged_plans_load_valid_or_are_one_value_error(tmp_path, plan) -> None:
    """A value replaced, removed or moved anywhere: a plan whose blocks lie inside the
    tables, or one ``ValueError`` (a ``KeyError`` from a missing key, an
    ``OverflowError`` from a huge number, a block past the table's end let through,
    fails here)."""
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    got = load(p)
    if not isinstance(got, ValueError):
        assert_places_inside_the_tables(got)


@FUZZ
@given(raw=st.binary(max_size=100) | st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n))
def test_any_bytes_are_one_value_error(tmp_path, raw) -> None:
    """Any bytes, not UTF-8 or not JSON, or JSON nested thousands deep: a ``ValueError``
    naming the file (a ``RecursionError`` from the JSON decoder fails here)."""
    p = tmp_path / "plan.json"
    p.write_bytes(raw)
    assert isinstance(load(p), ValueError)
