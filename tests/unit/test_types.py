import copy
import json
import pickle

import pytest
import torch

from tetrarec.types import OpenEnum, OptimizerKind, PoolingMode, Precision, ShardingType


def test_precision_row_bytes() -> None:
    assert Precision.FP32.row_bytes(64) == 256
    assert Precision.FP16.row_bytes(64) == 128
    # INT8: 64 bytes + fp16 scale + fp16 bias = 68, already 4-aligned
    assert Precision.INT8.row_bytes(64) == 68
    # INT4: 32 bytes + 4 = 36
    assert Precision.INT4.row_bytes(64) == 36
    assert Precision.INT4.row_bytes(3) == 8  # 2 bytes payload + 4, padded to 8
    assert Precision.INT8.row_bytes(64) / Precision.FP32.row_bytes(64) <= 0.3
    assert Precision.BF16.torch_dtype == torch.bfloat16
    assert Precision.INT4.torch_dtype == torch.uint8


def test_parse_errors_list_valid_values() -> None:
    assert Precision.parse("INT8") is Precision.INT8
    with pytest.raises(ValueError, match="valid: fp32, fp16"):
        Precision.parse("int3")
    assert PoolingMode.parse("mean") is PoolingMode.MEAN
    with pytest.raises(ValueError, match="sum, mean"):
        PoolingMode.parse("max")
    with pytest.raises(ValueError, match="rowwise_adagrad"):
        OptimizerKind.parse("lamb")


def test_optimizer_state_layout() -> None:
    assert OptimizerKind.SGD.state_layout(8) == {}
    assert OptimizerKind.ADAGRAD.state_layout(8) == {"sum": 8}
    assert OptimizerKind.ROWWISE_ADAGRAD.state_layout(8) == {"sum": 1}
    assert OptimizerKind.ADAM.state_layout(8) == {"exp_avg": 8, "exp_avg_sq": 8}
    assert OptimizerKind.ROWWISE_ADAM.state_layout(8) == {"exp_avg": 8, "exp_avg_sq": 1}
    assert OptimizerKind.ADAM.counts_steps
    assert not OptimizerKind.ADAGRAD.counts_steps


class Colour(OpenEnum):
    __slots__ = ()
    __noun__ = "colour"


Colour.declare("red")


def test_open_enum_members_act_as_enum_members() -> None:
    """Bugs caught: a declared member that is a new object on each lookup, unpickling or
    copy (``is`` comparisons and registry lookups fail), or that parse does not find."""
    blue = Colour.declare("blue")
    assert Colour.declare("blue") is blue  # declaring again (a re-import) is a no-op
    assert Colour("blue") is blue
    assert Colour.parse("BLUE") is blue
    assert Colour.BLUE is blue  # type: ignore[attr-defined]  # declared at run time
    assert pickle.loads(pickle.dumps(blue)) is blue
    assert copy.deepcopy(blue) is blue
    assert copy.copy(blue) is blue
    assert [c.value for c in Colour] == ["red", "blue"]
    assert len(Colour) == 2
    assert (blue.name, blue.value, str(blue)) == ("BLUE", "blue", "Colour.BLUE")
    assert json.dumps({"c": blue.value}) == '{"c": "blue"}'
    with pytest.raises(ValueError, match="unknown colour 'green'; valid: red, blue"):
        Colour.parse("green")
    with pytest.raises(ValueError, match="not a valid Colour"):
        Colour("green")
    with pytest.raises(ValueError, match="lower-case identifier"):
        Colour.declare("Green")
    with pytest.raises(AttributeError):
        blue._value = "x"


def test_sharding_type_keeps_its_builtins() -> None:
    """Bug caught: making the set open renamed or reordered the built-in types (plans
    and configs name them by value; error messages list them in this order)."""
    builtins = [t.value for t in ShardingType][:6]
    assert builtins == [
        "table_wise",
        "row_wise",
        "column_wise",
        "data_parallel",
        "table_row_wise",
        "table_column_wise",
    ]
    assert ShardingType("row_wise") is ShardingType.ROW_WISE
    assert ShardingType.parse("Table_Wise") is ShardingType.TABLE_WISE
    with pytest.raises(ValueError, match="unknown sharding type 'diagonal'; valid: table_wise"):
        ShardingType.parse("diagonal")
