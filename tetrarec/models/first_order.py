"""``FirstOrder``: the linear part of a model, one weight per table row and per dense input.

::

    sparse: SparseFeatures (F features)        dense (B, num_dense)
         |                                          |
         v                                          v
    a dim-1 copy of every table (T tables,     Linear(num_dense -> 1), no bias
    rows as the model's, FP32), pooled         (absent when num_dense = 0)
    as the table pools: (B, F)
         |  sum over features                       |
         +------------------+-----------------------+
                            v
                   first-order logit (B,)

Added to the DLRM's logit (``DLRMConfig.first_order``), it is a logistic regression's
logit on the same features: one weight per hashed id and per dense value. On a few
thousand training rows a tuned logistic regression is close to optimal at first order;
with this term the DLRM's interactions only add to it, instead of having to reproduce
it through the embeddings and the top MLP.

Every weight starts at 0 (the model starts as its interactions alone). The per-row
weights are tables like any other (``first_order_tables``: a dim-1 FP32 copy of each
model table, named ``<table>_first_order``, initialized to 0 by its ``init_bound``), held
in their own ``FusedEmbeddingBagCollection`` (``rows``): its backward applies Adagrad
to the touched rows in place (``lr``, ``weight_decay``: lazy L2 on the touched rows,
see ``SparseOptimizerSpec``), so no gradient the size of a table exists and no trainer
optimizer has to know about them. The dense weights are an ordinary parameter: the
dense optimizer trains them.

Because ``rows`` is a fused collection of named tables, a sharded run plans and shards
it like the model's own collection: the run's tables (``tetrarec.config.model_tables``)
list these tables too, the planner counts them, and ``shard_model`` swaps ``rows`` for
the ``ShardedEmbeddingBagCollection`` of their plan. Built on the meta device (a model
that is sharded next), it only describes them.

The module's state dict holds the rows (``rows.*``: the collection's, sharded or not)
and their Adagrad state (``optim.<table>.<name>``, by the collection's local table
names), so a checkpoint restores both bitwise; a sharded run's ranks each save their
own blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sparse import PooledEmbeddings, SparseFeatures
from tetrarec.types import OptimizerKind, Precision

__all__ = ["FIRST_ORDER_SUFFIX", "FirstOrder", "first_order_optimizer", "first_order_tables"]

_OPTIM = "optim."  # state-dict prefix of the rows' optimizer state


def first_order_optimizer(*, lr: float, weight_decay: float) -> SparseOptimizerSpec:
    """The rule the first-order tables train with: Adagrad, lazy L2 on touched rows.

    (A logistic regression's per-id weights: Adagrad's per-coordinate step suits their
    very different id frequencies.)
    """
    return SparseOptimizerSpec(kind=OptimizerKind.ADAGRAD, lr=lr, weight_decay=weight_decay)


@runtime_checkable
class _FusedTables(Protocol):
    """What the term asks of its rows' collection (unsharded or sharded)."""

    def table_weights(self) -> dict[str, torch.Tensor]: ...

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]: ...

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None: ...


#: A first-order table is named after its model table with this suffix.
FIRST_ORDER_SUFFIX = "_first_order"


def first_order_tables(tables: Sequence[TableConfig]) -> tuple[TableConfig, ...]:
    """The first-order term's tables: one per model table, looked up by its features.

    Each is a dim-1 FP32 copy of its table (same rows, features and pooling), named
    ``<table>_first_order`` and initialized to 0 (``init_bound`` 0, so a collection
    built anywhere, the meta device or a rank's shard, starts at 0).

    >>> [t.name for t in first_order_tables([TableConfig(name="C1", num_embeddings=4, dim=8)])]
    ['C1_first_order']
    """
    return tuple(
        dataclasses.replace(
            t, name=f"{t.name}{FIRST_ORDER_SUFFIX}", dim=1, precision=Precision.FP32, init_bound=0.0
        )
        for t in tables
    )


class FirstOrder(nn.Module):
    """A weight per row of every table and per dense input, summed into one logit.

    Args:
        tables: the model's tables; each gets a dim-1 FP32 copy (``first_order_tables``).
        num_dense: dense inputs per sample (0: no dense weights).
        lr: the rows' Adagrad learning rate.
        weight_decay: L2 on the rows a step touches (``SparseOptimizerSpec``).
        device: where the rows live (``"meta"``: described only, for ``shard_model``).
        rows: a module that pools the term's tables (``first_order_tables(tables)``)
            instead of the fused collection that trains them: an exported model's
            inference collection (``tetrarec.inference``). Its state dict is its own;
            the term saves and loads optimizer state only for rows that have one.

    Raises:
        ValueError: for no tables, a negative ``num_dense`` or bad optimizer settings.

    Example:
        >>> t = TableConfig(name="t", num_embeddings=10, dim=4)
        >>> fo = FirstOrder([t], num_dense=2, lr=0.1, weight_decay=0.0)
        >>> fo(torch.ones(2, 2), SparseFeatures.from_lists({"t": [[1, 2], [3]]}))
        tensor([0., 0.], grad_fn=<AddBackward0>)
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        num_dense: int,
        lr: float,
        weight_decay: float,
        device: torch.device | str | None = None,
        rows: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("FirstOrder needs at least one table")
        if num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {num_dense}")
        # Imported here: the kernels package compiles its CPU kernel on first use only.
        from tetrarec.kernels import FusedEmbeddingBagCollection

        spec = first_order_optimizer(lr=lr, weight_decay=weight_decay)
        # seed=0: the rows start at 0 (init_bound), and a fixed seed draws nothing from
        # the global RNG (the rest of the model's initialization stays as it is).
        self.rows: nn.Module = (
            FusedEmbeddingBagCollection(first_order_tables(tables), spec, seed=0, device=device)
            if rows is None
            else rows
        )
        self.num_dense = num_dense
        self.dense: nn.Linear | None = None
        if num_dense > 0:
            self.dense = nn.Linear(num_dense, 1, bias=False)
            nn.init.zeros_(self.dense.weight)

    def forward(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        """The first-order logit of each sample.

        Args:
            dense: ``(B, num_dense)`` dense features (ignored when ``num_dense`` is 0).
            sparse: the categorical features, keys as the tables'.

        Returns:
            ``(B,)`` FP32: the sum of the looked-up rows' weights, plus the dense
            features' weighted sum.
        """
        pooled: PooledEmbeddings = self.rows(sparse)
        out = pooled.values.sum(dim=1)  # (B, F) -> (B,)
        if self.dense is not None:
            out = out + self.dense(dense.float()).squeeze(1)
        return out

    def row_weights(self) -> dict[str, torch.Tensor]:
        """``{model table: (rows,) FP32}``: every row's weight (a copy; unsharded rows).

        Keyed by the model table's name (``C1``, not ``C1_first_order``).
        """
        weights = self._tables().table_weights()
        return {
            k.removesuffix(FIRST_ORDER_SUFFIX): v.squeeze(1).clone() for k, v in weights.items()
        }

    def _tables(self) -> _FusedTables:
        """``rows``, typed: the fused collection, or what ``shard_model`` swapped in."""
        rows = self.rows
        if not isinstance(rows, _FusedTables):
            raise TypeError(f"FirstOrder.rows is a {type(rows).__name__}, not a fused collection")
        return rows

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not isinstance(self.rows, _FusedTables):
            return  # rows that do not train (an inference collection) have no state
        for table, names in self._tables().optimizer_state().items():
            for name, value in names.items():
                destination[f"{prefix}{_OPTIM}{table}.{name}"] = (
                    value if keep_vars else value.detach()
                )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not isinstance(self.rows, _FusedTables):
            return
        mine = {
            f"{prefix}{_OPTIM}{table}.{name}": (table, name)
            for table, names in self._tables().optimizer_state().items()
            for name in names
        }
        # nn.Module's own loading calls them unexpected (no submodule is named "optim").
        unexpected_keys[:] = [k for k in unexpected_keys if k not in mine]
        unexpected_keys.extend(
            k for k in state_dict if k.startswith(f"{prefix}{_OPTIM}") and k not in mine
        )
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, (table, name) in mine.items():
            if key in state_dict:
                state.setdefault(table, {})[name] = state_dict[key]
            else:
                missing_keys.append(key)
        if sum(len(v) for v in state.values()) < len(mine):
            return  # reported as missing
        try:
            self._tables().load_optimizer_state(state)
        except ValueError as e:
            error_msgs.append(f"{prefix}{_OPTIM}: {e}")
