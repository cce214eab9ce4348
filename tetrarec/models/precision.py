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
elsewhere: on x86 CPUs that means the ``avx512_bf16`` or ``amx_bf16`` instructions (a
CPU with AVX-512 but neither emulates: oneDNN would run its BF16 products on FP32 units,
slower than the emulation), on Arm CPUs the ``bf16`` feature, and any CUDA device that
supports BF16. The dense modules call ``linear`` instead of ``F.linear``; the model enters
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

from tetrarec.kernels import ops
from tetrarec.types import NamedEnum, Precision

__all__ = [
    "BF16Matmul",
    "bf16_emulation_active",
    "cpu_flags",
    "dense_precision_context",
    "emulated_bf16",
    "has_native_bf16",
    "linear",
    "parse_cpu_flags",
    "round_to_bf16",
]

# CPU feature flags (as /proc/cpuinfo spells them) that mean BF16 products run on BF16
# units: AVX-512 BF16 (vdpbf16ps), AMX tiles (Sapphire Rapids and later), Arm's BF16.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


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


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags named in the text of ``/proc/cpuinfo``.

    Args:
        cpuinfo: the file's text; its ``flags`` (x86) or ``Features`` (Arm) lines are read.

    Returns:
        The union of the flags of every listed processor.
    """
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            flags.update(rest.split())
    return frozenset(flags)


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This machine's CPU feature flags, read from ``/proc/cpuinfo`` once per process.

    Returns:
        The flags, or ``None`` where the file does not exist (not Linux).
    """
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return None


def has_native_bf16(device_type: str, flags: frozenset[str] | str | None = None) -> bool:
    """Whether ``device_type``'s BF16 matrix products run on BF16 hardware.

    CPU: the CPU has BF16 instructions (``avx512_bf16`` or ``amx_bf16``; ``bf16`` on
    Arm); AVX-512 alone is not enough. Where no flags can be read (not Linux), oneDNN's
    own report decides. CUDA: ``torch.cuda.is_bf16_supported()``. Other devices are
    assumed native.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        flags: the CPU's feature flags to decide from (a set, or the text of a
            ``/proc/cpuinfo``); default: this machine's, read once per process.
    """
    if device_type == "cpu":
        if isinstance(flags, str):
            flags = parse_cpu_flags(flags)
        if flags is None:
            flags = cpu_flags()
        if flags is not None:
            return not flags.isdisjoint(_NATIVE_BF16_FLAGS)
        return _onednn_native_bf16()
    if device_type == "cuda":
        return _cuda_native_bf16()
    return True


@functools.cache
def _cuda_native_bf16() -> bool:
    return bool(torch.cuda.is_bf16_supported())


@functools.cache
def _onednn_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def dense_precision_context(
    precision: Precision, matmul: BF16Matmul, device_type: str
) -> contextlib.AbstractContextManager[Any]:
    """The context the dense path runs in for ``precision`` on ``device_type``.

    FP32: nothing. BF16: ``torch.autocast`` when ``matmul`` resolves to native,
    ``emulated_bf16()`` when it resolves to emulated (``auto``: see ``has_native_bf16``).
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
    if x.dtype != torch.float32:
        return x.to(torch.bfloat16).to(x.dtype)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ops.round_to_bf16_out(x.contiguous(), out)
    return out


def _round_(x: torch.Tensor) -> torch.Tensor:
    """Round a fresh FP32 result to BF16 values in place (no copy)."""
    ops.round_to_bf16_out(x, x)
    return x


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_is_bf16: bool = False,
    grad_is_bf16: bool = False,
) -> torch.Tensor:
    """``F.linear``, or its BF16 emulation inside ``emulated_bf16()``.

    Args:
        x: ``(..., in)`` input.
        weight: ``(out, in)``.
        bias: ``(out,)`` or ``None``.
        input_is_bf16: the caller guarantees ``x`` holds BF16 values already (the
            output of another emulated product, maybe through a ReLU): its rounding
            pass is skipped. Ignored outside the emulation.
        grad_is_bf16: the same for the gradient that will flow into the output (it
            comes from another emulated product's input gradient).
    """
    if bf16_emulation_active() and x.dtype == torch.float32:
        out: torch.Tensor = _EmulatedBF16Linear.apply(x, weight, bias, input_is_bf16, grad_is_bf16)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
        return out
    return F.linear(x, weight, bias)


class _EmulatedBF16Linear(torch.autograd.Function):
    """``y = bf16(bf16(x) bf16(w)^T + bf16(b))``, on the FP32 kernel.

    Each gradient is a BF16-rounded product of BF16-rounded operands, as autocast's BF16
    kernels give them. Results of the products are rounded in place, in one pass.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_is_bf16: bool,
        grad_is_bf16: bool,
    ) -> torch.Tensor:
        xb = x if input_is_bf16 else round_to_bf16(x)
        wb = round_to_bf16(weight)
        ctx.save_for_backward(xb, wb)
        ctx.has_bias = bias is not None
        ctx.grad_is_bf16 = grad_is_bf16
        return _round_(F.linear(xb, wb, None if bias is None else round_to_bf16(bias)))

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        xb, wb = ctx.saved_tensors
        g = grad if ctx.grad_is_bf16 else round_to_bf16(grad)
        g = g.reshape(-1, g.shape[-1])  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _round_(g @ wb).reshape(xb.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _round_(g.t() @ xb.reshape(-1, xb.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _round_(g.sum(0))
        return grad_x, grad_w, grad_b, None, None
