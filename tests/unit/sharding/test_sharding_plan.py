"""ShardingPlan and placement by type: pure, one process."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tetrarec.embedding import TableConfig
from tetrarec.sharding import Shard, ShardingPlan, TablePlacement, TablePlan, plan_by_type
from tetrarec.sharding.strategy import split_evenly
from tetrarec.types import Placement, Precision, ShardingType

TABLES = (
    TableConfig(name="big", num_embeddings=1000, dim=16),
    TableConfig(name="mid", num_embeddings=500, dim=16),
    TableConfig(name="small", num_embeddings=10, dim=16),
    TableConfig(name="tiny", num_embeddings=3, dim=16),
)


def test_split_evenly_gives_the_first_ranks_the_extra_rows():
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_evenly(6, 3) == [(0, 2), (2, 4), (4, 6)]


def test_table_wise_balances_bytes_largest_first():
    plan = plan_by_type(TABLES, ShardingType.TABLE_WISE, world_size=2)
    ranks = {tp.table: tp.shards[0].rank for tp in plan}
    # big -> 0, mid -> 1 (the lighter), small -> 1 (1500 vs ...), tiny -> lighter again
    assert ranks["big"] != ranks["mid"]
    assert ranks["small"] == ranks["mid"]


def test_row_wise_splits_rows_and_skips_ranks_for_tiny_tables():
    plan = plan_by_type(TABLES, ShardingType.ROW_WISE, world_size=4)
    assert [s.rows for s in plan.table("small").shards] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [s.rows for s in plan.table("tiny").shards] == [(0, 1), (1, 2), (2, 3)]


def test_column_wise_blocks_are_contiguous_per_rank():
    plan = plan_by_type(TABLES[:1], ShardingType.COLUMN_WISE, world_size=2, column_block=4)
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for s in plan.table("big").shards:
        by_rank.setdefault(s.rank, []).append(s.cols)
    assert sorted(by_rank.values()) == [[(0, 4), (4, 8)], [(8, 12), (12, 16)]]
    with pytest.raises(ValueError, match="block size 5 does not divide its dim 16"):
        plan_by_type(TABLES[:1], ShardingType.COLUMN_WISE, world_size=2, column_block=5)


def test_hierarchical_types_stay_on_one_node():
    types = [ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE] * 2
    plan = plan_by_type(TABLES, types, world_size=4, local_world_size=2)
    for tp in plan:
        assert len({s.rank // 2 for s in tp.shards}) == 1, tp
    nodes = {tp.table: tp.shards[0].rank // 2 for tp in plan}
    assert nodes["big"] != nodes["mid"]  # the second-largest goes to the other node


def _plan(*tables: TablePlan, world: int = 2, local: int = 2) -> ShardingPlan:
    return ShardingPlan(world_size=world, local_world_size=local, tables=tables)


def _tp(name: str, kind: str, *shards: tuple[int, tuple[int, int], tuple[int, int]]) -> TablePlan:
    return TablePlan(
        table=name,
        sharding=ShardingType.parse(kind),
        shards=tuple(Shard(rank=r, rows=rows, cols=cols) for r, rows, cols in shards),
    )


FULL = ((0, 10), (0, 16))
BAD_PLANS = [
    ("table_wise two shards", _tp("small", "table_wise", (0, *FULL), (1, *FULL)), "one shard"),
    ("row_wise gap", _tp("small", "row_wise", (0, (0, 4), (0, 16)), (1, (5, 10), (0, 16))),
     "do not tile"),
    ("row_wise partial width", _tp("small", "row_wise", (0, (0, 5), (0, 8)), (1, (5, 10), (0, 16))),
     "hold every column"),
    ("row_wise two blocks on a rank",
     _tp("small", "row_wise", (0, (0, 5), (0, 16)), (0, (5, 10), (0, 16))), "two row blocks"),
    ("column_wise overlap",
     _tp("small", "column_wise", (0, (0, 10), (0, 9)), (1, (0, 10), (8, 16))), "do not tile"),
    ("data_parallel one rank", _tp("small", "data_parallel", (0, *FULL)), "each of the 2 ranks"),
    ("rank outside the world", _tp("small", "table_wise", (2, *FULL)), "outside the plan's world"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "bad", "message"), BAD_PLANS, ids=[b[0] for b in BAD_PLANS])
def test_validate_names_the_table_and_the_rule(what, bad, message):
    good = plan_by_type(TABLES, ShardingType.TABLE_WISE, world_size=2)
    tables = tuple(tp if tp.table != "small" else bad for tp in good)
    with pytest.raises(ValueError, match=message):
        _plan(*tables).validate(TABLES)


def test_twrw_across_nodes_is_refused():
    good = plan_by_type(TABLES, ShardingType.TABLE_WISE, world_size=4, local_world_size=2)
    bad = _tp("small", "table_row_wise", (1, (0, 5), (0, 16)), (2, (5, 10), (0, 16)))
    tables = tuple(tp if tp.table != "small" else bad for tp in good)
    with pytest.raises(ValueError, match="one node of 2 ranks"):
        _plan(*tables, world=4, local=2).validate(TABLES)


def test_missing_and_unknown_tables_and_bad_json(tmp_path):
    plan = plan_by_type(TABLES, ShardingType.TABLE_WISE, world_size=2)
    with pytest.raises(ValueError, match=r"does not place tables \['tiny'\]"):
        _plan(*plan.tables[:-1]).validate(TABLES)
    with pytest.raises(ValueError, match="made for 2 ranks"):
        plan.check_world(3, 3)
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        ShardingPlan.load(path)
    d = plan.to_dict()
    d["tables"][0]["shards"][0]["rows"] = [5, 2]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="empty or negative"):
        ShardingPlan.load(path)
    d["tables"][0]["sharding"] = "diagonal"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unknown sharding type 'diagonal'"):
        ShardingPlan.load(path)


def _plan_dict_with(change) -> object:
    d = plan_by_type(TABLES, ShardingType.ROW_WISE, world_size=2).to_dict()
    return change(d)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["tables"], r"expected an object .* got list"),
        (lambda d: {**d, "tables": {"big": 1}}, r"expected an object .* got tables \{"),
        (lambda d: {**d, "tables": ["big"]}, r"a table entry must be an object, got 'big'"),
        (lambda d: {**d, "world_size": None}, r"world_size .* must be integers, got None"),
        (lambda d: {**d, "world_size": 2.7}, r"world_size .* must be integers, got 2\.7"),
        (lambda d: {**d, "world_size": "2"}, r"world_size .* must be integers, got '2'"),
        (lambda d: {**d, "tables": [{**d["tables"][0], "shards": None}]}, r"shards must be a list"),
        (
            lambda d: {
                **d,
                "tables": [
                    {
                        **d["tables"][0],
                        "shards": [
                            {
                                "rank": 1.9,
                                **{
                                    k: v
                                    for k, v in d["tables"][0]["shards"][0].items()
                                    if k != "rank"
                                },
                            }
                        ],
                    }
                ],
            },
            r"bad shard .*rank.*integers",
        ),
        (
            lambda d: {
                **d,
                "tables": [
                    {
                        **d["tables"][0],
                        "shards": [{**d["tables"][0]["shards"][0], "rows": [0, 5, 9]}],
                    }
                ],
            },
            r"bad shard .*rows \[a, b\]",
        ),
        (
            lambda d: {**d, "tables": [{**d["tables"][0], "placement": "host"}]},
            r"bad placement 'host'",
        ),
    ],
    ids=[
        "list",
        "tables-object",
        "entry-string",
        "world-null",
        "world-float",
        "world-string",
        "shards-null",
        "rank-float",
        "three-bounds",
        "placement-string",
    ],
)
def test_a_malformed_plan_file_is_a_value_error_naming_it(tmp_path, change, match):
    """Bugs caught: a plan file of the wrong JSON shape crashed every rank with a
    traceback (AttributeError: 'list' object has no attribute 'get', TypeError on a
    null world_size or shards), and a rank 1.9, a world_size 2.7 or "2" and a third row
    bound were truncated or dropped silently."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_dict_with(change)))
    with pytest.raises(ValueError, match=match) as e:
        ShardingPlan.load(path)
    assert str(e.value).startswith(f"{path}: ")


def test_fingerprint_changes_with_any_shard():
    a = plan_by_type(TABLES, ShardingType.ROW_WISE, world_size=2)
    b = plan_by_type(TABLES, ShardingType.ROW_WISE, world_size=3)
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == ShardingPlan.from_dict(json.loads(a.to_json())).fingerprint()


def test_placements_round_trip_and_bad_ones_name_the_table():
    """Catches a placement lost in the JSON round trip (a planned SSD table trained in
    memory without a word) and a malformed one accepted."""
    base = plan_by_type(TABLES, ShardingType.TABLE_WISE, world_size=2)
    where = TablePlacement(placement=Placement.SSD, cache_fraction=0.05, precision=Precision.INT8)
    tables = tuple(replace(tp, placement=where) if tp.table == "big" else tp for tp in base.tables)
    plan = replace(base, tables=tables)
    again = ShardingPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    assert again.table("big").placement == where
    assert again.table("mid").placement is None
    assert "ssd + 5% cache, int8" in plan.describe(TABLES)
    d = plan.to_dict()
    d["tables"][0]["placement"] = {"placement": "tape", "precision": "fp32"}
    with pytest.raises(ValueError, match=rf"table '{d['tables'][0]['table']}'.*tape"):
        ShardingPlan.from_dict(d)
    with pytest.raises(ValueError, match="host placement has no cache"):
        TablePlacement(placement=Placement.HOST, cache_fraction=0.1, precision=Precision.FP32)


def test_the_sharded_collection_refuses_placements_it_cannot_honour():
    """Catches a plan's tier, cache or precision silently ignored by the sharded runtime,
    and rows on another device than the rank's. Every sharding type may cache
    (data-parallel replicas run the global batch's policy step, column blocks of a
    row-wise optimizer share row state through the cache: test_sharded_cache.py)."""
    from tetrarec.comm import Communicator
    from tetrarec.embedding import SparseOptimizerSpec
    from tetrarec.sharding import ShardingEnv
    from tetrarec.sharding.group import LookupOptions
    from tetrarec.sharding.sharded_collection import ShardedEmbeddingBagCollection

    env = ShardingEnv(Communicator.single())

    def build(kind: ShardingType, where: TablePlacement, optimizer: str = "sgd") -> None:
        options = LookupOptions(optimizer=SparseOptimizerSpec(kind=optimizer, lr=0.1), seed=0)
        base = plan_by_type(TABLES, kind, world_size=1)
        plan = replace(base, tables=tuple(replace(tp, placement=where) for tp in base.tables))
        ShardedEmbeddingBagCollection(TABLES, plan, env, options)

    host = TablePlacement(placement=Placement.HOST, precision=Precision.FP32)
    ssd = TablePlacement(placement=Placement.SSD, cache_fraction=0.05, precision=Precision.FP32)
    build(ShardingType.TABLE_WISE, host)  # honoured
    build(ShardingType.TABLE_WISE, ssd)  # each rank caches its shards
    build(ShardingType.COLUMN_WISE, ssd)  # element-wise state: the blocks are independent
    build(ShardingType.DATA_PARALLEL, ssd)  # replicas decide on the global batch
    build(ShardingType.COLUMN_WISE, ssd, optimizer="rowwise_adagrad")  # shares row state
    device = TablePlacement(placement=Placement.DEVICE, precision=Precision.FP32)
    with pytest.raises(ValueError, match=r"big \(table_wise, device, fp32\).*host memory"):
        build(ShardingType.TABLE_WISE, device)
    int8 = TablePlacement(placement=Placement.HOST, precision=Precision.INT8)
    with pytest.raises(ValueError, match=r"big \(fp32 -> int8\)"):
        build(ShardingType.TABLE_WISE, int8)


def test_a_table_placed_twice_is_named_alone() -> None:
    """The message listed every table of the plan, not the one placed twice."""
    plan = plan_by_type(TABLES, ShardingType.TABLE_WISE, world_size=2)
    with pytest.raises(ValueError, match=r"places tables \['mid'\] more than once") as e:
        replace(plan, tables=(*plan.tables, plan.table("mid")))
    assert "'big'" not in str(e.value)


def test_select_gives_a_collections_part_of_the_plan() -> None:
    """A model with two collections (its tables and a first-order term's) shards each by
    its part of one plan. Bugs caught: a part holding another collection's tables (the
    sharded collection would refuse it), tables out of the asked order, a missing table
    passing silently."""
    plan = plan_by_type(TABLES, ShardingType.ROW_WISE, world_size=2)
    part = plan.select(["tiny", "big"])
    assert [t.table for t in part] == ["tiny", "big"]
    assert part.table("big") == plan.table("big")
    assert (part.world_size, part.local_world_size) == (plan.world_size, plan.local_world_size)
    with pytest.raises(ValueError, match=r"does not place tables \['z'\]"):
        plan.select(["big", "z"])


# Found by tests/fuzz/test_fuzz_plan.py: each was a traceback, not a one-line ValueError.


def test_plan_file_that_is_a_directory_is_a_value_error(tmp_path):
    """``sharding.plan`` naming a directory raised IsADirectoryError (no exit status 2)."""
    with pytest.raises(ValueError, match="is a directory; give the plan's JSON file"):
        ShardingPlan.load(tmp_path)


def test_plan_json_nested_too_deeply_is_a_value_error(tmp_path):
    """JSON arrays nested 100000 deep raised the decoder's RecursionError."""
    p = tmp_path / "plan.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        ShardingPlan.load(p)


def test_huge_cache_fraction_is_a_value_error():
    """A cache_fraction of 10**400 (a JSON integer) raised OverflowError in float()."""
    with pytest.raises(ValueError, match="bad placement"):
        TablePlacement.from_dict(
            {"placement": "cached", "precision": "fp32", "cache_fraction": 10**400}
        )


def test_world_size_beyond_any_cluster_is_a_value_error():
    """world_size 2**63 + 1 passed, then validating a data-parallel table raised
    OverflowError from range() (and a large one would list billions of ranks)."""
    with pytest.raises(ValueError, match="bad plan world"):
        ShardingPlan(world_size=2**63 + 1, local_world_size=1, tables=())
