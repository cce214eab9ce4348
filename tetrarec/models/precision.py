"""How the dense path computes in BF16: native kernels, or BF16 emulated on FP32 units.

``dense_precision=bf16`` means: every matrix product of the dense path takes BF16
operands, accumulates in FP32 and returns a BF16 result, while the weights and the
optimizer state stay FP32. Two ways give those numerics:

- ``native``: ``torch.autocast(dtype=bfloat16)``; the products run on BF16 hardware
  (AVX-512 BF16 or AMX on CPU, tensor cores on GPU).
- ``emulated``: each product rounds its operands to BF16, multiplies them with the
  FP32 kernel and rounds the result to BF16. A product of two BF16 values is exact in
  FP32 (8 + 8 significant bits < 24), so this differs from the native kernels only in
  the order of the FP32 sums. Element-wise operations stay FP32. On a CPU without BF16
  units (AVX2 only) PyTorch's native BF16 products run about 8x slower than FP32 there;
  the emulation runs at about FP32 speed, so a laptop runs the same model, with the same
  numerics, as the BF16 cluster it will train on.

``auto`` (the default) picks ``native`` where the device has BF16 units and ``emulated``
elsewhere. The dense modules call ``linear`` instead of ``F.linear``; the model enters
``dense_precision_context`` around them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tetrarec.types import NamedEnum, Precision

__all__ = [
    "BF16Matmul",
    "bf16_emulation_active",
    "dense_precision_context",
    "emulated_bf16",
    "has_native_bf16",
    "linear",
    "round_to_bf16",
]


class BF16Matmul(NamedEnum):
    """How the dense path's BF16 matrix products run (see the module docstring)."""

    __noun__ = "bf16 matmul"

    AUTO = "auto"
    NATIVE = "native"
    EMULATED = "emulated"


_state = threading.local()  # .emulate: bool, per thread like torch.autocast's own state


def bf16_emulation_active() -> bool:
    """Whether ``linear`` emulates BF16 products on this thread right now."""
    return bool(getattr(_state, "emulate", False))


@contextlib.contextmanager
def emulated_bf16(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``linear`` computes BF16 products on FP32 units.

    The backward pass needs no context: each product's backward rounds on its own.
    """
    previous = bf16_emulation_active()
    _state.emulate = enabled
    try:
        yield
    finally:
        _state.emulate = previous


@functools.cache
def has_native_bf16(device_type: str) -> bool:
    """Whether ``device_type``'s BF16 matrix products run on BF16 hardware.

    CPU: oneDNN's report (AVX-512 or AMX); CUDA: ``torch.cuda.is_bf16_supported()``;
    other devices are assumed native.
    """
    if device_type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return True
    if device_type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return True


def dense_precision_context(
    precision: Precision, matmul: BF16Matmul, device_type: str
) -> contextlib.AbstractContextManager[Any]:
    """The context the dense path runs in for ``precision`` on ``device_type``.

    FP32: nothing. BF16: ``torch.autocast`` when ``matmul`` resolves to native,
    ``emulated_bf16()`` when it resolves to emulated.
    """
    if precision is Precision.FP32:
        return contextlib.nullcontext()
    if precision is Precision.BF16 and (
        matmul is BF16Matmul.EMULATED
        or (matmul is BF16Matmul.AUTO and not has_native_bf16(device_type))
    ):
        return emulated_bf16()
    return torch.autocast(device_type, dtype=precision.torch_dtype)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest BF16 value (ties to even), kept in ``x``'s dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or its BF16 emulation inside ``emulated_bf16()``."""
    if bf16_emulation_active() and x.dtype == torch.float32:
        out: torch.Tensor = _EmulatedBF16Linear.apply(x, weight, bias)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
        return out
    return F.linear(x, weight, bias)


class _EmulatedBF16Linear(torch.autograd.Function):
    """``y = bf16(bf16(x) bf16(w)^T + bf16(b))``, on the FP32 kernel.

    Each gradient is a BF16-rounded product of BF16-rounded operands, as autocast's BF16
    kernels give them.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        xb, wb = round_to_bf16(x), round_to_bf16(weight)
        ctx.save_for_backward(xb, wb)
        ctx.has_bias = bias is not None
        y = F.linear(xb, wb, None if bias is None else round_to_bf16(bias))
        return round_to_bf16(y)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        xb, wb = ctx.saved_tensors
        g = round_to_bf16(grad).reshape(-1, grad.shape[-1])  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = round_to_bf16(g @ wb).reshape(xb.shape)
        if ctx.needs_input_grad[1]:
            grad_w = round_to_bf16(g.t() @ xb.reshape(-1, xb.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = round_to_bf16(g.sum(0))
        return grad_x, grad_w, grad_b
