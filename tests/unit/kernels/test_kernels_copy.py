"""``tetrarec::copy_row_runs`` and the sharded collections' column placement built on it,
against plain loops over rows and columns."""

import pytest
import torch

from tetrarec.kernels import ops
from tetrarec.sharding.routing import BlockColumns, place_columns


def _blocks(widths, seed):
    """Blocks of the given widths whose columns, together, are a permutation of the output."""
    perm = torch.randperm(sum(widths), generator=torch.Generator().manual_seed(seed)).tolist()
    out, start = [], 0
    for w in widths:
        out.append(perm[start : start + w])
        start += w
    return out


@pytest.mark.parametrize("widths", [[3, 0, 5], [64, 64], [1], [7, 2, 2, 9]])
@pytest.mark.parametrize("batch", [1, 6])
def test_place_columns_and_its_gradient_follow_the_columns(kernel_path, widths, batch):
    """Bugs caught: a run's source or destination offset, a row stride taken from the wrong
    buffer, blocks read at the wrong offset for batch > 1, a backward that copies the
    forward's way."""
    dst_of = _blocks(widths, seed=sum(widths) + batch)
    total = sum(widths)
    blocks = [BlockColumns.from_columns(d) for d in dst_of]
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(batch * total, generator=gen, requires_grad=True)
    out = place_columns(flat, batch, blocks, total)
    expected = torch.empty(batch, total)
    grad = torch.randn(batch, total, generator=gen)
    expected_grad = torch.empty(batch * total)
    offset = 0
    for w, dst in zip(widths, dst_of):
        block = flat.detach()[offset : offset + batch * w].view(batch, w)
        for b in range(batch):
            for j, c in enumerate(dst):
                expected[b, c] = block[b, j]
                expected_grad[offset + b * w + j] = grad[b, c]
        offset += batch * w
    assert torch.equal(out.detach(), expected)
    out.backward(grad)
    assert torch.equal(flat.grad, expected_grad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.uint8])
def test_copy_row_runs_moves_any_dtype(kernel_path, dtype):
    """Bug caught: byte offsets computed for 4-byte elements only."""
    src = torch.arange(24).to(dtype)
    dst = torch.zeros(20, dtype=dtype)
    # rows of 6 -> rows of 5: columns 1-2 to 0-1, column 5 to 4
    runs = torch.tensor([[1, 6, 0, 5, 2], [5, 6, 4, 5, 1]])
    ops.copy_row_runs(src, dst, runs, 4)
    want = torch.zeros(4, 5, dtype=dtype)
    s = src.view(4, 6)
    want[:, 0:2], want[:, 4] = s[:, 1:3], s[:, 5]
    assert torch.equal(dst.view(4, 5), want)


def test_copy_row_runs_refuses_a_run_past_its_buffer(kernel_path):
    """Bug caught: a wrong run table writing outside the output (memory corruption)."""
    src, dst = torch.zeros(12), torch.zeros(12)
    with pytest.raises(RuntimeError):
        ops.copy_row_runs(src, dst, torch.tensor([[0, 4, 2, 4, 4]]), 3)  # row 2 ends at 14


def test_copy_row_runs_reads_and_writes_views_inside_a_larger_buffer(kernel_path):
    """Bug caught: offsets counted from the start of the storage instead of the tensor's
    first element (a slice of a larger buffer); the portable path, which CUDA tensors
    take, routed a sharded collection's gradient to the wrong columns so."""
    storage = torch.arange(40.0)
    src = storage[7:31]  # (4, 6) rows, starting at element 7 of its storage
    out = torch.full((30,), -1.0)
    dst = out[5:25]  # (4, 5) rows, starting at element 5
    runs = torch.tensor([[1, 6, 0, 5, 2], [5, 6, 4, 5, 1]])
    ops.copy_row_runs(src, dst, runs, 4)
    want = torch.full((4, 5), -1.0)
    s = src.view(4, 6)
    want[:, 0:2], want[:, 4] = s[:, 1:3], s[:, 5]
    assert torch.equal(dst.view(4, 5), want)
    assert torch.equal(out[:5], torch.full((5,), -1.0))  # nothing outside the view
    assert torch.equal(out[25:], torch.full((5,), -1.0))
