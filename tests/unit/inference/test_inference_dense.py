"""Dense formats of an exported model: BF16 and INT8 MLPs (tetrarec.inference.dense)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from _quant_tiny_model import held_out_batches, tiny_model, training_batches

from tetrarec.inference import ModelFileError, load, save
from tetrarec.inference.dense import DENSE_FORMATS
from tetrarec.inference.model import InferenceModel
from tetrarec.inference.quantize import QuantSpec, quantize_model
from tetrarec.inference.quantized_interaction import QuantBF16DotInteraction
from tetrarec.inference.quantized_mlp import QuantBF16MLP, QuantInt8MLP
from tetrarec.kernels import reference
from tetrarec.models.interaction import DotInteraction

FORMATS: list[tuple[str, dict[str, Any]]] = [
    ("fp32", {}),
    ("bf16", {}),
    ("bf16", {"matmul": "emulated"}),
    ("int8", {"activations": "dynamic"}),
    ("int8", {"activations": "static"}),
]


@pytest.fixture(scope="module")
def fp32_model() -> InferenceModel:
    return tiny_model(first_order=True)


@pytest.fixture(scope="module")
def calibration(fp32_model: InferenceModel) -> list[Any]:
    return training_batches(fp32_model)


@pytest.fixture(scope="module")
def held_out(fp32_model: InferenceModel) -> Any:
    return held_out_batches(fp32_model)[0]


def _quantized(model: InferenceModel, mlp: str, settings: dict[str, Any], cal: Any) -> Any:
    return quantize_model(model, QuantSpec(mlp=mlp, mlp_settings=settings), calibration=cal)


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
@pytest.mark.parametrize(("mlp", "settings"), FORMATS)
def test_scores_after_save_and_load_are_bitwise_the_same(
    tmp_path: Path, arch: str, mlp: str, settings: dict[str, Any]
) -> None:
    """Catches a format whose load rebuilds other weights, scales or activation qparams
    than save wrote (re-quantizing, rounding a scale through JSON, a lost setting)."""
    model = tiny_model(first_order=True, arch=arch)
    batch = held_out_batches(model)[0]
    quantized = _quantized(model, mlp, settings, training_batches(model))
    before = quantized.logits(batch.dense, batch.sparse)
    save(quantized, tmp_path / "m")
    loaded = load(tmp_path / "m")
    assert loaded.manifest.dense == quantized.manifest.dense
    assert torch.equal(loaded.logits(batch.dense, batch.sparse), before)
    # saved again from the loaded model: the same tensors (no second quantization)
    again = loaded.tensors()
    for key, value in quantized.tensors().items():
        assert torch.equal(again[key], value), key


@pytest.mark.parametrize(
    ("mlp", "settings", "bound"),
    [
        # BF16: 8 significant bits per operand and per activation, FP32 sums.
        ("bf16", {}, 0.02),
        ("bf16", {"matmul": "emulated"}, 0.02),
        # INT8: 7-bit activation codes (reduce_range) at each of the 4 INT8 layers,
        # per-channel 8-bit weights; measured ~4% of the largest logit on this model.
        ("int8", {"activations": "dynamic"}, 0.08),
        ("int8", {"activations": "static"}, 0.08),
    ],
)
def test_lower_mlp_logits_stay_within_a_bound_of_fp32(
    fp32_model: InferenceModel,
    calibration: Any,
    held_out: Any,
    mlp: str,
    settings: dict[str, Any],
    bound: float,
) -> None:
    """Catches wrong scales (a transposed per-channel scale, a wrong zero point), a lost
    bias or ReLU, or a logit layer run in low precision: each moves logits far past
    ``bound`` x the largest FP32 logit."""
    ref = fp32_model.logits(held_out.dense, held_out.sparse)
    out = _quantized(fp32_model, mlp, settings, calibration).logits(held_out.dense, held_out.sparse)
    err = (out - ref).abs().max().item()
    assert err <= bound * ref.abs().max().item()
    assert err > 0  # it did run in the lower precision


def test_int8_weights_are_per_channel_and_the_logit_layer_stays_fp32(
    fp32_model: InferenceModel,
) -> None:
    """Catches one scale per tensor (a row of small weights would lose its bits), or a
    logit layer quantized with the others."""
    q = _quantized(fp32_model, "int8", {"activations": "dynamic"}, None)
    t = q.tensors()
    top0 = fp32_model.tensors()["dense.over_arch.layers.0.weight"]
    assert t["dense.over_arch.layers.0.weight_int8"].dtype == torch.int8
    scale = t["dense.over_arch.layers.0.weight_scale"]
    assert scale.shape == (top0.shape[0],)
    torch.testing.assert_close(scale, top0.abs().amax(1) / 127)
    assert t["dense.over_arch.layers.2.weight"].dtype == torch.float32
    assert "dense.over_arch.layers.2.weight_int8" not in t
    assert isinstance(q.module.over_arch, QuantInt8MLP)
    assert isinstance(q.module.dense_arch, QuantInt8MLP)


def test_bf16_stores_half_the_bytes_and_keeps_the_logit_layer_fp32(
    fp32_model: InferenceModel,
) -> None:
    """Catches BF16 weights stored as FP32 (no saving) or a BF16 logit layer."""
    q = _quantized(fp32_model, "bf16", {}, None)
    t, ref = q.tensors(), fp32_model.tensors()
    assert t["dense.dense_arch.layers.0.weight"].dtype == torch.bfloat16
    assert t["dense.over_arch.layers.2.weight"].dtype == torch.float32
    mlp_bytes = sum(
        v.numel() * v.element_size()
        for k, v in t.items()
        if k.startswith("dense.dense_arch") or k.startswith("dense.over_arch.layers.0")
    )
    ref_bytes = sum(
        v.numel() * v.element_size()
        for k, v in ref.items()
        if k.startswith("dense.dense_arch") or k.startswith("dense.over_arch.layers.0")
    )
    assert mlp_bytes * 2 == ref_bytes
    assert isinstance(q.module.dense_arch, QuantBF16MLP)


def test_requantizing_int8_to_static_keeps_the_stored_weights(
    fp32_model: InferenceModel, calibration: Any
) -> None:
    """Catches an INT8 model quantized again from its dequantized weights (codes and
    scales drift on every pass)."""
    dynamic = _quantized(fp32_model, "int8", {"activations": "dynamic"}, None)
    static = _quantized(dynamic, "int8", {"activations": "static"}, calibration)
    for key, value in dynamic.tensors().items():
        assert torch.equal(static.tensors()[key], value), key


def test_an_int8_model_dequantizes_back_to_fp32(fp32_model: InferenceModel) -> None:
    """Catches an fp32 save that misses the swapped MLPs' weights (a KeyError on load)."""
    q = _quantized(fp32_model, "int8", {}, None)
    back = _quantized(q, "fp32", {}, None)
    assert set(back.tensors()) == set(fp32_model.tensors())
    assert back.manifest.dense == {"precision": "fp32"}


def test_unknown_dense_format_is_a_clear_error(fp32_model: InferenceModel) -> None:
    """Catches an unknown format name silently running FP32."""
    with pytest.raises(ValueError, match=r"dense format 'int4' is not one .*'bf16', 'fp32'"):
        _quantized(fp32_model, "int4", {}, None)


def test_unknown_activation_mode_is_a_clear_error(fp32_model: InferenceModel) -> None:
    """Catches a typo in the activation mode running as the default one."""
    with pytest.raises(ValueError, match=r"unknown INT8 activation mode 'statik'; valid"):
        _quantized(fp32_model, "int8", {"activations": "statik"}, None)


def test_unknown_setting_is_a_clear_error(fp32_model: InferenceModel) -> None:
    """Catches a misspelt setting that would be ignored."""
    with pytest.raises(ValueError, match=r"dense format 'int8' has no setting 'activation'"):
        _quantized(fp32_model, "int8", {"activation": "static"}, None)


def test_static_without_calibration_is_a_clear_error(fp32_model: InferenceModel) -> None:
    """Catches static activations quantized with made-up ranges when no data was given."""
    with pytest.raises(ValueError, match="static INT8 activations need calibration batches"):
        _quantized(fp32_model, "int8", {"activations": "static"}, None)
    with pytest.raises(ValueError, match="calibration saw no batches"):
        _quantized(fp32_model, "int8", {"activations": "static"}, [])


def test_a_model_file_with_an_unknown_activation_mode_is_a_model_file_error(
    fp32_model: InferenceModel,
) -> None:
    """Catches a damaged manifest setting crashing deep inside a kernel on first use."""
    q = _quantized(fp32_model, "int8", {}, None)
    manifest = dataclasses.replace(q.manifest, dense={"precision": "int8", "activations": "x"})
    with pytest.raises(ModelFileError, match="unknown INT8 activation mode 'x'"):
        InferenceModel.from_parts(manifest, q.tensors())


def test_every_registered_format_is_tested() -> None:
    """Catches a format added to DENSE_FORMATS without a round-trip case here."""
    assert {name for name, _ in FORMATS} == set(DENSE_FORMATS)


# -- the BF16 dot interaction of the lower formats --------------------------------------


@pytest.mark.parametrize("mlp", ["bf16", "int8"])
def test_lower_formats_run_the_bf16_dot_interaction_and_record_it(
    fp32_model: InferenceModel, mlp: str
) -> None:
    """Catches a lower format that keeps the FP32 interaction (the batch-scoring
    speed-up lost), forgets to record it in the manifest, or stores tensors for it."""
    q = _quantized(fp32_model, mlp, {}, None)
    assert isinstance(q.module.inter_arch, QuantBF16DotInteraction)
    assert q.manifest.dense["interaction"] == "bf16"
    fp32_interaction = _quantized(fp32_model, mlp, {"interaction": "fp32"}, None)
    assert isinstance(fp32_interaction.module.inter_arch, DotInteraction)
    assert set(q.tensors()) == set(fp32_interaction.tensors())


def test_bf16_interaction_is_the_op_on_the_models_own_inputs(fp32_model: InferenceModel) -> None:
    """Catches a swapped interaction built for another F or D, or one that rounds the
    bottom-MLP output it passes through (the first D columns must be exact)."""
    inter = _quantized(fp32_model, "int8", {}, None).module.inter_arch
    fp32 = fp32_model.module.inter_arch
    assert (inter.num_features, inter.dim, inter.out_features) == (
        fp32.num_features,
        fp32.dim,
        fp32.out_features,
    )
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, fp32.dim, generator=gen)
    e = torch.randn(5, fp32.num_features * fp32.dim, generator=gen)
    out = inter(x, e)
    # the op's compiled kernel sums in another order than its definition: FP32 rounding
    torch.testing.assert_close(out, reference.dot_interaction_bf16_forward(x, e))
    assert torch.equal(out[:, : fp32.dim], x)
    # against FP32: BF16 rounding of both rows, 8 significant bits each
    torch.testing.assert_close(out, fp32(x, e), rtol=2e-2, atol=2e-2 * fp32.dim)


def test_an_int8_model_file_without_the_interaction_setting_runs_the_bf16_one(
    tmp_path: Path, fp32_model: InferenceModel
) -> None:
    """Catches model files written before the setting existed failing to load, or
    loading with the FP32 interaction (their scoring would not speed up)."""
    q = _quantized(fp32_model, "int8", {}, None)
    old = {k: v for k, v in q.manifest.dense.items() if k != "interaction"}
    loaded = InferenceModel.from_parts(dataclasses.replace(q.manifest, dense=old), q.tensors())
    assert isinstance(loaded.module.inter_arch, QuantBF16DotInteraction)
    save(loaded, tmp_path / "m")
    assert isinstance(load(tmp_path / "m").module.inter_arch, QuantBF16DotInteraction)


def test_dcn_keeps_its_cross_layers_and_records_fp32() -> None:
    """Catches a DCN model's cross layers swapped for a dot interaction (wrong width,
    wrong model) or a manifest claiming a BF16 interaction that does not run."""
    model = tiny_model(first_order=True, arch="dcn")
    q = _quantized(model, "int8", {}, None)
    assert type(q.module.inter_arch) is type(model.module.inter_arch)
    assert q.manifest.dense["interaction"] == "fp32"
    with pytest.raises(ValueError, match=r"interaction='bf16'.*has no BF16 version"):
        _quantized(model, "int8", {"interaction": "bf16"}, None)


def test_unknown_interaction_setting_is_a_clear_error(fp32_model: InferenceModel) -> None:
    """Catches a misspelt interaction setting running as the default."""
    with pytest.raises(ValueError, match=r"unknown dense setting interaction='bf8'; valid"):
        _quantized(fp32_model, "bf16", {"interaction": "bf8"}, None)
