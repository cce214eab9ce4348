"""DLRM / DLRM-DCNv2: shapes, interaction parity, cross-layer formula, seeds, BF16, training."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from tetrarec.embedding import EmbeddingBagCollection, TableConfig
from tetrarec.models import (
    DLRM,
    MLP,
    DCNInteraction,
    DLRMConfig,
    DotInteraction,
    InteractionImpl,
    LowRankCrossNet,
    ModelArch,
    build_model,
    dot_interaction_reference,
)
from tetrarec.sparse import SparseFeatures

B, F, D = 16, 3, 8


def _tables(num_features: int = F, dim: int = D, rows: int = 50) -> list[TableConfig]:
    return [TableConfig(name=f"t{i}", num_embeddings=rows, dim=dim) for i in range(num_features)]


def _features(gen: torch.Generator, num_features: int = F, rows: int = 50) -> SparseFeatures:
    lengths = torch.randint(0, 4, (num_features * B,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    keys = tuple(f"t{i}" for i in range(num_features))
    return SparseFeatures.from_lengths(keys, values, lengths)


def _config(arch: str = "dlrm", **kw: object) -> DLRMConfig:
    base: dict[str, object] = {
        "num_dense": 5,
        "bottom_mlp": (16, D),
        "top_mlp": (16, 1),
        "arch": arch,
        "dcn_layers": 2,
        "dcn_low_rank": 4,
        "seed": 3,
    }
    base.update(kw)
    return DLRMConfig(**base)  # type: ignore[arg-type]


def _model(arch: str, **kw: object) -> DLRM:
    return build_model(_config(arch, **kw), EmbeddingBagCollection(_tables(), seed=0))


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_models_output_shapes(arch: str) -> None:
    gen = torch.Generator().manual_seed(0)
    model = _model(arch)
    logits = model(torch.randn(B, 5, generator=gen), _features(gen))
    assert logits.shape == (B,)
    assert logits.dtype == torch.float32
    expected_inter = D + F * (F + 1) // 2 if arch == "dlrm" else (F + 1) * D
    assert model.inter_arch.out_features == expected_inter
    assert model.over_arch.layers[0].in_features == expected_inter


@pytest.mark.parametrize(
    ("num_dense", "shape"),
    [(0, (B, 3)), (5, (B, 4)), (5, (B + 1, 5)), (5, (B,))],
    ids=["dense-given-to-a-model-without", "narrow", "another-batch", "1-d"],
)
def test_models_refuse_dense_features_off_the_config(
    num_dense: int, shape: tuple[int, ...]
) -> None:
    """With ``num_dense = 0`` real dense features were silently dropped (the model read
    a constant 1); a wrong width or batch size failed deep in torch ("mat1 and mat2
    shapes cannot be multiplied", "embeddings must be (B, F*D)") naming no setting."""
    gen = torch.Generator().manual_seed(0)
    model = _model("dlrm", num_dense=num_dense)
    expected = f"dense features {tuple(shape)}: expected (batch, num_dense) = ({B}, {num_dense})"
    with pytest.raises(ValueError, match=re.escape(expected)):
        model(torch.randn(*shape, generator=gen), _features(gen))
    model(torch.randn(B, num_dense, generator=gen), _features(gen))


def test_models_interaction_layout_is_lower_triangle_row_major() -> None:
    # x = e0 = e1 = ... chosen so each dot product is identifiable: rows are one-hot.
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    e = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0]])
    out = dot_interaction_reference(x, e)
    # pairs (e0,x), (e1,x), (e1,e0), (e2,x), (e2,e0), (e2,e1)
    assert out[0, 4:].tolist() == [2.0, 0.0, 0.0, 5.0, 10.0, 0.0]
    assert out[0, :4].tolist() == x[0].tolist()


@pytest.mark.parametrize(("batch", "features", "dim"), [(16, 3, 8), (7, 26, 16), (1, 1, 4)])
def test_models_fast_interaction_matches_reference(batch: int, features: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    e = torch.randn(batch, features * dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(batch, dim + features * (features + 1) // 2, generator=gen).double()
    outs, grads = [], []
    for impl in InteractionImpl:
        xi, ei = x.clone().requires_grad_(), e.clone().requires_grad_()
        inter = DotInteraction(num_features=features, dim=dim, impl=impl)
        # float64 in, FP32 compute: compare in FP32 tolerance.
        out = inter(xi, ei)
        out.backward(grad.float())
        outs.append(out.detach())
        grads.append((xi.grad, ei.grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


def test_models_fast_interaction_gradcheck() -> None:
    from tetrarec.kernels import ops

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    e = torch.randn(3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops.dot_interaction, (x, e))


def test_models_cross_layer_matches_formula() -> None:
    gen = torch.Generator().manual_seed(4)
    net = LowRankCrossNet(6, num_layers=2, low_rank=3, generator=gen)
    with torch.no_grad():
        for b in net.biases:
            b.normal_(generator=gen)  # non-zero so the bias term is checked
    x0 = torch.randn(5, 6, generator=gen)
    x = x0
    for v, w, b in zip(net.v_kernels, net.w_kernels, net.biases):
        x = x0 * (x @ v.T @ w.T + b) + x  # x_{l+1} = x0 * (W (V x_l) + b) + x_l
    torch.testing.assert_close(net(x0), x)


def test_models_dcn_interaction_crosses_concatenated_input() -> None:
    gen = torch.Generator().manual_seed(5)
    inter = DCNInteraction(num_features=2, dim=3, num_layers=1, low_rank=2, generator=gen)
    x, e = torch.randn(4, 3, generator=gen), torch.randn(4, 6, generator=gen)
    torch.testing.assert_close(inter(x, e), inter.crossnet(torch.cat((x, e), dim=1)))


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_models_init_is_deterministic_by_seed(arch: str) -> None:
    a, b = _model(arch, seed=7), _model(arch, seed=7)
    torch.manual_seed(123)  # the global RNG must not matter
    c = _model(arch, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    dense_keys = [k for k in sa if not k.startswith("embeddings.")]
    assert any(not torch.equal(sa[k], sc[k]) for k in dense_keys)


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_models_bf16_dense_path_is_close_to_fp32(arch: str) -> None:
    gen = torch.Generator().manual_seed(6)
    dense, sparse = torch.randn(B, 5, generator=gen), _features(gen)
    fp32 = _model(arch)
    bf16 = _model(arch, dense_precision="bf16")
    bf16.load_state_dict(fp32.state_dict())
    out32, out16 = fp32(dense, sparse), bf16(dense, sparse)
    assert out16.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    torch.testing.assert_close(out16, out32, rtol=0.05, atol=0.05)
    # The logit layer runs in FP32: logits are not rounded to BF16's 8 significant bits.
    assert not torch.equal(out16, out16.bfloat16().float())
    out16.sum().backward()
    w = bf16.over_arch.layers[0].weight
    assert w.grad is not None
    assert w.grad.dtype == torch.float32
    assert torch.isfinite(w.grad).all()


def test_models_embedding_dim_mismatch_raises() -> None:
    ebc = EmbeddingBagCollection(_tables(dim=4), seed=0)
    with pytest.raises(ValueError, match="bottom MLP's output 8"):
        DLRM(_config("dlrm"), ebc)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"top_mlp": (8, 2)}, "end in 1"),
        ({"bottom_mlp": ()}, "positive layer sizes"),
        ({"dense_precision": "int8"}, "not supported"),
        ({"arch": "wide"}, "unknown model arch"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ({"dropout": -0.1}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_models_config_rejects_bad_values(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_models_dcn_v2_config_has_mlperf_sizes() -> None:
    cfg = DLRMConfig.dcn_v2()
    assert cfg.arch is ModelArch.DCN
    assert (cfg.dcn_layers, cfg.dcn_low_rank) == (3, 512)
    assert cfg.top_mlp == (1024, 1024, 512, 256, 1)


@pytest.fixture
def one_thread() -> Iterator[None]:
    # These tensors are tiny; on a busy 2-core machine every 2-thread parallel region
    # (embedding_bag, sparse add) can wait a scheduler slice, turning 0.1 s into seconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch.optim.Adagrad, sparse grads
@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
@pytest.mark.usefixtures("one_thread")
def test_models_train_loss_goes_down(arch: str) -> None:
    # A learnable problem: the label is whether feature t0's id is below 25 or the
    # first dense value is positive.
    gen = torch.Generator().manual_seed(9)
    model = _model(arch)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batches = []
    for _ in range(3):
        dense = torch.randn(B, 5, generator=gen)
        ids = torch.randint(0, 50, (F * B,), generator=gen)
        sparse = SparseFeatures.from_lengths(
            tuple(f"t{i}" for i in range(F)), ids, torch.ones(F * B, dtype=torch.int64)
        )
        labels = ((ids[:B] < 25) | (dense[:, 0] > 0)).float()
        batches.append((dense, sparse, labels))
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def epoch_loss() -> float:
        with torch.no_grad():
            return sum(float(loss_fn(model(d, s), y)) for d, s, y in batches) / len(batches)

    before = epoch_loss()
    for _ in range(6):
        for d, s, y in batches:
            opt.zero_grad()
            loss_fn(model(d, s), y).backward()
            opt.step()
    after = epoch_loss()
    assert after < 0.7 * before, (before, after)


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_models_interaction_rejects_wrong_widths(arch: str) -> None:
    inter = (
        DotInteraction(num_features=3, dim=4)
        if arch == "dlrm"
        else DCNInteraction(num_features=3, dim=4, num_layers=1, low_rank=2)
    )
    with pytest.raises(ValueError, match=r"expected dense \(B, 4\) and embeddings \(B, 12\)"):
        inter(torch.zeros(2, 4), torch.zeros(2, 8))


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
@pytest.mark.parametrize(("features", "dim"), [(0, 4), (3, 0)])
def test_models_interaction_rejects_non_positive_sizes(arch: str, features: int, dim: int) -> None:
    def build() -> object:
        if arch == "dlrm":
            return DotInteraction(num_features=features, dim=dim)
        return DCNInteraction(num_features=features, dim=dim, num_layers=1, low_rank=2)

    with pytest.raises(ValueError, match="need num_features > 0 and dim > 0"):
        build()


class _TwoStepEmbeddings(EmbeddingBagCollection):
    """The reference collection with ``start``: records when pooling starts and is waited."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(_tables(), seed=0)
        self.log = log

    def start(self, features: SparseFeatures) -> _Waitable:
        self.log.append("start")
        return _Waitable(self(features), self.log)


class _Waitable:
    def __init__(self, pooled: object, log: list[str]) -> None:
        self.pooled, self.log = pooled, log

    def wait(self) -> object:
        self.log.append("wait")
        return self.pooled


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_models_start_pooling_before_the_bottom_mlp_and_wait_after_it(arch: str) -> None:
    """Bugs caught: the model waits for the pooled rows before its bottom MLP runs (a
    sharded collection's all-to-all then overlaps nothing), or it ignores ``start``; the
    two-step path must give the same logits as the one-call path."""
    log: list[str] = []
    model = build_model(_config(arch), _TwoStepEmbeddings(log))
    model.dense_arch.register_forward_hook(lambda *_: log.append("bottom mlp"))
    gen = torch.Generator().manual_seed(0)
    dense, sparse = torch.randn(B, 5, generator=gen), _features(gen)
    logits = model(dense, sparse)
    assert log == ["start", "bottom mlp", "wait"]
    assert torch.equal(logits, _model(arch)(dense, sparse))


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_models_dropout_acts_in_training_only(arch: str) -> None:
    """Bugs caught: dropout in eval mode (evaluation would be noisy and differ from
    run to run), dropout that never acts, and masks that a seed of the global torch
    RNG does not fix (a checkpoint of that RNG would not resume them)."""
    gen = torch.Generator().manual_seed(0)
    dense, sparse = torch.randn(B, 5, generator=gen), _features(gen)
    plain, dropped = _model(arch), _model(arch, dropout=0.5)
    for (name, a), b in zip(plain.state_dict().items(), dropped.state_dict().values()):
        assert torch.equal(a, b), name  # dropout draws nothing at init
    plain.eval()
    dropped.eval()
    assert torch.equal(plain(dense, sparse), dropped(dense, sparse))
    plain.train()
    dropped.train()
    torch.manual_seed(1)
    first = dropped(dense, sparse)
    torch.manual_seed(1)
    assert torch.equal(dropped(dense, sparse), first)
    assert not torch.equal(dropped(dense, sparse), first)  # the next masks differ
    assert not torch.equal(first, plain(dense, sparse))


def test_mlp_dropout_spares_the_last_layer_output() -> None:
    """Only hidden activations are dropped: a one-layer MLP (the logit layer, or a
    bottom MLP's output) is the same in training mode at any dropout. Bug caught:
    dropout after the last layer (zeroing logits, or the dense vector that meets the
    embeddings in the interaction)."""
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    for final_activation in (True, False):
        one = MLP(6, [5], final_activation=final_activation, dropout=0.9)
        one.train()
        with torch.no_grad():
            want = one.linears[0](x)
            want = torch.relu(want) if final_activation else want
        torch.testing.assert_close(one(x), want, rtol=0, atol=0)
    two = MLP(6, [5, 3], final_activation=False, dropout=0.5, generator=torch.Generator())
    two.train()
    torch.manual_seed(0)
    out = two(x)
    torch.manual_seed(0)
    with torch.no_grad():
        hidden = torch.nn.functional.dropout(torch.relu(two.linears[0](x)), 0.5)
        torch.testing.assert_close(out, two.linears[1](hidden), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1\.5"):
        MLP(6, [5], final_activation=False, dropout=1.5)


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_models_without_dense_features_learn_a_first_order_weight_per_id(arch: str) -> None:
    # Categorical-only data (Avazu): the bottom MLP reads a constant 1. Bugs caught: a
    # (B, 0) input crashing the bottom MLP, the constant's batch size taken from the
    # empty dense tensor, or a bottom MLP that does not train (its output never changes).
    gen = torch.Generator().manual_seed(0)
    model = _model(arch, num_dense=0)
    sparse = _features(gen)
    empty = torch.zeros(B, 0)
    logits = model(empty, sparse)
    assert logits.shape == (B,)
    with pytest.raises(ValueError, match="num_dense must be >= 0"):
        _config(num_dense=-1)
    x_before = model.dense_arch(torch.ones(1, 1)).detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = (torch.arange(B) % 2).float()
    for _ in range(3):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(empty, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(model.dense_arch(torch.ones(1, 1)).detach(), x_before)
