"""The lower dense formats' interaction: the DLRM dot interaction with BF16 products.

``QuantBF16DotInteraction`` replaces a model's ``DotInteraction`` (``inter_arch``) with
the same call, ``(B, D), (B, F*D) -> (B, D + F(F+1)/2)`` FP32, run by the
``tetrarec::dot_interaction_bf16`` op: the rows rounded to BF16, their products summed in
FP32 (``_mm512_dpbf16_ps`` on CPUs with AVX512_BF16), the bottom-MLP output passed
through unrounded. It has no parameters: a model file stores nothing for it, and the
manifest's dense settings name it (``"interaction": "bf16"``).

``INTERACTION_PRECISIONS`` lists the settings; ``interaction_swaps`` (by the model's
interaction type, the only dispatch) says which interactions have a BF16 version. The
DCN cross layers have none: they stay as trained.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tetrarec.kernels import ops
from tetrarec.models.interaction import DotInteraction, Interaction

__all__ = [
    "INTERACTION_PRECISIONS",
    "QuantBF16DotInteraction",
    "bf16_interaction",
]

#: The ``interaction`` settings of the lower dense formats: the model's own (``fp32``)
#: or its BF16 version (``bf16``).
INTERACTION_PRECISIONS = ("fp32", "bf16")


class QuantBF16DotInteraction(Interaction):
    """The dot interaction with BF16 products and FP32 sums; forward only.

    Args:
        num_features: F.
        dim: D.

    Example:
        >>> inter = QuantBF16DotInteraction(num_features=2, dim=3)
        >>> inter(torch.ones(4, 3), torch.ones(4, 6)).shape
        torch.Size([4, 6])
    """

    def __init__(self, *, num_features: int, dim: int) -> None:
        out = dim + num_features * (num_features + 1) // 2
        super().__init__(num_features=num_features, dim=dim, out_features=out)

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Interact ``dense`` (B, D) with ``embeddings`` (B, F*D); returns FP32 (B, out).

        Raises:
            ValueError: if the widths do not match ``(D, F*D)``.
        """
        self.check_inputs(dense, embeddings)
        with torch.autocast(dense.device.type, enabled=False):
            x = dense.float().contiguous()
            out: torch.Tensor = ops.dot_interaction_bf16(x, embeddings.float().contiguous())
            return out


def _from_dot(module: nn.Module) -> nn.Module:
    assert isinstance(module, DotInteraction)  # the registry's key
    return QuantBF16DotInteraction(num_features=module.num_features, dim=module.dim)


# The interactions that have a BF16 version, by type; the others (DCN) stay as trained.
_BF16_SWAPS: dict[type[nn.Module], Callable[[nn.Module], nn.Module]] = {
    DotInteraction: _from_dot,
    QuantBF16DotInteraction: lambda m: m,
}


def bf16_interaction(module: nn.Module) -> nn.Module | None:
    """The BF16 version of the interaction ``module``, or ``None`` if it has none.

    Args:
        module: a model's ``inter_arch``.
    """
    swap = _BF16_SWAPS.get(type(module))
    return swap(module) if swap is not None else None
