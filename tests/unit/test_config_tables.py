"""The run's tables (``tetrarec.config.tables``): what the planner, a plan and training see."""

from __future__ import annotations

import pytest

from tetrarec.config import RunConfig
from tetrarec.config.tables import build_tables, model_tables, table_sharding_types
from tetrarec.sharding import plan_by_type
from tetrarec.types import ShardingType

BASE = [
    "model.num_sparse=3",
    "model.num_embeddings=[40, 30, 20]",
    "model.dlrm.bottom_mlp=[16, 8]",
    "model.dlrm.first_order=true",
]


def _model(*extra: str) -> RunConfig:
    return RunConfig().with_overrides([*BASE, *extra])


def test_model_tables_are_the_embedding_tables_then_the_first_order_ones() -> None:
    """Catches a first-order table missing from the run's tables (no plan would place
    it), a copy of another shape than its table's rows, or one that starts from the
    table initializer instead of 0."""
    model = _model().model
    tables = model_tables(model)
    assert tables[:3] == build_tables(model)
    fo = tables[3:]
    assert [t.name for t in fo] == ["C1_first_order", "C2_first_order", "C3_first_order"]
    assert [t.num_embeddings for t in fo] == [40, 30, 20]
    assert {(t.dim, t.precision.value, t.init_bound) for t in fo} == {(1, "fp32", 0.0)}
    assert [t.feature_names for t in fo] == [t.feature_names for t in tables[:3]]
    without = _model("model.dlrm.first_order=false").model
    assert model_tables(without) == build_tables(without)


@pytest.mark.parametrize(
    ("types", "want"),
    [
        ("row_wise", ["row_wise"] * 6),
        ("[row_wise, data_parallel, table_row_wise]",
         ["row_wise", "data_parallel", "table_row_wise"] * 2),
        # a dim-1 table has no columns to split: placed whole
        ("column_wise", ["column_wise"] * 3 + ["table_wise"] * 3),
        ("[table_column_wise, row_wise, column_wise]",
         ["table_column_wise", "row_wise", "column_wise", "table_wise", "row_wise",
          "table_wise"]),
    ],
)  # fmt: skip
def test_each_first_order_table_takes_its_tables_sharding_type(types: str, want: list[str]) -> None:
    """Catches first-order tables given no type (the plan could not place them), another
    table's type, or a column split that ``sharding.column_block`` cannot divide (every
    rank stopped on "the column block size 8 does not divide its dim 1")."""
    config = _model(f"sharding.type={types}", "sharding.column_block=4")
    assert config.sharding.type is not None
    kinds = table_sharding_types(config.model, config.sharding.type)
    assert [k.value for k in kinds] == want
    plan = plan_by_type(
        model_tables(config.model), kinds, world_size=2, column_block=config.sharding.column_block
    )
    assert [tp.sharding for tp in plan] == [ShardingType.parse(k) for k in want]
