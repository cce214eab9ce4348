"""The lower dense formats' MLP modules: BF16 weights, or INT8 weights on PyTorch's kernels.

Each module replaces a ``tetrarec.models.MLP`` (the bottom ``dense_arch`` or the top
``over_arch`` of a ``DLRM``) with the same call, ``(B, in) -> (B, out)`` FP32::

    x (B, in) -> [low-precision layer, ReLU] x n -> x (B, h) FP32 -> [FP32 layer] -> (B, out)
                                                                  (the top MLP's logit
                                                                   layer, -> 1)

- ``QuantBF16MLP``: weights and biases stored in BF16; products take BF16 operands and
  accumulate in FP32 (natively on BF16 units, else emulated on FP32 kernels exactly as
  ``tetrarec.models.precision`` does in training); activations between layers are BF16.
- ``QuantInt8MLP``: weights per-output-channel symmetric INT8 (``w ~= q * scale``,
  ``q`` in [-127, 127]) with FP32 scales and FP32 biases, prepacked for FBGEMM's
  kernels (``quantized::linear_prepack``). Activations are quantized per tensor to
  unsigned 7-bit codes (``reduce_range``: the FBGEMM kernels' u8 x s8 pair sums
  saturate 16 bits on CPUs without VNNI with full 8-bit codes; PyTorch's own x86
  qconfig makes the same choice), by one of ``ACTIVATION_MODES``:

  - ``dynamic``: each batch's own range (``quantized::linear_dynamic``; the output is
    FP32, re-quantized by the next layer);
  - ``static``: a scale and zero point per layer boundary calibrated once on
    calibration batches (``calibrate``; kept in the manifest's dense settings), so the
    activations stay quantized from the first layer to the last
    (``quantized::linear_relu`` / ``quantized::linear`` on ``quint8`` tensors).

The logit layer (the top MLP's last, -> 1) stays FP32 in both: it is one dot product per
sample (nothing to gain), and a BF16 or INT8 logit would tie or reorder close scores,
which moves AUC (the same reason training keeps it FP32). The INT8 kernels run on the
CPU only (FBGEMM); the modules' tensors move with ``.to`` but the packed INT8 weights do
not. torch 2.13 marks PyTorch's quantized tensors deprecated (pytorch#184982): when
they go, ``ACTIVATION_MODES`` gets entries on their successor (torchao) and the stored
format (int8 codes, FP32 scales) stays.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # the usual torch alias
from torch import nn

from tetrarec.models import MLP
from tetrarec.models.precision import BF16Matmul, has_native_bf16, round_to_bf16

__all__ = [
    "ACTIVATION_MODES",
    "ActivationQParams",
    "ActivationRanges",
    "Int8Weights",
    "MLPWeights",
    "QuantBF16MLP",
    "QuantInt8MLP",
    "int8_weights",
    "mlp_weights",
    "quantize_weights",
]

#: Largest activation code (unsigned, ``reduce_range``: 7 bits; see the module docstring).
ACTIVATION_QMAX = 127
#: Largest weight code magnitude (symmetric INT8).
WEIGHT_QMAX = 127


@dataclass(frozen=True, kw_only=True)
class MLPWeights:
    """An MLP's layers in FP32, whatever module holds them.

    Args:
        weights: ``(out, in)`` per layer, in order.
        biases: ``(out,)`` per layer.
        final_activation: ReLU after the last layer too (the bottom MLP).
        fp32_last_layer: the last layer stays FP32 in every format (the top MLP's logit).
    """

    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor, ...]
    final_activation: bool
    fp32_last_layer: bool

    @property
    def num_low(self) -> int:
        """How many layers a lower format stores in its precision (all but an FP32 last)."""
        return len(self.weights) - int(self.fp32_last_layer)

    def relu_after(self, i: int) -> bool:
        """Whether layer ``i`` is followed by a ReLU."""
        return i < len(self.weights) - 1 or self.final_activation


@dataclass(frozen=True, kw_only=True)
class Int8Weights:
    """An MLP's INT8 layers and its FP32 last layer.

    Args:
        codes: ``(out, in)`` int8 per INT8 layer, in [-127, 127].
        scales: ``(out,)`` FP32 per INT8 layer: ``weight ~= codes * scale[:, None]``.
        biases: ``(out,)`` FP32 per INT8 layer.
        last: the FP32 layer's ``(weight, bias)``, or ``None``.
        final_activation: ReLU after the last layer too.
    """

    codes: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor, ...]
    last: tuple[torch.Tensor, torch.Tensor] | None
    final_activation: bool

    def relu_after(self, i: int) -> bool:
        """Whether INT8 layer ``i`` is followed by a ReLU."""
        return self.last is not None or i < len(self.codes) - 1 or self.final_activation


@dataclass(frozen=True)
class ActivationQParams:
    """One layer boundary's static activation quantization: ``x ~= (q - zero_point) * scale``."""

    scale: float
    zero_point: int

    @classmethod
    def from_range(cls, low: float, high: float) -> ActivationQParams:
        """Codes 0..127 covering ``[min(low, 0), max(high, 0)]`` (0 is exact)."""
        low, high = min(low, 0.0), max(high, 0.0)
        scale = (high - low) / ACTIVATION_QMAX
        if not math.isfinite(scale) or scale <= 0.0:
            return cls(1.0, 0)
        # The scale as FP32 sees it (the kernels keep FP32 scales; JSON keeps it exactly).
        scale = float(torch.tensor(scale, dtype=torch.float32))
        zero_point = min(max(round(-low / scale), 0), ACTIVATION_QMAX)
        return cls(scale, zero_point)

    def to_json(self) -> list[float | int]:
        """``[scale, zero_point]``, as the manifest holds it."""
        return [self.scale, self.zero_point]

    @classmethod
    def from_json(cls, value: Any, where: str) -> ActivationQParams:
        """Read ``[scale, zero_point]``.

        Raises:
            ValueError: naming ``where``, for anything else or a non-positive scale.
        """
        ok = isinstance(value, list | tuple) and len(value) == 2
        if ok:
            scale, zp = value
            ok = isinstance(scale, float | int) and isinstance(zp, int) and scale > 0
            ok = ok and 0 <= zp <= ACTIVATION_QMAX and math.isfinite(scale)
        if not ok:
            raise ValueError(f"{where}: expected [scale > 0, zero point 0..127], got {value!r}")
        return cls(float(value[0]), int(value[1]))


def quantize_weights(weights: MLPWeights) -> Int8Weights:
    """Per-output-channel symmetric INT8 codes of every layer but an FP32 last one."""
    codes, scales = [], []
    for w in weights.weights[: weights.num_low]:
        w = w.float()
        scale = w.abs().amax(dim=1) / WEIGHT_QMAX  # (out,)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows
        codes.append(
            torch.round(w / scale[:, None]).clamp_(-WEIGHT_QMAX, WEIGHT_QMAX).to(torch.int8)
        )
        scales.append(scale)
    last = None
    if weights.fp32_last_layer:
        last = (weights.weights[-1].float(), weights.biases[-1].float())
    return Int8Weights(
        codes=tuple(codes),
        scales=tuple(scales),
        biases=tuple(b.float() for b in weights.biases[: weights.num_low]),
        last=last,
        final_activation=weights.final_activation,
    )


def _packed(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> Any:
    """FBGEMM's prepacked form of one INT8 layer."""
    zero_points = torch.zeros(codes.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():
        # torch 2.13 marks quantized tensors deprecated (pytorch#184982); their FBGEMM
        # kernels are still PyTorch's INT8 linear on CPU. Said once in the docs, not per load.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")
        qweight = torch._make_per_channel_quantized_tensor(
            codes.cpu(), scale.cpu().double(), zero_points, 0
        )
    return torch.ops.quantized.linear_prepack(qweight, bias.cpu())


class _FP32Last(nn.Module):
    """The FP32 last layer of a lower-format MLP (or nothing)."""

    def __init__(self, last: tuple[torch.Tensor, torch.Tensor] | None, relu: bool) -> None:
        super().__init__()
        self.relu = relu
        self.weight = None if last is None else nn.Parameter(last[0].float(), requires_grad=False)
        self.bias = None if last is None else nn.Parameter(last[1].float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return x
        x = F.linear(x.float(), self.weight, self.bias)
        return torch.relu_(x) if self.relu else x


class QuantBF16MLP(nn.Module):
    """An MLP with BF16 weights, run in BF16 (FP32 accumulation); see the module docstring.

    Args:
        weights: the layers (rounded to BF16 here; an FP32 last layer kept).
        matmul: ``native`` (BF16 kernels), ``emulated`` (FP32 kernels on BF16-rounded
            operands, result rounded), or ``auto`` (native where the device has BF16
            units: ``tetrarec.models.precision.has_native_bf16``).
    """

    def __init__(self, weights: MLPWeights, *, matmul: BF16Matmul = BF16Matmul.AUTO) -> None:
        super().__init__()
        self.matmul = matmul
        self.final_activation = weights.final_activation
        self.num_layers = len(weights.weights)
        n = weights.num_low
        for i in range(n):
            self.register_buffer(f"weight_{i}", weights.weights[i].to(torch.bfloat16))
            self.register_buffer(f"bias_{i}", weights.biases[i].to(torch.bfloat16))
        last = (weights.weights[-1], weights.biases[-1]) if weights.fp32_last_layer else None
        self.last = _FP32Last(last, relu=weights.final_activation)
        self._relu = tuple(weights.relu_after(i) for i in range(n))

    def low_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(weight, bias)`` BF16 of each BF16 layer."""
        return [
            (getattr(self, f"weight_{i}"), getattr(self, f"bias_{i}"))
            for i in range(len(self._relu))
        ]

    def mlp_weights(self) -> MLPWeights:
        """The layers as FP32 (the BF16 values, widened exactly)."""
        layers = [(w.float(), b.float()) for w, b in self.low_layers()]
        if self.last.weight is not None and self.last.bias is not None:
            layers.append((self.last.weight.detach(), self.last.bias.detach()))
        return MLPWeights(
            weights=tuple(w for w, _ in layers),
            biases=tuple(b for _, b in layers),
            final_activation=self.final_activation,
            fp32_last_layer=self.last.weight is not None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in) -> (B, out)`` FP32."""
        native = self.matmul is BF16Matmul.NATIVE or (
            self.matmul is BF16Matmul.AUTO and has_native_bf16(x.device.type)
        )
        # Our own numerics whatever context the model runs the MLP in (a BF16-trained
        # model's autocast): explicit dtypes below.
        with torch.autocast(x.device.type, enabled=False):
            for (w, b), relu in zip(self.low_layers(), self._relu):
                if native:  # BF16 operands and result, FP32 accumulation (oneDNN)
                    x = F.linear(x.to(torch.bfloat16), w, b)
                else:  # bf16(bf16(x) bf16(w)^T + bf16(b)) on the FP32 kernel
                    x = round_to_bf16(F.linear(round_to_bf16(x.float()), w.float(), b.float()))
                if relu:
                    x = torch.relu_(x)
            out: torch.Tensor = self.last(x.float())
        return out


class QuantInt8MLP(nn.Module):
    """An MLP with INT8 weights on FBGEMM's kernels; see the module docstring.

    Args:
        weights: the INT8 layers and the FP32 last one.
        activations: a key of ``ACTIVATION_MODES``.
        qparams: for ``static``: one ``ActivationQParams`` per layer boundary (the
            input, then each INT8 layer's output): ``len(codes) + 1`` of them.

    Raises:
        ValueError: for an unknown activation mode, or ``static`` without one qparams
            per boundary.
    """

    def __init__(
        self,
        weights: Int8Weights,
        *,
        activations: str,
        qparams: Sequence[ActivationQParams] = (),
    ) -> None:
        super().__init__()
        if activations not in ACTIVATION_MODES:
            raise ValueError(
                f"unknown INT8 activation mode {activations!r}; valid: {sorted(ACTIVATION_MODES)}"
            )
        n = len(weights.codes)
        if activations == "static" and len(qparams) != n + 1:
            raise ValueError(
                f"static INT8 activations need {n + 1} calibrated [scale, zero point] pairs "
                f"(the input and each INT8 layer's output), got {len(qparams)}"
            )
        self.activations = activations
        self.qparams = tuple(qparams)
        self.final_activation = weights.final_activation
        for i in range(n):
            self.register_buffer(f"codes_{i}", weights.codes[i])
            self.register_buffer(f"scale_{i}", weights.scales[i])
            self.register_buffer(f"bias_{i}", weights.biases[i])
        self.last = _FP32Last(weights.last, relu=weights.final_activation)
        self._relu = tuple(weights.relu_after(i) for i in range(n))
        self._packed = [
            _packed(weights.codes[i], weights.scales[i], weights.biases[i]) for i in range(n)
        ]

    def int8_weights(self) -> Int8Weights:
        """The stored layers (exactly as given)."""
        n = len(self._relu)
        last = None
        if self.last.weight is not None and self.last.bias is not None:
            last = (self.last.weight.detach(), self.last.bias.detach())
        return Int8Weights(
            codes=tuple(getattr(self, f"codes_{i}") for i in range(n)),
            scales=tuple(getattr(self, f"scale_{i}") for i in range(n)),
            biases=tuple(getattr(self, f"bias_{i}") for i in range(n)),
            last=last,
            final_activation=self.final_activation,
        )

    def mlp_weights(self) -> MLPWeights:
        """The layers as FP32 (INT8 codes times their scales)."""
        w = self.int8_weights()
        weights = [c.float() * s[:, None] for c, s in zip(w.codes, w.scales)]
        biases = list(w.biases)
        if w.last is not None:
            weights.append(w.last[0])
            biases.append(w.last[1])
        return MLPWeights(
            weights=tuple(weights),
            biases=tuple(biases),
            final_activation=self.final_activation,
            fp32_last_layer=w.last is not None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in) -> (B, out)`` FP32."""
        with torch.autocast(x.device.type, enabled=False):
            x = x.float().contiguous()
            if self._packed:
                x = ACTIVATION_MODES[self.activations](self, x)
            out: torch.Tensor = self.last(x)
        return out


def _run_dynamic(m: QuantInt8MLP, x: torch.Tensor) -> torch.Tensor:
    q = torch.ops.quantized
    for packed, relu in zip(m._packed, m._relu):
        op = q.linear_relu_dynamic if relu else q.linear_dynamic
        x = op(x, packed, True)  # reduce_range: 7-bit activation codes
    return x


def _run_static(m: QuantInt8MLP, x: torch.Tensor) -> torch.Tensor:
    q = torch.ops.quantized
    first = m.qparams[0]
    qx = torch.quantize_per_tensor(x, first.scale, first.zero_point, torch.quint8)
    for packed, relu, out in zip(m._packed, m._relu, m.qparams[1:]):
        op = q.linear_relu if relu else q.linear
        qx = op(qx, packed, out.scale, out.zero_point)
    return qx.dequantize()


#: How an INT8 MLP quantizes its activations, by ``settings["activations"]``.
ACTIVATION_MODES: dict[str, Callable[[QuantInt8MLP, torch.Tensor], torch.Tensor]] = {
    "dynamic": _run_dynamic,
    "static": _run_static,
}


def _mlp_weights_of_mlp(m: MLP) -> MLPWeights:
    return MLPWeights(
        weights=tuple(layer.weight.detach().float() for layer in m.linears),
        biases=tuple(layer.bias.detach().float() for layer in m.linears),
        final_activation=m.final_activation,
        fp32_last_layer=m.fp32_last_layer,
    )


# Which modules hold an MLP, and how to read its layers (the only dispatch on them).
_WEIGHTS_OF: dict[type[nn.Module], Callable[[Any], MLPWeights]] = {
    MLP: _mlp_weights_of_mlp,
    QuantBF16MLP: QuantBF16MLP.mlp_weights,
    QuantInt8MLP: QuantInt8MLP.mlp_weights,
}
# Modules that hold INT8 layers already (re-saved exactly, never quantized twice).
_INT8_OF: dict[type[nn.Module], Callable[[Any], Int8Weights]] = {
    QuantInt8MLP: QuantInt8MLP.int8_weights,
}


def mlp_weights(module: nn.Module) -> MLPWeights:
    """The FP32 layers of an MLP module (``MLP`` or one of this module's).

    Raises:
        ValueError: for a module that holds no MLP this tetrarec knows.
    """
    read = _WEIGHTS_OF.get(type(module))
    if read is None:
        raise ValueError(f"{type(module).__name__} is not an MLP module a dense format reads")
    return read(module)


def int8_weights(module: nn.Module) -> Int8Weights:
    """An MLP module's INT8 layers: its own if it holds them, else quantized from FP32."""
    own = _INT8_OF.get(type(module))
    return own(module) if own is not None else quantize_weights(mlp_weights(module))


class ActivationRanges:
    """Running min and max of each layer boundary of an MLP run in FP32 (calibration).

    ``observe`` takes a batch of the MLP's inputs; ``qparams`` then gives one
    ``ActivationQParams`` per boundary (the input, then each INT8 layer's output).
    """

    def __init__(self, weights: MLPWeights) -> None:
        self.weights = weights
        n = weights.num_low
        self.low = [math.inf] * (n + 1)
        self.high = [-math.inf] * (n + 1)
        self.batches = 0

    def observe(self, x: torch.Tensor) -> None:
        """Run the FP32 layers on ``x`` (the MLP's input) and widen every range."""
        w = self.weights
        x = x.detach().float()
        for i in range(w.num_low + 1):
            if i > 0:
                x = F.linear(x, w.weights[i - 1], w.biases[i - 1])
                if w.relu_after(i - 1):
                    x = torch.relu_(x)
            self.low[i] = min(self.low[i], float(x.min())) if x.numel() else self.low[i]
            self.high[i] = max(self.high[i], float(x.max())) if x.numel() else self.high[i]
        self.batches += 1

    def qparams(self) -> tuple[ActivationQParams, ...]:
        """One ``ActivationQParams`` per boundary.

        Raises:
            ValueError: if nothing was observed.
        """
        if not self.batches:
            raise ValueError("static INT8 calibration saw no batches (calibration is empty)")
        return tuple(ActivationQParams.from_range(lo, hi) for lo, hi in zip(self.low, self.high))
