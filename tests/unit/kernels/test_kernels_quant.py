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
from tetrarec.kernels._build import compiled_cpu_kernels
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


def _format_spacing(precision, x):
    """Distance between neighbouring stored values around ``x`` (R, D), from the format's
    definition alone: 2^(e - mantissa bits) for floats (subnormal spacing below the
    smallest normal), (max - min) / (2^bits - 1) of the row for INT8/INT4."""
    if precision.is_integer:
        levels = (1 << precision.bits) - 1
        return ((x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / levels).expand_as(x)
    mantissa, min_exp = {Precision.FP16: (10, -14), Precision.BF16: (7, -126)}[precision]
    exp = torch.floor(torch.log2(x.abs().clamp(min=2.0**min_exp)))
    return torch.pow(2.0, exp - mantissa)


@pytest.mark.parametrize(
    ("precision", "scale", "dim"),
    [
        ("fp16", 1.0, 8),
        ("fp16", 1e-5, 8),  # FP16 subnormal range: a separate rounding path
        ("fp16", 1.0, 13),  # compiled: a vector loop of 8, then a scalar tail of 5
        ("fp16", -1.0, 13),
        ("fp16", -1e-5, 13),
        ("bf16", 1.0, 8),
        ("bf16", -1e-5, 13),
        ("int8", 1.0, 8),
        ("int8", -1.0, 13),
        ("int4", 1.0, 8),
        ("int4", -1.0, 13),
    ],
)
def test_fused_update_rounding_is_unbiased(kernel_path, precision, scale, dim):
    """One tiny SGD step (a tenth of the format's spacing) on many equal rows: each
    column's mean lands on the exact FP32 result.

    Bugs it catches: stochastic rounding with too few random bits or a skewed draw (in
    the vector loop, in the scalar tail of dims that are not a multiple of 8, in the
    subnormal range, for negative values, for INT8 and INT4 codes), round-to-nearest
    where stochastic rounding was asked for (the step would vanish).
    """
    rows = 4096
    table = TableConfig(name="t", num_embeddings=rows, dim=dim, precision=precision)
    ebc = FusedEmbeddingBagCollection(
        [table], SparseOptimizerSpec(kind="sgd", lr=1.0), seed=0, stochastic_rounding=True
    )
    start = torch.linspace(0.5, 1.5, dim).repeat(rows, 1) * scale
    prec = Precision.parse(precision)
    packed = encode_rows(start, prec, stochastic=False)
    ebc.load_state_dict({"weights.t": packed})
    before = decode_rows(packed, prec, dim)
    step = 0.1 * _format_spacing(prec, before)
    if prec.is_integer:  # keep each row's min and max (the ends), hence its scale and bias:
        step[:, [0, -1]] = 0  # the interior codes must then round up with p = 0.1
    sf = SparseFeatures.from_lists({"t": [[i] for i in range(rows)]})
    ebc(sf).values.backward(-step)  # w += step
    after = ebc.table_weights()["t"]
    cols = slice(1, -1) if prec.is_integer else slice(None)
    err = (after - (before + step))[:, cols].mean(0)  # (D,) per column
    assert (err.abs() < 0.3 * step[0, cols]).all(), err / step[0, cols]
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


@pytest.mark.parametrize(("precision", "levels"), [(Precision.INT8, 256), (Precision.INT4, 16)])
def test_integer_rows_have_two_to_the_bits_levels(precision, levels):
    """A row of 2^bits equally spaced values decodes to 2^bits distinct values, one step of
    (max - min) / (2^bits - 1) apart (within the FP16 rounding of the stored scale).

    Bug it catches: a codec that uses half the levels (127 or 7 steps) merges neighbours;
    the round-trip bound above, taken from the codec's own stored scale, would not see it.
    """
    x = torch.linspace(-1.0, 2.0, levels).unsqueeze(0)
    back = dequantize_rows(quantize_rows(x, precision), precision, levels)
    assert back.unique().numel() == levels
    step = 3.0 / (levels - 1)
    assert ((back.diff() - step).abs() <= step * 2.0**-10).all()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize(("scale", "dim"), [(1.0, 8), (-1.0, 13), (1e-5, 13), (6e4, 5)])
def test_compiled_and_portable_stochastic_rounding_agree_bit_for_bit(
    monkeypatch, precision, scale, dim
):
    """An SGD step with lr 1 is exact FP32 arithmetic on both paths, so the rounded rows
    must be the same bits: the portable path (the oracle, and what runs on CUDA) and the
    compiled kernel draw the same random bits and must apply the same rule with them.

    Bugs caught: a rule that is unbiased but different (e.g. ``u < p`` against adding the
    bits and truncating), the FP16 subnormal or saturating (near 65504) branch of either
    path, random bits taken from another column or row.
    """
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    rows = 64
    gen = torch.Generator().manual_seed(dim)
    start = (torch.rand(rows, dim, generator=gen) + 0.5) * scale
    step = torch.randn(rows, dim, generator=gen) * 1e-3 * abs(scale)
    prec = Precision.parse(precision)
    packed = encode_rows(start, prec, stochastic=False)
    sf = SparseFeatures.from_lists({"t": [[i] for i in range(rows)]})
    table = TableConfig(name="t", num_embeddings=rows, dim=dim, precision=precision)
    got = {}
    for mode in ("auto", "reference"):
        monkeypatch.setenv("TETRAREC_KERNELS", mode)
        ebc = FusedEmbeddingBagCollection(
            [table], SparseOptimizerSpec(kind="sgd", lr=1.0), seed=5, stochastic_rounding=True
        )
        ebc.load_state_dict({"weights.t": packed.clone()})
        ebc(sf).values.backward(-step)
        got[mode] = ebc.state_dict()["weights.t"]
    assert torch.equal(got["auto"], got["reference"])


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT4])
@pytest.mark.parametrize("dim", [3, 8])
def test_no_rows_round_trip(precision: Precision, dim: int) -> None:
    """Catches an unpack that cannot take zero rows (INT4's nibble split reshaped with
    -1: a batch whose ids all hit a cache decoded no backing row and raised)."""
    empty = torch.empty(0, dim)
    packed = quantize_rows(empty, precision)
    assert packed.shape == (0, precision.row_bytes(dim))
    assert dequantize_rows(packed, precision, dim).shape == (0, dim)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize(
    "row",
    [
        [-0.10004, -0.0498, -0.00036, 0.02005, 0.10011],  # min and max between FP16 values
        [1.0, 1.02, 1.04981, 1.10001],  # far from 0: the FP16 bias is coarse
        [0.5],  # dim 1: every value in the bias
        [0.5, 0.5, 0.5, 0.5],  # all equal: scale 0
        [-0.3, -0.3, -0.3],
    ],
)
def test_small_updates_of_a_rows_min_max_or_constant_value_act_in_expectation(
    kernel_path, precision, row
):
    """One SGD step of +delta on many equal rows: every column, its min and max included,
    moves by delta on average.

    Bugs it catches: the FP16 bias and scale rounded to nearest, so that a row's min or
    max falls outside its grid and is clamped to the end code (the update of the min was
    22% too large, that of the max lost, that of a constant row - scale 0, its value in
    the bias alone - always lost).
    """
    rows, prec = 8192, Precision.parse(precision)
    start = torch.tensor(row).repeat(rows, 1)
    dim = start.shape[1]
    table = TableConfig(name="t", num_embeddings=rows, dim=dim, precision=precision)
    delta = 1e-4
    ebc = FusedEmbeddingBagCollection([table], SparseOptimizerSpec(kind="sgd", lr=delta), seed=3)
    packed = encode_rows(start, prec, stochastic=False)
    ebc.load_state_dict({"weights.t": packed})
    before = decode_rows(packed, prec, dim)
    sf = SparseFeatures.from_lists({"t": [[i] for i in range(rows)]})
    (-ebc(sf).values.sum()).backward()  # w += delta
    after = ebc.table_weights()["t"]
    change = (after - before).mean(0)
    stderr = (after - before).std(0) / rows**0.5
    assert ((change - delta).abs() <= 0.1 * delta + 5 * stderr).all(), change / delta


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT4])
def test_integer_grid_covers_the_row_and_saturates_at_the_fp16_range(precision):
    """The FP16 bias is at or below the row's min, bias + levels * scale at or above its
    max (each at most one FP16 step further), and a row past +-65504 saturates there.

    Bugs it catches: bias or scale rounded to nearest (the ends fall outside); a bias or
    scale that overflows FP16 (the row was all inf or NaN after a large update).
    """
    gen = torch.Generator().manual_seed(0)
    mags = torch.tensor([1e-3, 0.1, 1.0, 37.0, 3000.0]).repeat_interleave(200)
    x = (torch.rand(mags.numel(), 6, generator=gen) - 0.3) * mags[:, None]
    x[::7] += mags[::7, None]  # rows far from 0 for their width
    packed = quantize_rows(x, precision)
    payload = (6 * precision.bits + 7) // 8
    tail = packed[:, payload : payload + 4].clone().view(torch.float16).float()
    scale, bias = tail[:, 0], tail[:, 1]
    lo, hi = x.amin(1), x.amax(1)
    slack = torch.maximum(lo.abs(), hi.abs()) * 2.0**-20
    levels = (1 << precision.bits) - 1
    assert (bias <= lo + slack).all()
    assert (bias + levels * scale >= hi - slack).all()
    half_step = (lo.abs() * 2.0**-10).clamp(min=2.0**-24)  # one FP16 step, generously
    assert (bias >= lo - half_step).all()
    big = torch.tensor([[1e8, -0.5, 0.06, -1e9]])
    back = dequantize_rows(quantize_rows(big, precision), precision, 4)
    assert torch.isfinite(back).all()
    assert back[0, 0] >= 65504
    assert back[0, 3] <= -65504


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_huge_update_saturates_an_integer_row_instead_of_making_it_nan(kernel_path, precision):
    """One SGD step of 1e8 on one element of an INT8/INT4 row: the row stays finite, that
    element at FP16's top, as an FP16 row saturates.

    Bug it catches: the FP16 scale and bias computed from an unclamped min and max (inf
    past 65504): the whole row decoded as NaN.
    """
    table = TableConfig(name="t", num_embeddings=2, dim=4, precision=precision)
    ebc = FusedEmbeddingBagCollection([table], SparseOptimizerSpec(kind="sgd", lr=1.0), seed=0)
    out = ebc(SparseFeatures.from_lists({"t": [[0]]})).values
    out.backward(torch.tensor([[-1e8, 0.0, 0.0, 1e9]]))  # w -= grad
    row = ebc.table_weights()["t"][0]
    assert torch.isfinite(row).all(), row
    assert row[0] >= 65504, row
    assert row[3] <= -65504, row
