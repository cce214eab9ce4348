"""Sharded collections and collectives on a real process group of one rank, per device.

A one-rank group runs every collective through the backend (gloo on the CPU, NCCL on a
GPU: the only NCCL group one GPU can hold), so every buffer a collective gets must live
where the backend takes it: NCCL refuses a host tensor. The same test body runs on both
devices; the CUDA cases are marked ``gpu`` and skipped without CUDA.

Tolerance (CUDA against the one-process CPU reference): ``rtol=1e-4, atol=1e-5`` on
outputs, rows and optimizer state: FP32 sums of a few rows, added in another order by
the device's kernels, differ in the last bits only. On the CPU the sharded run equals
the reference bitwise for pure data movement (table-wise) and within 1e-6 otherwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tetrarec.comm import Communicator
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sharding import LookupOptions, ShardedEmbeddingBagCollection, ShardingEnv
from tetrarec.sharding.state_dict import local_blocks
from tetrarec.testing.equivalence import (
    EquivalenceCase,
    compare,
    global_batch,
    rank_slice,
    reference_run,
)
from tetrarec.testing.one_rank import one_rank_group

CUDA = pytest.param(
    ("nccl", "cuda"),
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
    id="nccl-cuda",
)
BACKENDS = [pytest.param(("gloo", "cpu"), id="gloo-cpu"), CUDA]

TABLES = (
    TableConfig(name="a", num_embeddings=11, dim=8, feature_names=("a0", "a1")),
    TableConfig(name="b", num_embeddings=7, dim=6),
    TableConfig(name="c", num_embeddings=5, dim=4, pooling="mean"),
)
ROWWISE_ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.1, weight_decay=0.01)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_collectives_run_on_the_group_and_hand_back_on_the_callers_device(
    tmp_path, backend_device, monkeypatch
):
    """Bugs caught: a host tensor (split sizes, a flag, JSON bytes) sent to NCCL as is; a
    result left on the wire's device for a caller that holds host tensors; a one-rank
    group skipped as if there were none (its backend then never runs)."""
    backend, device = backend_device
    sent: list[tuple[str, torch.device]] = []  # (collective, device of what it sent)

    def spy(name: str, tensor_arg: int) -> None:
        real = getattr(dist, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            sent.append((name, args[tensor_arg].device))
            return real(*args, **kwargs)

        monkeypatch.setattr(dist, name, call)

    spy("all_to_all_single", 1)
    spy("all_gather", 1)
    spy("all_reduce", 0)
    with one_rank_group(tmp_path, backend, device) as comm:
        assert comm.backend == backend
        assert not comm.local
        on_device = torch.arange(6.0, device=comm.device).reshape(3, 2)
        for x in (torch.arange(6.0).reshape(3, 2), on_device):  # host, then device
            got = comm.all_to_all_v(x, send_splits=[3], recv_splits=[3], label="a2a").wait()
            assert got.device == x.device
            assert torch.equal(got.cpu(), x.cpu())
            gathered = comm.all_gather_v(x, sizes=[3], label="ag").wait()
            assert [g.device for g in gathered] == [x.device]
            summed = comm.all_reduce(x, label="ar").wait()
            assert summed.device == x.device
            assert torch.equal(summed.cpu(), x.cpu())
        assert comm.all_gather_json({"rank": 0, "names": ["a"]}, label="json") == [
            {"rank": 0, "names": ["a"]}
        ]
        comm.barrier()
        # Autograd: the gradient's all-to-all comes back on the input's device.
        x = on_device.clone().requires_grad_()
        out = comm.all_to_all_v(x, send_splits=[3], recv_splits=[3], label="grad").wait()
        out.sum().backward()
        assert x.grad is not None
        assert x.grad.device == x.device
        assert torch.equal(x.grad.cpu(), torch.ones(3, 2))
        # Every collective ran through the group's backend, from the group's device.
        assert {name for name, _ in sent} == {"all_to_all_single", "all_gather", "all_reduce"}
        assert {dev for _, dev in sent} == {comm.device}
        assert comm.stats["a2a"].calls == 2


def _sharded_run(
    case: EquivalenceCase, comm: Communicator, types: tuple[str, ...]
) -> dict[str, Any]:
    """The case's steps through a collection sharded over ``comm``'s one rank, on its device."""
    env = ShardingEnv(comm, 1, comm.device)
    plan = case.sharding_plan(1, 1)
    options = LookupOptions(optimizer=case.optimizer, seed=case.seed)
    module = ShardedEmbeddingBagCollection(case.tables, plan, env, options)
    outputs = []
    for step in range(case.steps):
        bags, weights, grad = global_batch(case, step)
        out = module(rank_slice(bags, weights, 0, 1).to(comm.device)).values
        assert out.device == comm.device, types
        outputs.append(out.detach().cpu())
        torch.autograd.backward(out, grad.to(comm.device))
    with torch.no_grad():
        bags, weights, _ = global_batch(case, case.steps)
        outputs.append(module(rank_slice(bags, weights, 0, 1).to(comm.device)).values.cpu())
    return {"outputs": outputs, "weight_grads": [], **local_blocks(module), "cache_stats": {}}


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_every_sharding_type_on_a_one_rank_group_matches_one_process(tmp_path, backend_device):
    """Bugs caught: routing tensors (row starts, ranks, column maps, counts) built on the
    host for ids on a GPU; shards not built on the env's device; a sharded step that
    differs from the one-process reference when its collectives really run."""
    backend, device = backend_device
    kinds = [("table_wise",), ("row_wise",), ("column_wise",), ("data_parallel",)]
    kinds.append(("row_wise", "column_wise", "data_parallel"))
    bad: list[str] = []
    with one_rank_group(tmp_path, backend, device) as comm:
        for types in kinds:
            case = EquivalenceCase(
                name="/".join(types),
                tables=TABLES,
                types=types,
                optimizer=ROWWISE_ADAGRAD,
                weighted=False,
                steps=2,
                exact=device == "cpu" and types == ("table_wise",),
            )
            got = _sharded_run(case, comm, types)
            rtol, atol = (1e-6, 1e-7) if device == "cpu" else (1e-4, 1e-5)
            bad += compare(case, [got], reference_run(case), rtol=rtol, atol=atol)
    assert not bad, "\n".join(bad)
