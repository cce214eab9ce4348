"""Collectives on gloo ranks against the worked examples of comm/collectives.py."""

import pytest
import torch

from tetrarec.comm import Communicator
from tetrarec.testing import RankFailedError, run_ranks
from tetrarec.testing.comm_workers import collectives_worker, raising_worker, timeout_worker

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_move_and_sum_rows_and_their_gradients(world):
    """Bugs caught: swapped splits, rows in the wrong order, a reduce that drops a rank,
    a backward that returns the gradient to the wrong sender or not at all."""
    res = run_ranks(collectives_worker, world_size=world, timeout_s=120)
    for r, out in enumerate(res):
        expected = torch.cat([torch.full((r + 1, 2), 100.0 * q + r) for q in range(world)])
        assert torch.equal(out["a2a"], expected)
        # x's block for q came back from q, doubled: rows valued 2 * (100 r + q).
        grad = torch.cat([torch.full((q + 1, 2), 2 * (100.0 * r + q)) for q in range(world)])
        assert torch.equal(out["a2a_grad"], grad)
        total = sum(q + 1 for q in range(world))
        assert torch.equal(out["rs"], torch.full((1 + r, 3), float(total)))
        rs_grad = torch.cat([torch.full((1 + q, 3), float(q + 10)) for q in range(world)])
        assert torch.equal(out["rs_grad"], rs_grad)
        assert [t.tolist() for t in out["ag"]] == [[[float(q)] * 2] * (q + 1) for q in range(world)]
        assert out["ar"].tolist() == [float(sum(range(world))), float(world)]
        assert out["json"] == [{"rank": q, "names": ["a", "b"][: q + 1]} for q in range(world)]
        # bytes sent to other ranks: 2 floats per row, (sum of send) - own rows.
        calls, sent = out["stats"]["a2a"]
        assert (calls, sent) == (1, (sum(q + 1 for q in range(world)) - (r + 1)) * 2 * 4)
        # Bug caught: a finished collective kept its buffers in a cycle through C++ that
        # Python's collector cannot break (every training step leaked its pooled rows).
        assert out["alive_after_backward"] == []


def test_a_failing_rank_fails_the_run_with_its_traceback():
    with pytest.raises(RankFailedError, match="rank 1 refuses"):
        run_ranks(raising_worker, world_size=2, timeout_s=60, collective_timeout_s=5)


def test_a_missing_rank_times_out_with_a_clear_error():
    with pytest.raises(RankFailedError, match=r"lonely-barrier.*timed out|timed out"):
        run_ranks(timeout_worker, world_size=2, timeout_s=60, collective_timeout_s=3)


def test_world_of_one_needs_no_process_group():
    comm = Communicator.single()
    x = torch.arange(6.0).view(3, 2).requires_grad_()
    y = comm.all_to_all_v(x, send_splits=[3], recv_splits=[3], label="a").wait()
    y.sum().backward()
    assert torch.equal(y, x.detach())
    assert torch.equal(x.grad, torch.ones(3, 2))
    assert torch.equal(comm.reduce_scatter_v(x.detach(), splits=[3], label="r").wait(), x.detach())
    with pytest.raises(ValueError, match="send_splits"):
        comm.all_to_all_v(x, send_splits=[1, 2], recv_splits=[3], label="a")
