"""Row codecs: how one embedding row is stored in each precision, and stochastic rounding.

Float formats store a row as ``dim`` values of the precision's dtype. Integer formats
(INT8, INT4) store a row as one contiguous block of bytes (FBGEMM's fused row layout)::

    INT8, dim 4 (row_bytes 8):   [q0 q1 q2 q3 | scale(fp16) bias(fp16)]
    INT4, dim 4 (row_bytes 8):   [q1q0 q3q2 | scale(fp16) bias(fp16) | pad pad]
                                  (low nibble first)

and decode as ``x = q * scale + bias`` in FP32. Encoding recomputes a row's scale and
bias from its min and max, so an updated row always spans its full integer range: the
bias is the min rounded down to FP16 and the scale rounded up, so that the grid covers
the row's min and max (stochastic rounding stays unbiased there), and values saturate at
FP16's +-65504.

Stochastic rounding rounds ``x`` to one of its two neighbours ``lo <= x <= hi`` with
``P(hi) = (x - lo) / (hi - lo)``, so that ``E[round(x)] = x`` (unbiased); repeated small
updates to low-precision rows then do not vanish as they do with round-to-nearest.
"""

from __future__ import annotations

import torch

from tetrarec.types import Precision

__all__ = [
    "SUPPORTED_PRECISIONS",
    "decode_rows",
    "dequantize_rows",
    "encode_rows",
    "quantize_rows",
    "row_width",
    "stochastic_round",
]

SUPPORTED_PRECISIONS = (
    Precision.FP32,
    Precision.FP16,
    Precision.BF16,
    Precision.INT8,
    Precision.INT4,
)


def _check_supported(precision: Precision) -> None:
    if precision not in SUPPORTED_PRECISIONS:
        valid = ", ".join(p.value for p in SUPPORTED_PRECISIONS)
        raise ValueError(f"row precision {precision.value!r} is not supported; valid: {valid}")


def row_width(precision: Precision, dim: int) -> int:
    """Storage elements one row takes: ``dim`` for float formats, bytes for integer ones.

    Raises:
        ValueError: for a precision the row store does not support (FP8).
    """
    _check_supported(precision)
    return precision.row_bytes(dim) if precision.is_integer else dim


def _uniform(
    x: torch.Tensor, generator: torch.Generator | None, noise: torch.Tensor | None
) -> torch.Tensor:
    if noise is None:
        return torch.rand(x.shape, generator=generator, device=x.device)
    if noise.shape != x.shape:
        raise ValueError(f"noise {tuple(noise.shape)} must be shaped like x {tuple(x.shape)}")
    return noise


def stochastic_round(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round FP32 ``x`` to ``dtype`` (float16 or bfloat16), unbiased.

    Bit for bit the compiled kernel's rule, from 16 random bits ``r = floor(65536 u)`` per
    element (``u`` a uniform draw):

    - BF16: add ``r`` below BF16's last mantissa bit of FP32 ``x``, then truncate;
    - FP16, ``|x| >= 2^-14``: add ``r``'s low 13 bits below FP16's last mantissa bit, then
      truncate (saturating at +-65504 instead of overflowing);
    - FP16 subnormal range (spacing ``2^-24``): ``floor(|x| 2^24 + (r + 1/2) / 65536)
      2^-24`` with ``x``'s sign;
    - infinities and NaN stay as they are.

    Each rounds up (in magnitude) with probability equal to the distance from the lower
    neighbour over the gap, so the expected result is ``x``.

    Args:
        x: FP32 values.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        generator: source of the uniform draws (on ``x.device``).
        noise: the uniform draws in [0, 1) themselves, shaped like ``x`` (instead of
            ``generator``).

    Returns:
        A tensor of ``dtype`` shaped like ``x``; each value is one of the two ``dtype``
        neighbours of ``x``.

    Raises:
        ValueError: for another dtype.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"stochastic_round targets float16 or bfloat16, got {dtype}")
    x = x.float().contiguous()
    r = (_uniform(x, generator, noise) * 65536).floor().clamp_(0, 65535).long()
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    finite = torch.isfinite(x)
    if dtype is torch.bfloat16:
        high = ((bits + r) >> 16) & 0xFFFF
        rounded = _as_dtype(high, 16, torch.int16).view(torch.bfloat16)
        return torch.where(finite, rounded, x.to(torch.bfloat16))
    t = _as_dtype((bits + (r & 0x1FFF)) & 0xFFFFE000, 32, torch.int32).view(torch.float32)
    t = torch.where(t.abs() > 65504.0, torch.full_like(t, 65504.0).copysign(x), t)
    a = x.abs()
    u = (r.float() + 0.5) * (1.0 / 65536.0)
    sub = torch.floor(a * 16777216.0 + u).mul(5.9604644775390625e-08).copysign(x)
    out = torch.where(finite, torch.where(a < 6.103515625e-05, sub, t), x)
    return out.to(torch.float16)  # exact: every finite value above is an FP16 value


def _half_down(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded towards -inf to FP16, as FP32 (``x`` within FP16's range)."""
    h = x.half()
    bits = h.view(torch.int16).long() & 0xFFFF
    # one FP16 step towards -inf; from +-0, to the least negative value (0x8001)
    down = torch.where(
        (bits & 0x7FFF) == 0,
        torch.full_like(bits, 0x8001),
        torch.where((bits & 0x8000) != 0, bits + 1, bits - 1),
    )
    bits = torch.where(h.float() > x, down, bits)
    return _as_dtype(bits, 16, torch.int16).view(torch.float16).float()


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` rounded towards +inf to FP16, as FP32."""
    h = x.half()
    bits = h.view(torch.int16).long() & 0xFFFF
    bits = torch.where(h.float() < x, bits + 1, bits)
    return _as_dtype(bits, 16, torch.int16).view(torch.float16).float()


def _int_row_grid(
    lo: torch.Tensor, hi: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP16 scale and bias (as FP32 values) of integer rows spanning ``[lo, hi]``.

    The bias is ``lo`` rounded down and the scale ``(hi - bias) / levels`` rounded up, so
    that the grid ``bias + q * scale`` (``q = 0..levels``) covers the row. Rounded to
    nearest, a row's min or max could fall outside its grid and be clamped to the end
    code, and stochastic rounding was biased there: a small update of the min or max, or
    of a row whose values are all equal (scale 0, the value in the bias alone), was
    doubled or lost. A row whose ends are FP16 values keeps them exactly. ``lo`` and
    ``hi`` saturate at +-65504 as FP16 rows do. The compiled kernel computes the same
    bits (``int_row_grid`` in ``csrc/tbe_cpu.cpp``).
    """
    lo = lo.clamp(-65504.0, 65504.0)
    hi = hi.clamp(-65504.0, 65504.0)
    bias = _half_down(lo)
    scale = _half_up(((hi - bias) * float(1.0 / levels)).clamp(min=0.0))  # x FP32(1/levels)
    return scale, bias


def _as_dtype(unsigned: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Unsigned ``bits``-bit values (int64) as the signed integer dtype of that width."""
    half = 1 << (bits - 1)
    return torch.where(unsigned >= half, unsigned - (1 << bits), unsigned).to(dtype)


def quantize_rows(
    x: torch.Tensor,
    precision: Precision,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack FP32 rows ``(R, D)`` into INT8/INT4 rows ``(R, row_bytes(D))`` uint8.

    Args:
        x: ``(R, D)`` FP32 rows.
        precision: ``Precision.INT8`` or ``Precision.INT4``.
        stochastic: round the integer codes stochastically (unbiased) instead of to
            nearest.
        generator: source of the uniform draws when ``stochastic``.
        noise: the ``(R, D)`` uniform draws themselves (instead of ``generator``).

    Raises:
        ValueError: if ``precision`` is not an integer format.
    """
    if not precision.is_integer:
        raise ValueError(f"quantize_rows packs INT8/INT4 rows, got {precision.value}")
    rows, dim = x.shape
    x = x.float()
    levels = (1 << precision.bits) - 1
    lo, hi = x.aminmax(dim=1, keepdim=True)  # (R, 1) each
    scale, bias = _int_row_grid(lo, hi, levels)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (x - bias) * inv
    if stochastic:
        q = torch.floor(q + _uniform(q, generator, noise))
    else:
        q = torch.round(q)
    q = q.clamp_(0, levels).to(torch.uint8)  # (R, D)
    out = torch.zeros(rows, precision.row_bytes(dim), dtype=torch.uint8, device=x.device)
    payload = (dim * precision.bits + 7) // 8
    if precision.bits == 4:
        if dim % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # (R, ceil(D/2)), low nibble first
    out[:, :payload] = q
    tail = torch.cat([scale.half(), bias.half()], dim=1)  # (R, 2) fp16
    out[:, payload : payload + 4] = tail.view(torch.uint8)
    return out


def dequantize_rows(packed: torch.Tensor, precision: Precision, dim: int) -> torch.Tensor:
    """Unpack INT8/INT4 rows ``(R, row_bytes(dim))`` uint8 into FP32 ``(R, dim)``.

    Raises:
        ValueError: if ``precision`` is not an integer format or the row width is wrong.
    """
    if not precision.is_integer:
        raise ValueError(f"dequantize_rows unpacks INT8/INT4 rows, got {precision.value}")
    if packed.dim() != 2 or packed.shape[1] != precision.row_bytes(dim):
        raise ValueError(
            f"{precision.value} rows of dim {dim} are {precision.row_bytes(dim)} bytes, "
            f"got shape {tuple(packed.shape)}"
        )
    payload = (dim * precision.bits + 7) // 8
    q = packed[:, :payload]
    if precision.bits == 4:
        # (R, 2 payload) spelled out: with no rows, -1 would be ambiguous
        q = torch.stack([q & 0x0F, q >> 4], dim=2).reshape(packed.shape[0], 2 * payload)[:, :dim]
    # A fresh copy (storage offset 0): viewing bytes as FP16 needs an even offset, and a
    # single row's slice is already contiguous at the odd offset of an odd payload.
    tail = packed[:, payload : payload + 4].clone(memory_format=torch.contiguous_format)
    tail = tail.view(torch.float16).float()  # (R, 2)
    return q.float() * tail[:, 0:1] + tail[:, 1:2]


def encode_rows(
    x: torch.Tensor,
    precision: Precision,
    *,
    stochastic: bool,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP32 rows ``(R, D)`` to stored rows ``(R, row_width(precision, D))``.

    Stochastic rounding draws from ``generator``, or takes the draws ``noise`` (R, D).
    """
    _check_supported(precision)
    if precision.is_integer:
        return quantize_rows(x, precision, stochastic=stochastic, generator=generator, noise=noise)
    if precision is Precision.FP32:
        return x.float()
    if stochastic:
        return stochastic_round(x, precision.torch_dtype, generator=generator, noise=noise)
    return x.to(precision.torch_dtype)


def decode_rows(rows: torch.Tensor, precision: Precision, dim: int) -> torch.Tensor:
    """Stored rows ``(R, row_width(precision, dim))`` to FP32 ``(R, dim)``."""
    _check_supported(precision)
    if precision.is_integer:
        return dequantize_rows(rows, precision, dim)
    return rows.float()
