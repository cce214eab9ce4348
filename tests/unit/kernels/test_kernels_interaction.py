"""tetrarec::dot_interaction: compiled CPU kernel and portable path against the plain
formulation, gradients, determinism, layout and input checks."""

import pytest
import torch

from tetrarec.kernels import ops, reference
from tetrarec.models.interaction import dot_interaction_reference

SHAPES = [(64, 26, 64), (7, 3, 5), (33, 40, 16), (5, 1, 9), (1, 8, 72)]


def _inputs(batch, features, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, generator=gen)
    e = torch.randn(batch, features * dim, generator=gen)
    g = torch.randn(batch, dim + features * (features + 1) // 2, generator=gen)
    return x, e, g


def _run(fn, x, e, g):
    xi, ei = x.clone().requires_grad_(), e.clone().requires_grad_()
    out = fn(xi, ei)
    out.backward(g)
    return out.detach(), xi.grad, ei.grad


@pytest.mark.parametrize(("batch", "features", "dim"), SHAPES)
def test_interaction_matches_the_plain_formulation(kernel_path, batch, features, dim):
    x, e, g = _inputs(batch, features, dim)
    got = _run(ops.dot_interaction, x, e, g)
    # the oracle in float64: both FP32 paths must sit within FP32 rounding of it
    want = _run(dot_interaction_reference, x.double(), e.double(), g.double())
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=2e-5)


def test_interaction_layout_is_dense_then_lower_triangle_row_major(kernel_path):
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    e = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0]])
    out = ops.dot_interaction(x, e)
    assert out[0, :4].tolist() == x[0].tolist()
    # pairs (e0,x), (e1,x), (e1,e0), (e2,x), (e2,e0), (e2,e1)
    assert out[0, 4:].tolist() == [2.0, 0.0, 0.0, 5.0, 10.0, 0.0]


def test_interaction_compiled_is_bitwise_deterministic_across_thread_counts(kernel_path):
    x, e, g = _inputs(300, 26, 64, seed=3)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            runs.append(_run(ops.dot_interaction, x, e, g))
    finally:
        torch.set_num_threads(before)
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            assert torch.equal(a, b)


def test_interaction_other_dtypes_take_the_portable_path_and_gradcheck():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    e = torch.randn(3, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    assert ops.dot_interaction(x, e).dtype == torch.float64
    assert torch.autograd.gradcheck(ops.dot_interaction, (x, e))


def test_interaction_portable_backward_is_the_symmetric_product():
    x, e, g = _inputs(4, 3, 5, seed=5)
    gx, ge = reference.dot_interaction_backward(g, x, e)
    c = torch.cat((x.unsqueeze(1), e.view(4, 3, 5)), dim=1).double()  # (B, n, D)
    rows, cols = torch.tril_indices(4, 4, offset=-1)
    sym = torch.zeros(4, 4, 4, dtype=torch.float64)
    sym[:, rows, cols] = g[:, 5:].double()
    sym = sym + sym.transpose(1, 2)
    want = torch.bmm(sym, c)
    tol = {"rtol": 1e-5, "atol": 1e-5}  # FP32 result against the float64 formula
    torch.testing.assert_close(gx.double(), g[:, :5].double() + want[:, 0], **tol)
    torch.testing.assert_close(ge.double(), want[:, 1:].reshape(4, 15), **tol)


def test_interaction_compiled_kernel_rejects_mismatched_widths(kernel_path):
    if kernel_path != "compiled":
        pytest.skip("the check is the compiled kernel's")
    from tetrarec.kernels._build import compiled_cpu_kernels

    ext = compiled_cpu_kernels()
    with pytest.raises(RuntimeError, match="embeddings must be"):
        ext.dot_interaction_forward(torch.zeros(2, 4), torch.zeros(2, 6))


def test_round_to_bf16_matches_torch_conversion_on_every_kind_of_value(kernel_path):
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)  # every exponent, denormals, NaN, inf
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028234663852886e38]
    x = torch.cat((x, torch.tensor(special), torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])))
    out = torch.empty_like(x)
    ops.round_to_bf16_out(x, out)
    want = x.to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0 too
    ops.round_to_bf16_out(x, x)  # in place
    assert torch.equal(x[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_interaction_cuda_runs_the_portable_path_and_matches_cpu():
    x, e, g = _inputs(64, 26, 64, seed=11)
    cpu = _run(ops.dot_interaction, x, e, g)
    cuda = _run(ops.dot_interaction, x.cuda(), e.cuda(), g.cuda())
    for a, b in zip(cuda, cpu, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)
    out = torch.empty_like(x.cuda())
    ops.round_to_bf16_out(x.cuda(), out)
    assert torch.equal(out.cpu(), x.to(torch.bfloat16).float())
