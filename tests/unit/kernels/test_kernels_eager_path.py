"""The ops' direct path: plain eager CPU calls skip the dispatcher, everything else does not.

``ops._eager_cpu_path`` sends a call straight to the op's CPU kernel only when nothing
needs to see it (no tracing, no dispatch or function mode, plain CPU tensors, no
gradient wanted); it must still bump the version counters of what the op mutates and
name the op in a profile. A path that skipped the op under fake tensors would hand fake
memory to the C++ kernel; one that skipped it for an input needing a gradient would make
``dot_interaction`` silently non-differentiable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tetrarec.kernels import ops


def _recording_path(log: list[str]) -> Callable[..., torch.Tensor]:
    """An ``_eager_cpu_path`` whose op and kernel only record which of them ran."""

    def op(x: torch.Tensor, outs: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        log.append("op")
        return x

    def _probe_cpu(x: torch.Tensor, outs: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        log.append("kernel")
        return x

    return ops._eager_cpu_path(op, _probe_cpu, mutates=("out", "outs"))


class _Logging(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Subclass(torch.Tensor):
    pass


def test_a_plain_eager_cpu_call_runs_the_kernel_and_bumps_what_it_mutates() -> None:
    log: list[str] = []
    call = _recording_path(log)
    x, out, outs = torch.ones(3), torch.ones(3), [torch.ones(2), torch.ones(2)]
    before = (out._version, [t._version for t in outs], x._version)
    call(x, outs, out)
    assert log == ["kernel"]
    assert out._version == before[0] + 1
    assert [t._version for t in outs] == [v + 1 for v in before[1]]
    assert x._version == before[2]  # not mutated: not bumped
    with torch.no_grad():  # a gradient is not wanted: still direct
        call(torch.ones(3, requires_grad=True), outs, out)
    assert log == ["kernel", "kernel"]
    assert call.__name__ == "probe"


@pytest.mark.parametrize(
    "case",
    [
        "kwargs",
        "requires_grad",
        "meta",
        "meta_in_tuple",
        "subclass",
        "dispatch_mode",
        "function_mode",
        "vmap",
    ],
)
def test_calls_that_something_must_see_go_through_the_op(case: str) -> None:
    log: list[str] = []
    call = _recording_path(log)
    x, out, outs = torch.ones(3), torch.ones(3), [torch.ones(2)]
    if case == "kwargs":
        call(x, outs, out=out)
    elif case == "requires_grad":
        call(torch.ones(3, requires_grad=True), outs, out)
    elif case == "meta":
        call(x, [torch.empty(2, device="meta")], out)  # a list element counts too
    elif case == "meta_in_tuple":
        call(x, (torch.empty(2, device="meta"),), out)  # so does a tuple element
    elif case == "subclass":
        call(x, outs, out.as_subclass(_Subclass))
    elif case == "dispatch_mode":
        with _Logging():
            call(x, outs, out)
    elif case == "vmap":  # batched tensors: plain Tensor type and CPU, but no storage
        torch.vmap(lambda row: call(row, outs, out))(torch.ones(2, 3))
    else:
        with TorchFunctionMode():
            call(x, outs, out)
    assert log == ["op"]


def _pool_args(out: torch.Tensor) -> tuple[Any, ...]:
    """A real ``tbe_forward`` call: one table of 4 rows x dim 2, 2 bags of one id."""
    meta = [
        torch.tensor(v, dtype=torch.int64) for v in ([0], [2], [4], [0], [0], [0], [0], [0], [0])
    ]
    weights = torch.arange(8, dtype=torch.float32)
    return (weights, meta, torch.tensor([1, 3]), torch.tensor([1, 1]), None, out, "fp32", True)


def test_the_real_ops_stay_visible_to_modes_and_the_profiler(kernel_path: str) -> None:
    out = torch.zeros(2, 2)
    v = out._version
    ops.tbe_forward(*_pool_args(out))
    assert out.tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert out._version > v
    with _Logging() as mode:
        ops.tbe_forward(*_pool_args(torch.zeros(2, 2)))
    assert any("tetrarec.tbe_forward" in name for name in mode.ops)
    with torch.profiler.profile() as prof:
        ops.tbe_forward(*_pool_args(torch.zeros(2, 2)))
    assert "tetrarec::tbe_forward" in {e.key for e in prof.key_averages()}


def test_fake_tensors_never_reach_the_kernels() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.empty(2, 2)
        bad = ops.tbe_forward(*_pool_args(out))
    assert bad.shape == (2,)


def test_dot_interaction_keeps_its_gradient(kernel_path: str) -> None:
    dense = torch.randn(3, 4, requires_grad=True)
    emb = torch.randn(3, 8, requires_grad=True)
    ops.dot_interaction(dense, emb).sum().backward()
    assert dense.grad is not None
    assert emb.grad is not None
    with torch.no_grad():  # no gradient wanted: the direct path, the same numbers
        direct = ops.dot_interaction(dense, emb)
    assert torch.equal(direct, ops._dot_interaction_op(dense.detach(), emb.detach()))


def test_torch_compile_traces_the_ops_in_one_graph(kernel_path: str) -> None:
    """The direct path's checks must not break a ``torch.compile`` graph: with the
    tracing check after the private dispatch-mode hooks, dynamo failed on them
    (``fullgraph=True`` raised)."""

    def f(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rounded = torch.empty_like(x)
        ops.round_to_bf16_out(x, rounded)
        ops.tbe_forward(*_pool_args(out))
        return ops.dot_interaction(rounded[:, :4], rounded) + out.sum()

    x = torch.randn(3, 8)
    eager_out, compiled_out = torch.zeros(2, 2), torch.zeros(2, 2)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, compiled_out), f(x, eager_out))
    assert torch.equal(compiled_out, eager_out)
