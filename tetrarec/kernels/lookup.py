"""``LocalLookup``: the protocol of a module that pools and trains the tables of one process.

The sharding code runs its lookups through one interface, whatever module holds this
rank's tables: the fused collection (``tbe.py``), the cached one
(``tetrarec.cache``), later a quantized inference collection and a GPU one. It never
asks which it holds.

A lookup is split in steps, so that a caller may pool some samples and update with
others (a data-parallel replica pools its own samples and applies the global batch's
update) or read the update before it happens (column blocks of a row-wise optimizer)::

    forward   prepared = local.prepare(features, admit=training)   (B samples, N ids)
              pooled = local.pooled_lookup(prepared)              (B, sum D), no autograd
    backward  [per column block of a row-wise optimizer, before the update:
               rows, share = local.row_gradient_shares(i, grad, prepared, wd)
               local.add_to_row_state_(i, "sum", rows, delta)]
              local.apply_gradients(grad, prepared)               rows updated in place

``prepare`` is the step that may change the module: the fused collection keeps the
features as they are (``PreparedIds.route`` is ``None``), the cached collection routes
each id to its FP32 slot or its backing row and, with ``admit``, first runs its policy
step (hits and misses counted, victims evicted and written back, misses admitted).
Where a row lives decides where the lookup reads it and where the update writes it, so
a training batch is prepared with ``admit=True`` in *forward*, before its lookup, and the
same ``PreparedIds`` goes to its backward; each backward must run before the next
training forward (which may move the rows: the cached ``apply_gradients`` refuses a
batch whose rows moved). A read-only ``prepare(..., admit=False)`` (evaluation, or a
second view of a batch already admitted) reads the slot maps and changes nothing.

Every rank that holds a local module runs these steps on it; the collectives between
them are the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

from tetrarec.embedding import CacheCounters, TableConfig
from tetrarec.kernels.fused_optim import FusedOptimizer, FusedState
from tetrarec.sparse import PooledEmbeddings, SparseFeatures

__all__ = ["LocalLookup", "PreparedIds"]

RouteT = TypeVar("RouteT")


@dataclass(frozen=True, kw_only=True)
class PreparedIds(Generic[RouteT]):
    """A batch made ready for one local lookup module (``LocalLookup.prepare``).

    Args:
        features: the batch, keys in the module's ``feature_names`` order; its
            ``weights`` are the per-id weights the lookup and the update use.
        route: the module's own routing of the batch (``None`` for the fused collection,
            a ``tetrarec.cache.CacheRoute`` for the cached one); only the module that
            prepared it reads it.
    """

    features: SparseFeatures
    route: RouteT


@runtime_checkable
class LocalLookup(FusedState, CacheCounters, Protocol[RouteT]):
    """Pools and trains one process's tables in steps (call order: module docstring).

    Attributes:
        tables: the local tables, in output order.
        feature_names: the features, in output column order.
        feature_dims: their dims.
        training: ``nn.Module``'s flag: a training forward admits into caches.
        fused_optimizer: the ``torch.optim``-surface object whose hyperparameters every
            update reads (a sharded collection sets its own, shared by its modules).
    """

    tables: tuple[TableConfig, ...]
    feature_names: tuple[str, ...]
    feature_dims: tuple[int, ...]
    training: bool
    fused_optimizer: FusedOptimizer

    def __call__(self, features: SparseFeatures) -> PooledEmbeddings:
        """The steps under autograd: prepare, pool; the backward applies the update."""
        ...

    def prepare(self, features: SparseFeatures, *, admit: bool) -> PreparedIds[RouteT]:
        """Make ``features`` (keys in ``feature_names`` order) ready for the steps below.

        Args:
            features: the batch.
            admit: a training batch: a cache runs its policy step first. ``False`` only
                reads (evaluation, or a batch already admitted).

        Raises:
            ValueError: for keys in another order than ``feature_names``, or per-id
                weights with mean pooling.
        """
        ...

    def pooled_lookup(self, prepared: PreparedIds[RouteT]) -> torch.Tensor:
        """``(B, sum D)`` pooled rows of a prepared batch (forward, without autograd)."""
        ...

    def apply_gradients(
        self, grad_out: torch.Tensor, prepared: PreparedIds[RouteT], *, want_psw: bool = False
    ) -> torch.Tensor | None:
        """Apply the fused update for the gradient ``(B, sum D)`` of a prepared batch.

        Returns:
            ``(N,)`` gradient of the batch's per-id weights when ``want_psw``, else
            ``None``.
        """
        ...

    def row_gradient_shares(
        self,
        table: int,
        grad_out: torch.Tensor,
        prepared: PreparedIds[RouteT],
        weight_decay: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per touched row of ``tables[table]``: ``sum_d g'_d^2`` of the next update.

        Returns:
            ``(rows (U,) int64 ascending and unique; share (U,) FP32)``.
        """
        ...

    def add_to_row_state_(
        self, table: int, key: str, rows: torch.Tensor, delta: torch.Tensor
    ) -> None:
        """Add ``delta[j]`` to the per-row optimizer state ``key`` of row ``rows[j]``."""
        ...

    def table_weights(self) -> dict[str, torch.Tensor]:
        """``{table: (rows, dim) FP32}`` copies of the current rows."""
        ...

    def check_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> object:
        """Raise ``ValueError`` if ``state`` does not fit the module; copy nothing."""
        ...

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``: ``weights.<table>`` rows and ``rounding``."""
        ...
