"""tetrarec::dot_interaction_bf16: the portable definition, the compiled CPU kernel
(AVX512_BF16 where the CPU has it, rounded FP32 elsewhere) within the bound that the
summation order allows, layout, thread counts and input checks."""

import math

import pytest
import torch

from tetrarec.kernels import ops, reference
from tetrarec.kernels._build import compiled_cpu_kernels

SHAPES = [(64, 26, 64), (33, 26, 16), (7, 3, 5), (5, 1, 9), (1, 8, 72), (3, 47, 33), (4, 15, 2)]


def _inputs(batch, features, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, generator=gen)
    e = torch.randn(batch, features * dim, generator=gen)
    return x, e


def _rows_bf16(x, e):
    b, d = x.shape
    return torch.cat((x.unsqueeze(1), e.view(b, -1, d)), dim=1).to(torch.bfloat16).double()


def _exact_and_magnitude(x, e):
    """The exact pair sums of the BF16-rounded rows and ``sum_k |p_k|``, in float64."""
    c = _rows_bf16(x, e)
    n = c.shape[1]
    rows, cols = torch.tril_indices(n, n, offset=-1)
    exact = torch.bmm(c, c.transpose(1, 2))[:, rows, cols]
    magnitude = torch.bmm(c.abs(), c.abs().transpose(1, 2))[:, rows, cols]
    return exact, magnitude


def _order_bound(dim, magnitude):
    """Two FP32 sums of the same D exact terms in different orders: the kernel's chain of
    D additions (gamma_D) against the definition's pairwise tree (gamma_log2 D)."""
    return (dim + math.ceil(math.log2(max(dim, 1))) + 2) * 2.0**-24 * magnitude


@pytest.mark.parametrize(("batch", "features", "dim"), SHAPES)
def test_portable_definition_is_the_exact_sum_within_its_tree_rounding(batch, features, dim):
    """Catches a definition that rounds other values than the rows to BF16 (the dense
    passthrough, the products), drops a term or pads the tree with non-zeros."""
    x, e = _inputs(batch, features, dim)
    out = reference.dot_interaction_bf16_forward(x, e)
    exact, magnitude = _exact_and_magnitude(x, e)
    assert out.dtype == torch.float32
    assert torch.equal(out[:, :dim], x)
    tree = (math.ceil(math.log2(max(dim, 1))) + 1) * 2.0**-24 * magnitude
    assert ((out[:, dim:].double() - exact).abs() <= tree).all()


@pytest.mark.parametrize("native", [True, False], ids=["avx512bf16", "rounded_fp32"])
@pytest.mark.parametrize(("batch", "features", "dim"), SHAPES)
def test_compiled_kernel_is_within_the_summation_order_bound_of_the_definition(
    native, batch, features, dim
):
    """Catches a compiled kernel that pairs the wrong lanes (BF16 pairs, transpose),
    misses a row or column block, stores past a row's pairs, or rounds differently."""
    ext = compiled_cpu_kernels()
    if ext is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    if native and not ext.dot_interaction_bf16_native():
        pytest.skip("this CPU has no AVX512_BF16")
    x, e = _inputs(batch, features, dim, seed=1)
    got = ext.dot_interaction_bf16_forward(x, e, native)
    want = reference.dot_interaction_bf16_forward(x, e)
    _, magnitude = _exact_and_magnitude(x, e)
    assert got.shape == want.shape
    assert torch.equal(got[:, :dim], x)
    diff = (got[:, dim:].double() - want[:, dim:].double()).abs()
    assert (diff <= _order_bound(dim, magnitude)).all(), float(diff.max())


def test_op_layout_is_dense_then_lower_triangle_row_major(kernel_path):
    """Catches pairs written in another order than the FP32 interaction's (its tests
    fix the layout); the values are BF16 values, so every product is exact."""
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    e = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0]])
    out = ops.dot_interaction_bf16(x, e)
    assert out[0, :4].tolist() == x[0].tolist()
    assert out[0, 4:].tolist() == [2.0, 0.0, 0.0, 5.0, 10.0, 0.0]


def test_op_rounds_the_rows_to_bf16_and_keeps_dense_unrounded(kernel_path):
    """Catches an op that multiplies the FP32 values (no rounding) or rounds the dense
    passthrough: 1 + 2^-9 is not a BF16 value and rounds to 1 (ties to even)."""
    v = 1.0 + 2.0**-9
    x = torch.tensor([[v, 0.0]])
    e = torch.tensor([[v, 0.0]])
    out = ops.dot_interaction_bf16(x, e)
    assert out[0, 0].item() == v
    assert out[0, 2].item() == 1.0  # bf16(v) * bf16(v); FP32 would give 1 + 2^-8 + 2^-18


def test_compiled_op_is_bitwise_the_same_for_any_thread_count(kernel_path):
    """Catches a kernel whose per-thread scratch leaks between samples (a stale C^T
    column) or whose sums depend on how the batch is split."""
    x, e = _inputs(300, 26, 64, seed=3)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            runs.append(ops.dot_interaction_bf16(x, e))
    finally:
        torch.set_num_threads(before)
    for run in runs[1:]:
        assert torch.equal(run, runs[0])


def test_op_rejects_mismatched_widths_in_one_line(kernel_path):
    """Catches a kernel that reads past embeddings that are not (B, F*D)."""
    with pytest.raises((RuntimeError, ValueError), match="embeddings"):
        ops.dot_interaction_bf16(torch.zeros(2, 4), torch.zeros(2, 6))


def test_op_under_fake_tensors_has_the_output_shape():
    """Catches a fake kernel of another shape than the real one (torch.compile, export)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = ops.dot_interaction_bf16(torch.empty(3, 8), torch.empty(3, 40))
    assert tuple(out.shape) == (3, 8 + 15)
    assert out.dtype == torch.float32
