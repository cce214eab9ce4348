import pytest
import torch

from tetrarec.types import OptimizerKind, PoolingMode, Precision


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
