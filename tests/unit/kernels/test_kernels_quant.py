"""Row codecs and stochastic rounding."""

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import (
    FusedEmbeddingBagCollection,
    decode_rows,
    dequantize_rows,
    encode_rows,
    quantize_rows,
    row_width,
    stochastic_round,
)
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT4])
@pytest.mark.parametrize("dim", [1, 7, 64])
def test_integer_rows_round_trip_within_half_a_step(precision, dim):
    x = torch.randn(50, dim, generator=torch.Generator().manual_seed(0))
    packed = quantize_rows(x, precision)
    assert packed.shape == (50, precision.row_bytes(dim))
    assert packed.dtype == torch.uint8
    tail = packed[:, (dim * precision.bits + 7) // 8 :][:, :4].contiguous()
    scale, bias = tail.view(torch.float16).float().unbind(1)
    back = dequantize_rows(packed, precision, dim)
    # half a step, plus the FP16 rounding of the bias (and the clamp it may cause)
    bound = scale / 2 + (x.min(1).values - bias).abs() + 1e-6
    assert ((back - x).abs() <= bound.unsqueeze(1) + scale.unsqueeze(1) * 1e-3).all()


def test_int8_storage_is_under_a_third_of_fp32_at_dim_64():
    assert row_width(Precision.INT8, 64) / (4 * 64) <= 0.3
    assert row_width(Precision.INT4, 64) == 36


def test_int4_packs_low_nibble_first():
    x = torch.tensor([[0.0, 15.0, 15.0, 0.0]])
    packed = quantize_rows(x, Precision.INT4)
    assert packed[0, :2].tolist() == [0xF0, 0x0F]
    assert dequantize_rows(packed, Precision.INT4, 4).tolist() == x.tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_round_is_unbiased(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 1e-4)  # between two representable values
    rounded = stochastic_round(x, dtype, generator=gen).float()
    one = torch.tensor(1.0, dtype=dtype)
    ulp = one.nextafter(torch.tensor(2.0, dtype=dtype)).item() - 1.0
    assert set(rounded.unique().tolist()) <= {1.0, 1.0 + ulp}
    p = 1e-4 / ulp
    five_sigma = 5 * ulp * (p * (1 - p) / x.numel()) ** 0.5
    assert rounded.mean().item() == pytest.approx(x[0].item(), abs=five_sigma)
    assert x.to(dtype).float().mean().item() == 1.0  # round-to-nearest loses the update


def test_stochastic_round_keeps_representable_values():
    x = torch.tensor([0.0, -2.0, 0.5, 65504.0])
    assert stochastic_round(x, torch.float16).float().tolist() == x.tolist()


def test_integer_stochastic_rounding_is_unbiased():
    gen = torch.Generator().manual_seed(1)
    row = torch.linspace(-1, 1, 16)
    x = (row + 0.3 / 255).repeat(20_000, 1)  # between codes for interior columns
    back = dequantize_rows(
        quantize_rows(x, Precision.INT8, stochastic=True, generator=gen), Precision.INT8, 16
    )
    err = (back.mean(0) - x[0])[1:-1]  # the end columns define scale and bias
    assert err.abs().max().item() < 2e-4


def test_fp8_is_rejected_with_the_valid_list():
    with pytest.raises(ValueError, match=r"fp8.*valid: fp32"):
        row_width(Precision.FP8, 4)


@pytest.mark.parametrize(
    ("precision", "scale"),
    [("fp16", 1.0), ("fp16", 1e-5), ("bf16", 1.0), ("bf16", 1e-5), ("int8", 1.0)],
)
def test_fused_update_rounding_is_unbiased(kernel_path, precision, scale):
    """One tiny SGD step on many equal rows: the mean lands on the exact FP32 result.

    ``scale`` 1e-5 puts FP16 rows in its subnormal range (a separate rounding path).
    """
    rows, dim = 4096, 8
    table = TableConfig(name="t", num_embeddings=rows, dim=dim, precision=precision)
    ebc = FusedEmbeddingBagCollection(
        [table], SparseOptimizerSpec(kind="sgd", lr=1.0), seed=0, stochastic_rounding=True
    )
    start = torch.linspace(0.5, 1.5, dim).repeat(rows, 1) * scale
    prec = Precision.parse(precision)
    packed = encode_rows(start, prec, stochastic=False)
    ebc.load_state_dict({"weights.t": packed})
    before = decode_rows(packed, prec, dim)
    step = 1e-4 * scale
    sf = SparseFeatures.from_lists({"t": [[i] for i in range(rows)]})
    ebc(sf).values.backward(torch.full((rows, dim), -step))  # w += step
    after = ebc.table_weights()["t"]
    cols = slice(1, -1) if prec.is_integer else slice(None)
    err = (after - (before + step))[:, cols].mean().item()
    assert abs(err) < 0.3 * step
    assert not torch.equal(after, before)


@pytest.mark.parametrize(("precision", "dim"), [(Precision.INT8, 3), (Precision.INT4, 10)])
def test_one_row_with_an_odd_payload_decodes(precision, dim):
    """A single packed row whose scale and bias sit at an odd byte offset.

    Bug it catches: the FP16 tail was viewed in place; for one row the slice is already
    contiguous at the odd offset and ``view(float16)`` raised, so the portable path
    crashed whenever a feature of an INT8 odd-dim or INT4 table had exactly one id.
    """
    x = torch.linspace(-1, 1, dim).unsqueeze(0)
    packed = quantize_rows(x, precision)
    assert (dim * precision.bits + 7) // 8 % 2 == 1  # the tail starts at an odd offset
    torch.testing.assert_close(dequantize_rows(packed, precision, dim), x, atol=0.08, rtol=0)
    assert torch.equal(dequantize_rows(packed, precision, dim),
                       dequantize_rows(packed.repeat(2, 1), precision, dim)[:1])  # fmt: skip
