"""How an exported model stores and runs its dense layers: one format per precision.

A format is a ``DenseFormat`` in ``DENSE_FORMATS`` (the only dispatch): ``save`` turns a
built model's dense layers into the tensors a model file holds (``dense.<name>...``),
``load`` puts them back into a freshly built ``DLRM``, swapping modules where the format
runs them differently (an INT8 MLP). ``manifest.dense["precision"]`` names the format.

``fp32`` is the trained model as it is: every parameter outside the embedding tables
(``dense.<parameter name>``), run by the model's own code, so an exported FP32 model
scores exactly as the training run evaluated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from tetrarec.models import DLRM

__all__ = ["DENSE_FORMATS", "DENSE_PREFIX", "DenseFormat", "dense_parameters"]

DENSE_PREFIX = "dense."


def dense_parameters(model: DLRM) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of every parameter and buffer outside the model's tables.

    (The embedding collection's and the first-order term's rows are tables; the
    first-order term's dense weight is a dense parameter.)
    """
    tables = ("embeddings.", "first_order.rows.")
    out = {n: p.detach() for n, p in model.named_parameters() if not n.startswith(tables)}
    out.update({n: b for n, b in model.named_buffers() if not n.startswith(tables)})
    return out


class DenseFormat(Protocol):
    """One way of storing and running the dense layers."""

    def save(self, model: DLRM, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors that hold ``model``'s dense layers in this format."""
        ...

    def load(
        self, model: DLRM, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        """Put ``tensors`` (``save``'s) into ``model``, swapping modules as needed.

        Raises:
            ValueError: naming the tensor, for a missing one or one of another shape.
        """
        ...


class _FP32:
    """Every dense parameter as trained, run by the model's own modules."""

    def save(self, model: DLRM, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {DENSE_PREFIX + n: t.float() for n, t in dense_parameters(model).items()}

    def load(
        self, model: DLRM, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        load_dense_parameters(model, tensors)


def load_dense_parameters(model: DLRM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``dense.<name>`` tensors into ``model``'s dense parameters (every one).

    Raises:
        ValueError: naming the first parameter that is missing or of another shape.
    """
    with torch.no_grad():
        for name, param in dense_parameters(model).items():
            key = DENSE_PREFIX + name
            if key not in tensors:
                raise ValueError(f"dense parameter {key!r} is missing from the model file")
            src = tensors[key]
            if src.shape != param.shape:
                raise ValueError(
                    f"dense parameter {key!r}: {tuple(src.shape)} in the model file, "
                    f"the model has {tuple(param.shape)}"
                )
            param.copy_(src)


#: The dense formats, by ``manifest.dense["precision"]``.
DENSE_FORMATS: dict[str, DenseFormat] = {"fp32": _FP32()}
