"""DLRM-DCNv2's interaction: low-rank cross layers over ``[x, e_0, ..., e_{F-1}]``.

As in MLPerf's DLRM-DCNv2 reference (TorchRec's ``LowRankCrossNet``), with
``x_0 = cat(bottom output, flattened embeddings)`` of width ``N = (F+1) * D``::

    x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l          V_l: N -> r,  W_l: r -> N

      x_0 (B, N) --+------------+----------------+
                   |            |                |
                   v            v (elementwise)  v
      x_l --> V_l --> W_l --> + b_l --> * x_0 --> + --> x_{l+1}
       |                                          ^
       +------------------------------------------+

Each layer is one ``linear`` without bias, one with the bias folded in, and one
``addcmul``: three kernels, against five in the textbook form.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrarec.models.interaction import Interaction
from tetrarec.models.precision import linear

__all__ = ["DCNInteraction", "LowRankCrossNet"]


class LowRankCrossNet(nn.Module):
    """``num_layers`` low-rank cross layers, ``(B, N) -> (B, N)``.

    Args:
        in_features: N.
        num_layers: number of cross layers (0 is the identity).
        low_rank: r, the rank of each ``W_l V_l``.
        generator: RNG for the initialization (Xavier-normal ``V``, ``W``, zero bias,
            as TorchRec); ``None`` uses the global RNG.

    Raises:
        ValueError: on a non-positive ``in_features`` or ``low_rank``, or negative
            ``num_layers``.
    """

    def __init__(
        self,
        in_features: int,
        *,
        num_layers: int,
        low_rank: int,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or low_rank <= 0 or num_layers < 0:
            raise ValueError(
                f"bad cross net: in_features={in_features}, num_layers={num_layers}, "
                f"low_rank={low_rank}"
            )
        self.in_features = in_features
        self.out_features = in_features
        self.num_layers = num_layers
        self.low_rank = low_rank
        self.v_kernels = nn.ParameterList(
            nn.Parameter(torch.empty(low_rank, in_features)) for _ in range(num_layers)
        )  # (r, N) each
        self.w_kernels = nn.ParameterList(
            nn.Parameter(torch.empty(in_features, low_rank)) for _ in range(num_layers)
        )  # (N, r) each
        self.biases = nn.ParameterList(
            nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)
        )
        with torch.no_grad():
            for v, w in zip(self.v_kernels, self.w_kernels):
                nn.init.xavier_normal_(v, generator=generator)
                nn.init.xavier_normal_(w, generator=generator)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """``(B, N) -> (B, N)``."""
        x = x0
        for v, w, b in zip(self.v_kernels, self.w_kernels, self.biases):
            xv = linear(x, v, grad_is_bf16=True)  # (B, r); its gradient comes from W's
            xw = linear(xv, w, b, input_is_bf16=True)  # (B, N) = W (V x) + b
            x = torch.addcmul(x, x0, xw)  # (B, N) = x0 * (W V x + b) + x
        return x


class DCNInteraction(Interaction):
    """DLRM-DCNv2 interaction: ``(B, D), (B, F*D) -> (B, (F+1)*D)``.

    Args:
        num_features: F.
        dim: D.
        num_layers: cross layers (3 in MLPerf).
        low_rank: rank of each layer (512 in MLPerf).
        generator: RNG for the initialization.

    Example:
        >>> inter = DCNInteraction(num_features=2, dim=3, num_layers=1, low_rank=2)
        >>> inter(torch.ones(4, 3), torch.ones(4, 6)).shape
        torch.Size([4, 9])
    """

    def __init__(
        self,
        *,
        num_features: int,
        dim: int,
        num_layers: int,
        low_rank: int,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_features=num_features, dim=dim, out_features=(num_features + 1) * dim)
        self.crossnet = LowRankCrossNet(
            self.out_features, num_layers=num_layers, low_rank=low_rank, generator=generator
        )

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Cross ``cat(dense, embeddings)``; returns ``(B, (F+1)*D)``.

        Raises:
            ValueError: if the widths do not match ``(D, F*D)``.
        """
        self.check_inputs(dense, embeddings)
        # The input stays in the embeddings' precision (FP32): with a BF16 dense path only
        # the two products of each layer run in BF16, the residual sum does not.
        x0 = torch.cat((dense.to(embeddings.dtype), embeddings), dim=1)  # (B, (F+1)*D)
        out: torch.Tensor = self.crossnet(x0)
        return out
