"""``FusedOptimizer``: the ``torch.optim`` surface of an optimizer fused into backward.

A fused embedding module updates its rows inside its own backward pass, so there is no
gradient to step on. Its optimizer still needs what every optimizer has, so that one
learning-rate schedule, one checkpoint format and one training step drive dense and
embedding optimizers alike::

    param_groups[0]   {"lr", "eps", "betas", "weight_decay", "params"}: read by the
                      module at every backward; a scheduler that sets "lr" changes the
                      next update, exactly as for torch.optim
    step()            nothing to do (the update happened in backward); runs the closure
    zero_grad()       nothing to do (no gradient is ever stored)
    state_dict()      {"state": {table: {name: tensor}}, "param_groups": [...]}: keyed by
                      table name and row, whatever the flat storage layout, and for a
                      sharded module by the shards this rank holds (see ``FusedState``)
    load_state_dict() the exact inverse (bitwise)

The state itself lives in the module (``FusedState``); this object only exposes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.embedding.config import SPARSE_HPARAM_RULES, bad_sparse_hparams
from tetrarec.types import OptimizerKind

__all__ = ["FusedOptimizer", "FusedState"]


class FusedState(Protocol):
    """What owns fused optimizer state: an embedding module (unsharded or sharded)."""

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{table: {state name: tensor}}`` views of the state this module holds."""
        ...

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy ``state`` (as ``optimizer_state`` returns it) into the module."""
        ...

    def storages(self) -> list[torch.Tensor]:
        """The flat row storages (the "parameters" the optimizer updates)."""
        ...


class FusedOptimizer(torch.optim.Optimizer):
    """The optimizer of a fused embedding module (see the module docstring).

    Args:
        spec: the rule and its starting hyperparameters; the kind is fixed (it sets the
            state layout), the hyperparameters may change between steps.
        owner: the module whose state this optimizer exposes.

    Example:
        >>> from tetrarec.embedding import TableConfig
        >>> from tetrarec.kernels import FusedEmbeddingBagCollection
        >>> ebc = FusedEmbeddingBagCollection(
        ...     [TableConfig(name="t", num_embeddings=4, dim=2)],
        ...     SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.1),
        ... )
        >>> opt = ebc.fused_optimizer
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
        >>> opt.param_groups[0]["lr"]
        0.05
        >>> sorted(opt.state_dict()["state"]["t"])
        ['sum']
    """

    def __init__(self, spec: SparseOptimizerSpec, owner: FusedState) -> None:
        params = owner.storages() or [torch.empty(0)]  # torch.optim refuses no params
        defaults = {
            "lr": spec.lr,
            "eps": spec.eps,
            "betas": (spec.beta1, spec.beta2),
            "weight_decay": spec.weight_decay,
        }
        super().__init__(params, defaults)
        self.kind: OptimizerKind = spec.kind
        self._owner = owner

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim pickles only defaults, state and param_groups: the kind and the
        # owner are what this optimizer is, and a deepcopy or pickle of its module (a
        # "best model" copy, torch.save of the model) must keep them.
        return {**super().__getstate__(), "kind": self.kind, "_owner": self._owner}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the module reads ``param_groups[0]`` only.

        Raises:
            ValueError: for a second group (it would be silently ignored).
        """
        if self.param_groups:  # torch.optim's __init__ adds the one group through here
            raise ValueError(
                "a fused optimizer has one param group (the module's tables, updated in "
                "backward with param_groups[0]'s settings); set those instead"
            )
        super().add_param_group(param_group)

    def kernel_hparams(self) -> list[float]:
        """``[lr, eps, beta1, beta2, weight_decay]`` for the next backward.

        Raises:
            ValueError: naming the settings of ``param_groups[0]`` that break
                ``SPARSE_HPARAM_RULES`` (a NaN or infinite one among them): a scheduler
                or a hand edit that sets one would write NaN or infinity into every
                row the step touches.
        """
        g = self.param_groups[0]
        lr, eps, wd = float(g["lr"]), float(g["eps"]), float(g["weight_decay"])
        beta1, beta2 = (float(b) for b in g["betas"])
        bad = bad_sparse_hparams(lr=lr, eps=eps, betas=(beta1, beta2), weight_decay=wd)
        if bad:
            raise ValueError(f"fused optimizer: bad settings {bad} ({SPARSE_HPARAM_RULES})")
        return [lr, eps, beta1, beta2, wd]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's overloads
        """Nothing to apply: the rows were updated in backward. Runs ``closure`` if given."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: a fused module never stores a gradient."""

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {table: {name: tensor}}, "param_groups": [hyperparameters]}``.

        The tensors are views of the module's state (no copy).
        """
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        for g in groups:
            g["kind"] = self.kind.value
        return {"state": self._owner.optimizer_state(), "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what ``state_dict`` returned (bitwise).

        Raises:
            ValueError: if the saved optimizer is of another kind, or its state does not
                fit the module (missing or unexpected tables, other shapes).
        """
        groups = state_dict["param_groups"]
        saved_kind = groups[0].get("kind", self.kind.value)
        if saved_kind != self.kind.value:
            raise ValueError(
                f"the saved fused optimizer is {saved_kind!r}, this one is {self.kind.value!r}"
            )
        self._owner.load_optimizer_state(state_dict["state"])
        for group, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "kind":
                    group[key] = tuple(value) if key == "betas" else value
