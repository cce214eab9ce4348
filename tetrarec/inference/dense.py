"""How an exported model stores and runs its dense layers: one format per precision.

A format is a ``DenseFormat`` in ``DENSE_FORMATS`` (the only dispatch): ``save`` turns a
built model's dense layers into the tensors a model file holds (``dense.<name>...``),
``load`` puts them back into a freshly built ``DLRM``, swapping modules where the format
runs them differently (an INT8 MLP). ``manifest.dense["precision"]`` names the format.

``fp32`` is the trained model as it is: every parameter outside the embedding tables
(``dense.<parameter name>``), run by the model's own code, so an exported FP32 model
scores exactly as the training run evaluated.

``bf16`` and ``int8`` store the bottom and top MLPs (``dense_arch``, ``over_arch``)
lower and swap them for ``tetrarec.inference.quantized_mlp``'s modules (same call);
every other dense parameter (the DCN cross layers, a first-order term's dense weight)
stays FP32 and runs in the model's own code:

- ``bf16``: ``dense.<mlp>.layers.<i>.weight`` / ``.bias`` in BF16 (half the bytes),
  run in BF16 (settings: ``matmul``: ``auto`` | ``native`` | ``emulated``);
- ``int8``: ``dense.<mlp>.layers.<i>.weight_int8`` (int8), ``.weight_scale`` (FP32, per
  output channel), ``.bias`` (FP32); settings: ``activations``: ``dynamic`` |
  ``static``, and for ``static`` the calibrated ``qparams`` ``{mlp: [[scale, zero
  point], ...]}``.

In both, the top MLP's logit layer (-> 1) stays FP32 (``dense.over_arch.layers.<last>``),
and the dot interaction (``inter_arch``) is swapped for
``tetrarec.inference.quantized_interaction.QuantBF16DotInteraction`` (BF16 products,
FP32 sums: ~2.7-4.9x faster than the FP32 kernel at batch 2048 on an AVX512_BF16 CPU);
it has no parameters, so nothing more is stored. Setting ``interaction``: ``bf16`` (the
default for a dot interaction) or ``fp32`` (the model's own); a DCN model's cross layers
have no BF16 version and get ``fp32``. A model file written before this setting existed
has none and loads with the default, so it runs the BF16 interaction.

A format's ``complete_settings`` runs once, when a model is quantized: it checks the
requested settings, fills in defaults and calibrates (static INT8) on the batches given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from tetrarec.inference.quantized_interaction import INTERACTION_PRECISIONS, bf16_interaction
from tetrarec.inference.quantized_mlp import (
    ACTIVATION_MODES,
    ActivationQParams,
    ActivationRanges,
    Int8Weights,
    MLPWeights,
    QuantBF16MLP,
    QuantInt8MLP,
    int8_weights,
    mlp_weights,
)
from tetrarec.models import DLRM
from tetrarec.models.interaction import Interaction
from tetrarec.models.precision import BF16Matmul
from tetrarec.sparse import Batch

__all__ = [
    "DEFAULT_INT8_ACTIVATIONS",
    "DENSE_FORMATS",
    "DENSE_PREFIX",
    "MLP_MODULES",
    "DenseFormat",
    "dense_parameters",
]

DENSE_PREFIX = "dense."
#: The model's MLP modules that the lower formats store lower and swap.
MLP_MODULES = ("dense_arch", "over_arch")
#: The INT8 activation mode a model gets when none is asked for. Measured
#: (``benchmarks/bench_inference_kernels.py``, batch 2048, AVX-512 VNNI CPU) neither mode
#: is faster on every shape (dynamic on the Criteo bottom MLP, static on the top ones);
#: dynamic needs no calibration data and never clips an activation outside the
#: calibrated range, so it is the default.
DEFAULT_INT8_ACTIVATIONS = "dynamic"


def dense_parameters(model: DLRM) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of every parameter and buffer outside the model's tables.

    (The embedding collection's and the first-order term's rows are tables; the
    first-order term's dense weight is a dense parameter.)
    """
    tables = ("embeddings.", "first_order.rows.")
    out = {n: p.detach() for n, p in model.named_parameters() if not n.startswith(tables)}
    out.update({n: b for n, b in model.named_buffers() if not n.startswith(tables)})
    return out


class DenseFormat(Protocol):
    """One way of storing and running the dense layers.

    Call order: ``complete_settings`` once when a model is quantized (its result is the
    manifest's ``dense`` section), then ``save`` whenever the model is written, and
    ``load`` on a freshly built model when one is read.
    """

    def complete_settings(
        self, model: DLRM, settings: Mapping[str, Any], calibration: Iterable[Batch] | None
    ) -> dict[str, Any]:
        """``settings`` checked, with defaults and calibrated values filled in.

        Args:
            model: the model about to be stored in this format (its current dense layers).
            settings: the requested ``{"precision": name, ...}``.
            calibration: batches to calibrate on, for a format that needs them.

        Raises:
            ValueError: naming the setting, for an unknown one or a bad value, or
                calibration that is missing or empty where it is needed.
        """
        ...

    def save(self, model: DLRM, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors that hold ``model``'s dense layers in this format."""
        ...

    def load(
        self, model: DLRM, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        """Put ``tensors`` (``save``'s) into ``model``, swapping modules as needed.

        Raises:
            ValueError: naming the tensor, for a missing one or one of another shape.
        """
        ...


def _check_keys(settings: Mapping[str, Any], allowed: Iterable[str]) -> None:
    unknown = sorted(set(settings) - {"precision", *allowed})
    if unknown:
        valid = sorted(allowed)
        raise ValueError(
            f"dense format {settings.get('precision')!r} has no setting {unknown[0]!r}; "
            f"valid: {valid}"
        )


def _mlp_key(mlp: str, i: int, what: str) -> str:
    return f"{DENSE_PREFIX}{mlp}.layers.{i}.{what}"


def _other_parameters(model: DLRM) -> dict[str, torch.Tensor]:
    """``dense_parameters`` outside the MLPs (DCN layers, a first-order dense weight)."""
    mlps = tuple(f"{m}." for m in MLP_MODULES)
    return {n: t for n, t in dense_parameters(model).items() if not n.startswith(mlps)}


def _interaction(model: DLRM, settings: Mapping[str, Any]) -> str:
    """The ``interaction`` setting of a lower format: given, or the model's default.

    Raises:
        ValueError: for an unknown value, or ``bf16`` for an interaction without a BF16
            version (DCN).
    """
    has_bf16 = bf16_interaction(model.inter_arch) is not None
    value = settings.get("interaction")
    if value is None:
        return "bf16" if has_bf16 else "fp32"
    if value not in INTERACTION_PRECISIONS:
        raise ValueError(
            f"unknown dense setting interaction={value!r}; valid: {list(INTERACTION_PRECISIONS)}"
        )
    if value == "bf16" and not has_bf16:
        raise ValueError(
            f"dense setting interaction='bf16': the model's {type(model.inter_arch).__name__} "
            "has no BF16 version (only the dot interaction has); use 'fp32'"
        )
    return str(value)


def _load_interaction(model: DLRM, settings: Mapping[str, Any]) -> None:
    """Swap ``model``'s interaction for its BF16 version where the settings say so."""
    if _interaction(model, settings) == "bf16":
        swapped = bf16_interaction(model.inter_arch)
        assert isinstance(swapped, Interaction)  # _interaction checked that one exists
        model.inter_arch = swapped


class _FP32:
    """Every dense parameter as trained, run by the model's own modules."""

    def complete_settings(
        self, model: DLRM, settings: Mapping[str, Any], calibration: Iterable[Batch] | None
    ) -> dict[str, Any]:
        _check_keys(settings, ())
        return dict(settings)

    def save(self, model: DLRM, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        out = {DENSE_PREFIX + n: t.float() for n, t in _other_parameters(model).items()}
        for mlp in MLP_MODULES:
            w = mlp_weights(getattr(model, mlp))
            for i, (weight, bias) in enumerate(zip(w.weights, w.biases)):
                out[_mlp_key(mlp, i, "weight")] = weight.float()
                out[_mlp_key(mlp, i, "bias")] = bias.float()
        return out

    def load(
        self, model: DLRM, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        load_dense_parameters(model, tensors)


def _stored(tensors: Mapping[str, torch.Tensor], key: str, like: torch.Tensor) -> torch.Tensor:
    """``tensors[key]``, checked against the shape and dtype of ``like``."""
    if key not in tensors:
        raise ValueError(f"dense tensor {key!r} is missing from the model file")
    src = tensors[key]
    if src.shape != like.shape or src.dtype != like.dtype:
        raise ValueError(
            f"dense tensor {key!r}: {tuple(src.shape)} {src.dtype} in the model file, "
            f"expected {tuple(like.shape)} {like.dtype}"
        )
    return src


def _read_mlp(
    model: DLRM,
    tensors: Mapping[str, torch.Tensor],
    mlp: str,
    stored: Callable[[MLPWeights, int], Mapping[str, torch.Tensor]],
) -> dict[str, list[torch.Tensor]]:
    """Each stored tensor of ``mlp``'s layers, checked against what ``stored`` names.

    ``stored(shape, i)`` gives ``{suffix: tensor of the expected shape and dtype}`` for
    layer ``i`` of the freshly built MLP; the result is ``{suffix: [tensor per layer]}``.
    """
    shape = mlp_weights(getattr(model, mlp))
    out: dict[str, list[torch.Tensor]] = {}
    for i in range(len(shape.weights)):
        for what, like in stored(shape, i).items():
            out.setdefault(what, []).append(_stored(tensors, _mlp_key(mlp, i, what), like))
    return out


def _load_others(model: DLRM, tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in _other_parameters(model).items():
            param.copy_(_stored(tensors, DENSE_PREFIX + name, param.float()))


def _fp32_layer(shape: MLPWeights, i: int) -> dict[str, torch.Tensor]:
    return {"weight": shape.weights[i], "bias": shape.biases[i]}


def _is_fp32(shape: MLPWeights, i: int) -> bool:
    return i >= shape.num_low


class _BF16:
    """BF16 MLPs (``QuantBF16MLP``, logit layer FP32), BF16 dot-interaction products."""

    def complete_settings(
        self, model: DLRM, settings: Mapping[str, Any], calibration: Iterable[Batch] | None
    ) -> dict[str, Any]:
        _check_keys(settings, ("matmul", "interaction"))
        matmul = BF16Matmul.parse(settings.get("matmul", BF16Matmul.AUTO.value))
        return {**settings, "matmul": matmul.value, "interaction": _interaction(model, settings)}

    def save(self, model: DLRM, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        out = {DENSE_PREFIX + n: t.float() for n, t in _other_parameters(model).items()}
        for mlp in MLP_MODULES:
            w = mlp_weights(getattr(model, mlp))
            for i, (weight, bias) in enumerate(zip(w.weights, w.biases)):
                dtype = torch.float32 if _is_fp32(w, i) else torch.bfloat16
                out[_mlp_key(mlp, i, "weight")] = weight.to(dtype)
                out[_mlp_key(mlp, i, "bias")] = bias.to(dtype)
        return out

    def load(
        self, model: DLRM, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        _load_others(model, tensors)
        _load_interaction(model, settings)
        matmul = BF16Matmul.parse(str(settings.get("matmul", BF16Matmul.AUTO.value)))

        def stored(shape: MLPWeights, i: int) -> dict[str, torch.Tensor]:
            dtype = torch.float32 if _is_fp32(shape, i) else torch.bfloat16
            return {k: v.to(dtype) for k, v in _fp32_layer(shape, i).items()}

        for mlp in MLP_MODULES:
            shape = mlp_weights(getattr(model, mlp))
            read = _read_mlp(model, tensors, mlp, stored)
            weights = MLPWeights(
                weights=tuple(t.float() for t in read["weight"]),
                biases=tuple(t.float() for t in read["bias"]),
                final_activation=shape.final_activation,
                fp32_last_layer=shape.fp32_last_layer,
            )
            setattr(model, mlp, QuantBF16MLP(weights, matmul=matmul))


class _Int8:
    """INT8 MLPs (``QuantInt8MLP``, dynamic or static), BF16 dot-interaction products."""

    def complete_settings(
        self, model: DLRM, settings: Mapping[str, Any], calibration: Iterable[Batch] | None
    ) -> dict[str, Any]:
        _check_keys(settings, ("activations", "qparams", "interaction"))
        mode = settings.get("activations", DEFAULT_INT8_ACTIVATIONS)
        if mode not in ACTIVATION_MODES:
            raise ValueError(
                f"unknown INT8 activation mode {mode!r}; valid: {sorted(ACTIVATION_MODES)}"
            )
        out = {
            "precision": settings["precision"],
            "activations": mode,
            "interaction": _interaction(model, settings),
        }
        if mode == "static":
            out["qparams"] = _calibrate(model, calibration)
        return out

    def save(self, model: DLRM, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        out = {DENSE_PREFIX + n: t.float() for n, t in _other_parameters(model).items()}
        for mlp in MLP_MODULES:
            w = int8_weights(getattr(model, mlp))
            for i, (codes, scale, bias) in enumerate(zip(w.codes, w.scales, w.biases)):
                out[_mlp_key(mlp, i, "weight_int8")] = codes
                out[_mlp_key(mlp, i, "weight_scale")] = scale
                out[_mlp_key(mlp, i, "bias")] = bias
            if w.last is not None:
                out[_mlp_key(mlp, len(w.codes), "weight")] = w.last[0]
                out[_mlp_key(mlp, len(w.codes), "bias")] = w.last[1]
        return out

    def load(
        self, model: DLRM, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        _load_others(model, tensors)
        _load_interaction(model, settings)
        mode = str(settings.get("activations"))
        qparams = settings.get("qparams") or {}

        def stored(shape: MLPWeights, i: int) -> dict[str, torch.Tensor]:
            if _is_fp32(shape, i):
                return _fp32_layer(shape, i)
            out_features = shape.weights[i].shape[0]
            return {
                "weight_int8": shape.weights[i].to(torch.int8),
                "weight_scale": torch.empty(out_features),
                "bias": shape.biases[i],
            }

        for mlp in MLP_MODULES:
            shape = mlp_weights(getattr(model, mlp))
            read = _read_mlp(model, tensors, mlp, stored)
            n = shape.num_low
            last = (read["weight"][-1], read["bias"][n]) if shape.fp32_last_layer else None
            weights = Int8Weights(
                codes=tuple(read["weight_int8"]),
                scales=tuple(read["weight_scale"]),
                biases=tuple(read["bias"][:n]),
                last=last,
                final_activation=shape.final_activation,
            )
            where = f"dense settings qparams[{mlp!r}]"
            boundaries = [
                ActivationQParams.from_json(v, f"{where}[{k}]")
                for k, v in enumerate(qparams.get(mlp, []) if mode == "static" else [])
            ]
            setattr(model, mlp, QuantInt8MLP(weights, activations=mode, qparams=boundaries))


def _calibrate(model: DLRM, calibration: Iterable[Batch] | None) -> dict[str, Any]:
    """``{mlp: [[scale, zero point], ...]}``: each MLP's boundaries over ``calibration``.

    The model runs as it is (its current dense layers) over every batch; each MLP's
    input is caught on its way in and run through the MLP's FP32 layers.

    Raises:
        ValueError: without calibration batches, or with none in ``calibration``.
    """
    if calibration is None:
        raise ValueError(
            "static INT8 activations need calibration batches (quantize_model(..., "
            "calibration=batches)); or use activations='dynamic'"
        )
    ranges = {m: ActivationRanges(mlp_weights(getattr(model, m))) for m in MLP_MODULES}
    hooks = []
    for mlp, r in ranges.items():

        def hook(_module: nn.Module, args: tuple[Any, ...], r: ActivationRanges = r) -> None:
            r.observe(args[0])

        hooks.append(getattr(model, mlp).register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            for batch in calibration:
                model(batch.dense, batch.sparse)
    finally:
        for h in hooks:
            h.remove()
    return {m: [q.to_json() for q in r.qparams()] for m, r in ranges.items()}


def load_dense_parameters(model: DLRM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``dense.<name>`` tensors into ``model``'s dense parameters (every one).

    Raises:
        ValueError: naming the first parameter that is missing or of another shape.
    """
    with torch.no_grad():
        for name, param in dense_parameters(model).items():
            key = DENSE_PREFIX + name
            if key not in tensors:
                raise ValueError(f"dense parameter {key!r} is missing from the model file")
            src = tensors[key]
            if src.shape != param.shape:
                raise ValueError(
                    f"dense parameter {key!r}: {tuple(src.shape)} in the model file, "
                    f"the model has {tuple(param.shape)}"
                )
            param.copy_(src)


#: The dense formats, by ``manifest.dense["precision"]``.
DENSE_FORMATS: dict[str, DenseFormat] = {"fp32": _FP32(), "bf16": _BF16(), "int8": _Int8()}
