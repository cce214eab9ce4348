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
weights live in their own ``FusedEmbeddingBagCollection`` (``rows``): its backward
applies Adagrad to the touched rows in place (``lr``, ``weight_decay``: lazy L2 on the
touched rows, see ``SparseOptimizerSpec``), so no gradient the size of a table exists
and no trainer optimizer has to know about them. The dense weights are an ordinary
parameter: the dense optimizer trains them.

The module's state dict holds the rows (``rows.weights.<table>``) and their Adagrad
state (``optim.<table>.<name>``), so a checkpoint restores both bitwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sparse import PooledEmbeddings, SparseFeatures
from tetrarec.types import OptimizerKind, Precision

__all__ = ["FirstOrder"]

_OPTIM = "optim."  # state-dict prefix of the rows' optimizer state


class FirstOrder(nn.Module):
    """A weight per row of every table and per dense input, summed into one logit.

    Args:
        tables: the model's tables; each gets a dim-1 FP32 copy (same name, rows,
            features and pooling).
        num_dense: dense inputs per sample (0: no dense weights).
        lr: the rows' Adagrad learning rate.
        weight_decay: L2 on the rows a step touches (``SparseOptimizerSpec``).

    Raises:
        ValueError: for no tables, a negative ``num_dense`` or bad optimizer settings.

    Example:
        >>> t = TableConfig(name="t", num_embeddings=10, dim=4)
        >>> fo = FirstOrder([t], num_dense=2, lr=0.1, weight_decay=0.0)
        >>> fo(torch.ones(2, 2), SparseFeatures.from_lists({"t": [[1, 2], [3]]}))
        tensor([0., 0.], grad_fn=<AddBackward0>)
    """

    def __init__(
        self, tables: Sequence[TableConfig], *, num_dense: int, lr: float, weight_decay: float
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("FirstOrder needs at least one table")
        if num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {num_dense}")
        # Imported here: the kernels package compiles its CPU kernel on first use only.
        from tetrarec.kernels import FusedEmbeddingBagCollection

        weights = [
            dataclasses.replace(t, dim=1, precision=Precision.FP32, init_bound=None) for t in tables
        ]
        spec = SparseOptimizerSpec(kind=OptimizerKind.ADAGRAD, lr=lr, weight_decay=weight_decay)
        # seed=0: the rows are zeroed next, and a fixed seed draws nothing from the
        # global RNG (the rest of the model's initialization stays as it is).
        self.rows = FusedEmbeddingBagCollection(weights, spec, seed=0)
        self.rows.load_state_dict(
            {f"weights.{t.name}": torch.zeros(t.num_embeddings, 1) for t in weights}
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
        """``{table: (rows,) FP32}``: every row's weight (a copy)."""
        return {k: v.squeeze(1).clone() for k, v in self.rows.table_weights().items()}

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for table, names in self.rows.optimizer_state().items():
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
        mine = {
            f"{prefix}{_OPTIM}{table}.{name}": (table, name)
            for table, names in self.rows.optimizer_state().items()
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
            self.rows.load_optimizer_state(state)
        except ValueError as e:
            error_msgs.append(f"{prefix}{_OPTIM}: {e}")
