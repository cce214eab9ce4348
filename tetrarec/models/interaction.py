"""The DLRM dot interaction: pairwise dot products of the bottom output and the embeddings.

For B samples, the bottom-MLP output ``x`` (B, D) and F pooled embeddings ``e_0..e_{F-1}``
(B, F*D), stack ``C = [x, e_0, ..., e_{F-1}]`` (B, F+1, D) and take the strictly lower
triangle of ``C C^T``, row by row (the DLRM paper's ``tril_indices(offset=-1)`` order)::

              x    e0   e1   e2            output row (B, D + F(F+1)/2):
        x   [ .                  ]
        e0  [ p0   .             ]         [ x (D values) | p0 p1 p2 p3 p4 p5 ]
        e1  [ p1   p2   .        ]
        e2  [ p3   p4   p5   .   ]         p_k = <row_i, row_j>, i > j

Two implementations give the same values and gradients (tested):

- ``dot_interaction_reference``: ``cat`` + ``bmm`` + a gather, as written in papers,
  differentiated by autograd (two batched products and a scatter-add in backward).
- FAST: the ``tetrarec::dot_interaction`` op (``tetrarec.kernels.ops``). Its backward
  uses ``Z = C C^T``: the gradient is ``(G + G^T) C`` with ``G`` the output gradient in
  the lower triangle. On CPU a compiled kernel forms each sample's products with its
  rows in L1 and never stacks ``C`` or writes ``Z`` (the batched products of 27x64
  blocks ran at ~40 GFLOP/s, a fifth of this machine's matrix rate); the portable
  version (one ``bmm`` and one gather each way) runs on other devices.

The interaction always runs in FP32, also under a BF16 autocast: on the benchmark CPU a
BF16 ``bmm`` of (27x64)x(64x27) blocks ran ~10x slower than FP32 (it misses the oneDNN
fast path), and 64-term dot products lose precision in BF16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tetrarec.kernels import ops
from tetrarec.models.config import InteractionImpl

__all__ = [
    "DotInteraction",
    "Interaction",
    "dot_interaction_reference",
    "interaction_pairs",
]


class Interaction(nn.Module):
    """Base of the interactions: ``(B, D), (B, F*D) -> (B, out_features)``.

    Holds the sizes every interaction has and checks them, once for all subclasses.

    Args:
        num_features: F.
        dim: D.
        out_features: the output width.

    Raises:
        ValueError: if ``num_features`` or ``dim`` is not positive.
    """

    def __init__(self, *, num_features: int, dim: int, out_features: int) -> None:
        super().__init__()
        if num_features <= 0 or dim <= 0:
            raise ValueError(f"need num_features > 0 and dim > 0, got {num_features} and {dim}")
        self.num_features = num_features
        self.dim = dim
        self.out_features = out_features

    def check_inputs(self, dense: torch.Tensor, embeddings: torch.Tensor) -> None:
        """Check ``dense`` (B, D) and ``embeddings`` (B, F*D).

        Raises:
            ValueError: naming the expected and the given shapes.
        """
        if dense.shape[1] != self.dim or embeddings.shape[1] != self.num_features * self.dim:
            raise ValueError(
                f"expected dense (B, {self.dim}) and embeddings "
                f"(B, {self.num_features * self.dim}), "
                f"got {tuple(dense.shape)} and {tuple(embeddings.shape)}"
            )


def interaction_pairs(num_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of the strictly lower triangle of ``(F+1, F+1)``.

    Row 0 / column 0 is the bottom-MLP output, row ``f+1`` is feature ``f``.
    """
    rows, cols = torch.tril_indices(num_features + 1, num_features + 1, offset=-1)
    return rows, cols


def dot_interaction_reference(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """The plain formulation: ``cat(x, tril(C C^T))``.

    Args:
        dense: ``(B, D)`` bottom-MLP output.
        embeddings: ``(B, F*D)`` pooled embeddings, feature-major per sample.

    Returns:
        ``(B, D + F(F+1)/2)``.
    """
    b, d = dense.shape
    f = embeddings.shape[1] // d
    combined = torch.cat((dense.unsqueeze(1), embeddings.view(b, f, d)), dim=1)  # (B, F+1, D)
    z = torch.bmm(combined, combined.transpose(1, 2))  # (B, F+1, F+1)
    rows, cols = interaction_pairs(f)
    return torch.cat((dense, z[:, rows, cols]), dim=1)  # (B, D + P)


class DotInteraction(Interaction):
    """The DLRM dot interaction, ``(B, D), (B, F*D) -> (B, D + F(F+1)/2)``.

    Args:
        num_features: F, the number of pooled embeddings.
        dim: D, the dim shared by the embeddings and the bottom-MLP output.
        impl: ``FAST`` (default) or ``REFERENCE``; same outputs and gradients.

    Example:
        >>> inter = DotInteraction(num_features=2, dim=3)
        >>> inter(torch.ones(4, 3), torch.ones(4, 6)).shape
        torch.Size([4, 6])
    """

    def __init__(
        self, *, num_features: int, dim: int, impl: InteractionImpl = InteractionImpl.FAST
    ) -> None:
        out = dim + num_features * (num_features + 1) // 2
        super().__init__(num_features=num_features, dim=dim, out_features=out)
        self.impl = InteractionImpl.parse(impl)

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Interact ``dense`` (B, D) with ``embeddings`` (B, F*D); returns FP32 (B, out).

        Raises:
            ValueError: if the widths do not match ``(D, F*D)``.
        """
        self.check_inputs(dense, embeddings)
        with torch.autocast(dense.device.type, enabled=False):
            dense, embeddings = dense.float(), embeddings.float()
            return _DOT_IMPLS[self.impl](dense.contiguous(), embeddings.contiguous())


# (dense (B, D), embeddings (B, F*D)) -> (B, D + P)
_DotImpl = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_DOT_IMPLS: dict[InteractionImpl, _DotImpl] = {
    InteractionImpl.REFERENCE: dot_interaction_reference,
    InteractionImpl.FAST: ops.dot_interaction,
}
