"""``MLP``: a stack of ``Linear`` layers with ReLU between them, deterministic init."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F  # the usual torch alias
from torch import nn

from tetrarec.models.precision import linear

__all__ = ["MLP", "generator_for"]


def generator_for(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded with ``seed``, or ``None`` to use the global RNG."""
    return torch.Generator().manual_seed(seed) if seed is not None else None


class MLP(nn.Module):
    """``in -> sizes[0] -> ... -> sizes[-1]`` with ReLU after every layer but maybe the last.

    Weights start as in the DLRM reference implementation: ``W ~ N(0, 2/(in+out))``,
    ``b ~ N(0, 1/out)``, drawn from ``generator`` in layer order so that a seed fixes
    them whatever else uses the global RNG.

    Args:
        in_features: input width.
        sizes: output width of each layer.
        final_activation: apply ReLU after the last layer too (bottom MLP: yes,
            top MLP: no, it returns logits).
        fp32_last_layer: run the last layer in FP32 even when the dense path runs in BF16.
            The top MLP sets it: a BF16 logit keeps 8 significant bits, which ties the
            ranking of close scores and moves AUC; the last layer (-> 1) costs nothing.
        generator: RNG for the initialization; ``None`` uses the global RNG.
        dropout: probability of zeroing each hidden activation (the ReLU output of
            every layer but the last) in training mode, scaling the kept ones by
            ``1 / (1 - dropout)`` (``torch.nn.functional.dropout``); the masks come from
            the global torch RNG, so a seed fixes them and a checkpoint of the RNG
            state resumes them. The last layer's output (the logit, or the bottom MLP's
            output that meets the embeddings) is never dropped. 0 turns it off.

    Raises:
        ValueError: on an empty ``sizes``, a non-positive width or a ``dropout``
            outside [0, 1).
    """

    def __init__(
        self,
        in_features: int,
        sizes: Sequence[int],
        *,
        final_activation: bool,
        fp32_last_layer: bool = False,
        generator: torch.Generator | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not sizes or in_features <= 0 or any(s <= 0 for s in sizes):
            raise ValueError(f"bad MLP widths: in_features={in_features}, sizes={tuple(sizes)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MLP dropout must be in [0, 1), got {dropout}")
        self.dropout = dropout
        self.in_features = in_features
        self.out_features = sizes[-1]
        self.final_activation = final_activation
        self.fp32_last_layer = fp32_last_layer
        widths = (in_features, *sizes)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        with torch.no_grad():
            for layer in self.linears:
                fan_out, fan_in = layer.weight.shape
                layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=generator)
                layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=generator)

    @property
    def linears(self) -> list[nn.Linear]:
        """The layers, in order."""
        return cast("list[nn.Linear]", list(self.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_features) -> (B, out_features)``."""
        layers = self.linears
        last = len(layers) - 1
        drop = self.dropout if self.training else 0.0
        for i, layer in enumerate(layers):
            if i == last and self.fp32_last_layer:
                with torch.autocast(x.device.type, enabled=False):
                    x = F.linear(x.float(), layer.weight, layer.bias)
            else:
                # tetrarec's linear: F.linear, or its BF16 emulation (models.precision).
                # Between two emulated layers values stay BF16 (ReLU keeps them), so
                # neither the input nor the gradient needs another rounding pass; the
                # 1/(1-p) scale of dropout does not keep them BF16, so with dropout
                # both are rounded again (as autocast rounds the dropout's output).
                next_emulated = i < last and not (i + 1 == last and self.fp32_last_layer)
                x = linear(
                    x,
                    layer.weight,
                    layer.bias,
                    input_is_bf16=i > 0 and not drop,
                    grad_is_bf16=next_emulated and not drop,
                )
            if i < last or self.final_activation:
                # In place: the linear's backward never reads its output, ReLU's reads
                # only its own output, so no extra (B, out) buffer is needed.
                x = torch.relu_(x)
            if drop and i < last:
                # Not in place: ReLU's backward reads its output.
                x = F.dropout(x, drop, training=True)
        return x
