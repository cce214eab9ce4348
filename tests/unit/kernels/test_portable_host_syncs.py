"""Host synchronisations of one training step on the portable path (what a GPU runs).

A ``TorchFunctionMode`` (``HostSyncCounter``) records every call that makes a device
wait for the host or reads a device value back: ``item``, ``tolist``, ``numpy``,
``__bool__``/``__int__``/``__float__``/``__index__`` of a tensor, ``nonzero`` (but not
``nonzero_static``), ``unique``/``unique_consecutive``/``bincount``/``masked_select``,
boolean-mask indexing, ``repeat_interleave`` without ``output_size``, ``.cpu()``,
``.to("cpu")``; a ``TorchDispatchMode`` under it records the same at the aten level
when no recorded call is in progress (a sync hidden inside another op). On the CPU
none of these waits, but each is a wait on a device, so the count is what a GPU step
would pay.

The ``tetrarec::`` ops are run through their default (any-device) implementation under
the mode (``_portable_op``), as a GPU would run them: a custom op's body is otherwise
invisible to the mode.

Bug caught: a host read added to the portable forward or fused backward (a Python loop
over tables reading ``.tolist()``, an ``int(tensor)``, a ``torch.unique``), which makes
every training step on an accelerator wait on the host again and again.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import ops, reference_batched
from tetrarec.kernels.tbe import FusedEmbeddingBagCollection
from tetrarec.sparse import SparseFeatures
from tetrarec.types import OptimizerKind, PoolingMode, Precision

_T = torch.Tensor
_ALWAYS = {
    _T.item, _T.tolist, _T.numpy, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
    _T.cpu, torch.nonzero, _T.nonzero, torch.unique, _T.unique, torch.unique_consecutive,
    _T.unique_consecutive, torch.bincount, _T.bincount, torch.masked_select,
    _T.masked_select, torch.argwhere, _T.argwhere,
}  # fmt: skip
_ATEN_SYNCS = {
    "aten::nonzero", "aten::_local_scalar_dense", "aten::_unique", "aten::_unique2",
    "aten::unique_consecutive", "aten::unique_dim", "aten::masked_select", "aten::bincount",
}  # fmt: skip


def _is_mask(x: object) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype in (torch.bool, torch.uint8)
    if isinstance(x, (tuple, list)):
        return any(_is_mask(i) for i in x)
    return False


def _syncs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` reads device data back on the host."""
    if func in _ALWAYS:
        return True
    if func in (_T.__getitem__, _T.__setitem__, _T.index_put_, _T.index_put):
        return _is_mask(args[1])  # mask indexing: nonzero inside
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if func is _T.to:  # .to("cpu") / .to(torch.device("cpu")) / .to(other_cpu_tensor)
        target = [a for a in (*args[1:], kwargs.get("device")) if a is not None]
        return any(
            (isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu")
            or (isinstance(a, torch.Tensor) and a.device.type == "cpu")
            for a in target
        )
    return False


def _portable_op(func: Any) -> Any:
    """The default (any-device) implementation of a ``tetrarec::`` op, else None."""
    name = getattr(getattr(func, "_schema", None), "name", "")
    if not name.startswith("tetrarec::"):
        return None
    op = getattr(ops, "_" + name.removeprefix("tetrarec::") + "_op")
    return op._init_fn


class _AtenSyncs(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func._schema.name
        if not self.counter.inside and (
            name in _ATEN_SYNCS or (name.startswith("aten::index") and _is_mask(args[1]))
        ):
            self.counter.record(name)
        return func(*args, **kwargs)


class HostSyncCounter(TorchFunctionMode):
    """Count host-synchronising calls, by name, while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.inside = 0
        self._aten = _AtenSyncs(self)

    def record(self, name: str) -> None:
        self.calls[name] += 1

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._aten.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        super().__exit__(*exc)
        self._aten.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        portable = _portable_op(func)
        if portable is not None:
            with self:  # the op's body, under this mode again
                return portable(*args, **kwargs)
        if not _syncs(func, args, kwargs):
            return func(*args, **kwargs)
        self.record(getattr(func, "__qualname__", str(func)))
        self.inside += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.inside -= 1


#: Host syncs the fused module itself pays per row store and step: it reads the
#: forward's bad-id answer (``[feature, id]``, a host tensor the kernel built from its
#: own one sync) when ``check_bounds`` is on.
_MODULE_SYNCS_PER_STORE = 1


def _collection(kind: OptimizerKind, precisions: tuple[Precision, ...], mean: bool = True):
    pooling = PoolingMode.MEAN if mean else PoolingMode.SUM
    tables = [
        TableConfig(name="a", num_embeddings=50, dim=8, precision=precisions[0],
                    feature_names=("fa", "fa2")),
        TableConfig(name="b", num_embeddings=30, dim=4, precision=precisions[-1],
                    pooling=pooling),
        TableConfig(name="c", num_embeddings=20, dim=8, precision=precisions[0]),
    ]  # fmt: skip
    spec = SparseOptimizerSpec(kind=kind, lr=0.05, weight_decay=0.01)
    return FusedEmbeddingBagCollection(tables, spec, seed=3, stochastic_rounding=True)


def _features(ebc: FusedEmbeddingBagCollection, batch: int = 6) -> SparseFeatures:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (len(ebc.feature_names) * batch,), generator=g)
    lengths[1] = 0  # an empty bag
    rows = {f: t.num_embeddings for t in ebc.tables for f in t.feature_names}
    values = torch.cat([
        torch.randint(0, rows[f], (int(n),), generator=g)
        for f, n in zip(ebc.feature_names, lengths.view(-1, batch).sum(1))
    ])  # fmt: skip
    return SparseFeatures(keys=ebc.feature_names, values=values, lengths=lengths, batch_size=batch)


def _count_step(
    kind: OptimizerKind, precisions: tuple[Precision, ...], weighted: bool = False
) -> tuple[int, int, Counter[str]]:
    """Host syncs of one step: the module's forward half, then its backward half.

    ``pool_ids`` and ``update_ids`` are what the module's autograd function calls; they
    are called here directly because the autograd engine runs a backward with no
    ``__torch_function__`` mode active.
    """
    ebc = _collection(kind, precisions, mean=not weighted)
    sf = _features(ebc)
    psw = torch.rand(sf.values.numel()) if weighted else None
    with HostSyncCounter() as counter:
        out = ebc.pool_ids(sf.values, sf.lengths, psw)  # (B, sum D)
        ebc.update_ids(2 * out, sf.values, sf.lengths, psw, want_psw=weighted)
    return counter.total, len(ebc._stores), counter.calls


MATRIX = [
    (kind, precisions)
    for kind in (
        OptimizerKind.SGD, OptimizerKind.ADAGRAD, OptimizerKind.ROWWISE_ADAGRAD,
        OptimizerKind.ADAM,
    )
    for precisions in ((Precision.FP32,), (Precision.INT8,), (Precision.FP32, Precision.FP16))
]  # fmt: skip


@pytest.mark.parametrize(("kind", "precisions"), MATRIX)
def test_one_training_step_syncs_at_most_the_documented_constant(
    kind: OptimizerKind, precisions: tuple[Precision, ...]
) -> None:
    """Bug caught: a host read per table (or per id) in the portable forward or fused
    backward + update, or one more per step than ``reference_batched.HOST_SYNCS_PER_CALL``
    documents (forward and backward are one call each per row store)."""
    total, stores, calls = _count_step(kind, precisions)
    allowed = stores * (2 * reference_batched.HOST_SYNCS_PER_CALL + _MODULE_SYNCS_PER_STORE)
    assert total <= allowed, f"{total} host syncs in one step (allowed {allowed}): {calls}"


def test_counter_sees_the_syncs_it_names() -> None:
    """Bug caught: a counter that records nothing (the mode never entered, a sync
    spelled another way), which would make the step test pass whatever the kernel."""
    x = torch.arange(6)
    with HostSyncCounter() as counter:
        x.tolist()
        int(x[0])
        bool(x[1] > 0)
        torch.unique(x)
        x[x > 2]
        x.nonzero()
        torch.nonzero_static(x, size=6)  # not a sync: a static size
        torch.repeat_interleave(x, x, output_size=15)  # not a sync
        x.cpu()
        x.to(torch.float32)  # not a sync
    assert counter.total == 7, counter.calls


def test_a_weighted_step_syncs_at_most_the_documented_constant() -> None:
    """Bug caught: a host read in the per-id weights' path (their gradient, their
    scaling of the rows), which the unweighted matrix does not run."""
    total, stores, calls = _count_step(OptimizerKind.ROWWISE_ADAGRAD, (Precision.INT4,), True)
    allowed = stores * (2 * reference_batched.HOST_SYNCS_PER_CALL + _MODULE_SYNCS_PER_STORE)
    assert total <= allowed, f"{total} host syncs in one step (allowed {allowed}): {calls}"
