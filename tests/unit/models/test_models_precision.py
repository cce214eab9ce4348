"""BF16 dense path: the emulation on FP32 kernels against native autocast and formulas."""

from __future__ import annotations

import threading

import pytest
import torch

import tetrarec.models.precision as precision
from tetrarec.embedding import EmbeddingBagCollection, TableConfig
from tetrarec.models import DLRM, MLP, DLRMConfig
from tetrarec.models.precision import BF16Matmul, emulated_bf16, linear, round_to_bf16
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_precision_round_to_bf16_is_nearest_even_and_idempotent() -> None:
    x = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-9, -3.0e-3])
    r = round_to_bf16(x)
    # 1 + 2^-8 is the tie between 1 and 1 + 2^-7: to even (1). 1 + 3*2^-8: up to 1 + 2^-6.
    assert r[0] == 1.0
    assert r[1] == 1.0 + 2.0**-6
    assert r[2] == 1.0
    assert r.dtype == torch.float32
    assert torch.equal(round_to_bf16(r), r)


def test_precision_emulated_linear_equals_its_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 24, generator=gen, requires_grad=True)
    w = torch.randn(16, 24, generator=gen, requires_grad=True)
    b = torch.randn(16, generator=gen, requires_grad=True)
    g = torch.randn(32, 16, generator=gen)
    with emulated_bf16():
        y = linear(x, w, b)
    y.backward(g)
    r = round_to_bf16
    xb, wb, gb = r(x.detach()), r(w.detach()), r(g)
    assert torch.equal(y, r(torch.addmm(r(b.detach()), xb, wb.t())))
    assert torch.equal(y, r(y))  # every output is a BF16 value
    assert x.grad is not None
    assert w.grad is not None
    assert b.grad is not None
    assert torch.equal(x.grad, r(gb @ wb))
    assert torch.equal(w.grad, r(gb.t() @ xb))
    assert torch.equal(b.grad, r(gb.sum(0)))


def test_precision_linear_outside_emulation_is_plain_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 5, generator=gen), torch.randn(3, 5, generator=gen)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    with emulated_bf16(), emulated_bf16(enabled=False):
        assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_precision_emulated_mlp_matches_native_autocast_far_closer_than_fp32() -> None:
    gen = torch.Generator().manual_seed(2)
    mlp = MLP(96, (128, 64, 1), final_activation=False, fp32_last_layer=True, generator=gen)
    x = torch.randn(256, 96, generator=gen)

    def run(ctx: object) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        xx = x.clone().requires_grad_()
        mlp.zero_grad()
        with ctx:  # type: ignore[attr-defined]
            y = mlp(xx).float()
        y.sum().backward()
        assert xx.grad is not None
        return y.detach(), xx.grad, [p.grad.clone() for p in mlp.parameters() if p.grad is not None]

    y_nat, gx_nat, gp_nat = run(torch.autocast("cpu", dtype=torch.bfloat16))
    y_emu, gx_emu, gp_emu = run(emulated_bf16())
    y_32, gx_32, _ = run(torch.enable_grad())
    # Native and emulated differ only in the order of FP32 sums (and the rare rounding it
    # flips); FP32 differs from both by BF16's rounding of every operand.
    assert _rel(y_emu, y_nat) < 1e-3 < _rel(y_32, y_nat)
    assert _rel(gx_emu, gx_nat) < 1e-3 < _rel(gx_32, gx_nat)
    for a, b in zip(gp_emu, gp_nat, strict=True):
        assert _rel(a, b) < 2e-3


def test_precision_emulation_is_per_thread_and_restored_after_errors() -> None:
    seen: list[bool] = []
    with emulated_bf16():
        t = threading.Thread(target=lambda: seen.append(precision.bf16_emulation_active()))
        t.start()
        t.join()
        assert precision.bf16_emulation_active()
    assert seen == [False]
    with pytest.raises(RuntimeError), emulated_bf16():
        raise RuntimeError("boom")
    assert not precision.bf16_emulation_active()


@pytest.mark.parametrize(
    ("matmul", "native", "expect"),
    [
        ("native", False, "autocast"),
        ("emulated", True, "emulated"),
        ("auto", True, "autocast"),
        ("auto", False, "emulated"),
    ],
)
def test_precision_context_resolves_native_or_emulated(
    monkeypatch: pytest.MonkeyPatch, matmul: str, native: bool, expect: str
) -> None:
    monkeypatch.setattr(precision, "has_native_bf16", lambda _device: native)
    ctx = precision.dense_precision_context(Precision.BF16, BF16Matmul.parse(matmul), "cpu")
    with ctx:
        autocast = torch.is_autocast_enabled("cpu")
        emulated = precision.bf16_emulation_active()
    assert (autocast, emulated) == (expect == "autocast", expect == "emulated")
    with precision.dense_precision_context(Precision.FP32, BF16Matmul.EMULATED, "cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert not precision.bf16_emulation_active()


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_precision_emulated_dlrm_tracks_native_bf16(arch: str) -> None:
    gen = torch.Generator().manual_seed(3)
    tables = [TableConfig(name=f"t{i}", num_embeddings=40, dim=8) for i in range(3)]
    lengths = torch.randint(0, 4, (3 * 32,), generator=gen)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    sparse = SparseFeatures.from_lengths(("t0", "t1", "t2"), values, lengths)
    dense = torch.randn(32, 5, generator=gen)

    def model(matmul: str, dense_precision: str = "bf16") -> DLRM:
        cfg = DLRMConfig(
            num_dense=5,
            bottom_mlp=(16, 8),
            top_mlp=(16, 1),
            arch=arch,
            dcn_layers=2,
            dcn_low_rank=4,
            dense_precision=dense_precision,
            bf16_matmul=matmul,
            seed=0,
        )
        return DLRM(cfg, EmbeddingBagCollection(tables, seed=0))

    native, emulated = model("native"), model("emulated")
    out_nat, out_emu = native(dense, sparse), emulated(dense, sparse)
    assert out_emu.dtype == torch.float32
    torch.testing.assert_close(out_emu, out_nat, rtol=2e-3, atol=2e-3)
    # ... and BF16 did something: a dense_precision the model ignored would make both
    # of them FP32 and pass the comparison above.
    with torch.no_grad():
        out_32 = model("emulated", "fp32")(dense, sparse)
        assert _rel(out_emu, out_32) > 1e-4
        assert _rel(out_nat, out_32) > 1e-4
    out_emu.sum().backward()
    grads = [p.grad for p in emulated.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_precision_bad_bf16_matmul_names_the_choices() -> None:
    with pytest.raises(ValueError, match="bf16 matmul"):
        DLRMConfig(bf16_matmul="fast")


@pytest.mark.parametrize("fp32_last_layer", [True, False])
def test_precision_mlp_rounding_hints_change_nothing(
    monkeypatch: pytest.MonkeyPatch, fp32_last_layer: bool
) -> None:
    """The MLP skips rounding passes on values it knows are BF16 already: bitwise the
    same outputs and gradients as rounding everything."""
    gen = torch.Generator().manual_seed(9)
    mlp = MLP(40, (32, 16, 8), final_activation=True, fp32_last_layer=fp32_last_layer)
    x = torch.randn(64, 40, generator=gen)
    g = torch.randn(64, 8, generator=gen)

    def run() -> list[torch.Tensor]:
        xx = x.clone().requires_grad_()
        mlp.zero_grad()
        with emulated_bf16():
            y = mlp(xx)
        y.backward(g)
        assert xx.grad is not None
        return [y.detach(), xx.grad, *(p.grad for p in mlp.parameters() if p.grad is not None)]

    hinted = run()
    plain_linear = precision.linear

    def no_hints(*args: torch.Tensor | None, **_hints: bool) -> torch.Tensor:
        return plain_linear(*args)  # type: ignore[arg-type]

    monkeypatch.setattr("tetrarec.models.mlp.linear", no_hints)
    for a, b in zip(hinted, run(), strict=True):
        assert torch.equal(a, b)


def _model_from_run_config(arch: str, dense_precision: str, matmul: str) -> DLRM:
    """The DLRM a run builds from ``model.dlrm.dense_precision`` (the user's setting)."""
    from tetrarec.config import RunConfig
    from tetrarec.train import build_parts

    config = RunConfig().with_overrides(
        [
            "model.num_sparse=3",
            "model.num_embeddings=40",
            "model.embedding=reference",
            "model.dlrm.num_dense=5",
            "model.dlrm.bottom_mlp=[32, 8]",
            "model.dlrm.top_mlp=[32, 16, 1]",
            f"model.dlrm.arch={arch}",
            "model.dlrm.dcn_layers=2",
            "model.dlrm.dcn_low_rank=4",
            f"model.dlrm.dense_precision={dense_precision}",
            f"model.dlrm.bf16_matmul={matmul}",
        ]
    )
    return build_parts(config, num_dense=5).model


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_precision_bf16_setting_changes_the_output_by_bf16_rounding(arch: str) -> None:
    """``model.dlrm.dense_precision = "bf16"`` in a run's config must change the model's
    output, by about BF16's rounding (2^-8 relative per operand): a setting dropped
    anywhere from the config to the forward gives FP32's output bit for bit and fails
    here; a BF16 path that rounded far more (or an FP16 one) fails the upper bound."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 4, (3 * 64,), generator=gen)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    sparse = SparseFeatures.from_lengths(("C1", "C2", "C3"), values, lengths)
    dense = torch.randn(64, 5, generator=gen)
    fp32 = _model_from_run_config(arch, "fp32", "emulated")
    for matmul in ("emulated", "native"):
        bf16 = _model_from_run_config(arch, "bf16", matmul)
        for (name, a), b in zip(fp32.state_dict().items(), bf16.state_dict().values(), strict=True):
            assert torch.equal(a, b), f"{name}: the two runs must start from the same weights"
        with torch.no_grad():
            out32, out16 = fp32(dense, sparse), bf16(dense, sparse)
        assert out16.dtype == torch.float32
        assert 1e-4 < _rel(out16, out32) < 3e-2, matmul
