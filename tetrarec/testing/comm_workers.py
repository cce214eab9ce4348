"""Rank workers of the collective tests (``tests/distributed/test_comm.py``)."""

from __future__ import annotations

from typing import Any

import torch

from tetrarec.testing.multiprocess import RankContext

__all__ = ["collectives_worker", "raising_worker", "timeout_worker"]


def collectives_worker(ctx: RankContext) -> dict[str, Any]:
    """Run each collective on rank-dependent rows; return what this rank got."""
    r, w, comm = ctx.rank, ctx.world_size, ctx.comm
    out: dict[str, Any] = {}
    # all_to_all_v: rank r sends (q + 1) rows valued 100 r + q to rank q, with autograd.
    send = [q + 1 for q in range(w)]
    recv = [r + 1] * w
    x = torch.cat([torch.full((q + 1, 2), 100.0 * r + q) for q in range(w)]).requires_grad_()
    y = comm.all_to_all_v(x, send_splits=send, recv_splits=recv, label="a2a").wait()
    out["a2a"] = y.detach().clone()
    # Backward: the gradient of each received row is its value; it goes back to the sender.
    torch.autograd.backward(y, y.detach() * 2)
    out["a2a_grad"] = x.grad.clone() if x.grad is not None else None
    # reduce_scatter_v: blocks of 1 + q rows; rank q gets the sum over ranks.
    splits = [1 + q for q in range(w)]
    z = torch.cat([torch.full((1 + q, 3), float(r + 1)) for q in range(w)]).requires_grad_()
    s = comm.reduce_scatter_v(z, splits=splits, label="rs").wait()
    out["rs"] = s.detach().clone()
    torch.autograd.backward(s, torch.full_like(s, float(r + 10)))
    out["rs_grad"] = z.grad.clone() if z.grad is not None else None
    # all_gather_v with sizes r + 1 and all_reduce.
    g = comm.all_gather_v(
        torch.full((r + 1, 2), float(r)), sizes=[q + 1 for q in range(w)], label="ag"
    ).wait()
    out["ag"] = [t.clone() for t in g]
    out["ar"] = comm.all_reduce(torch.tensor([float(r), 1.0]), label="ar").wait()
    out["json"] = comm.all_gather_json({"rank": r, "names": ["a", "b"][: r + 1]}, label="j")
    out["stats"] = {k: (v.calls, v.bytes_sent) for k, v in comm.stats.items()}
    out["alive_after_backward"] = _alive_after_backward(ctx)
    return out


def _alive_after_backward(ctx: RankContext) -> list[str]:
    """Which tensors of an autograd all-to-all and reduce-scatter outlive their step.

    None should: a finished collective that kept its buffers leaked them, one step at a time).
    """
    import gc
    import weakref

    comm, w = ctx.comm, ctx.world_size
    refs: dict[str, weakref.ref[torch.Tensor]] = {}
    x = torch.ones(2 * w, 4, requires_grad=True)
    y = comm.all_to_all_v(x, send_splits=[2] * w, recv_splits=[2] * w, label="leak").wait()
    s = comm.reduce_scatter_v(x * 1, splits=[2] * w, label="leak_rs").wait()
    refs["a2a output"], refs["rs output"] = weakref.ref(y), weakref.ref(s)
    torch.autograd.backward(y.sum() + s.sum())
    del x, y, s
    gc.collect()
    return [name for name, ref in refs.items() if ref() is not None]


def raising_worker(ctx: RankContext) -> None:
    """Rank 1 raises before the collective the others wait in."""
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    ctx.comm.barrier(label="after-refusal")


def timeout_worker(ctx: RankContext) -> None:
    """Rank 0 never joins the barrier; the others must time out with a clear error."""
    if ctx.rank != 0:
        ctx.comm.barrier(label="lonely-barrier")
    else:
        import time

        time.sleep(8)
