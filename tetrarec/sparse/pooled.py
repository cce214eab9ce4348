"""``PooledEmbeddings``: the pooled output of an embedding collection.

Layout, for B=2 samples and features ``("a", "b")`` with dims ``(2, 3)``::

    values (B, sum(dims)) = [[a0 a0 | b0 b0 b0],
                             [a1 a1 | b1 b1 b1]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PooledEmbeddings"]


@dataclass(frozen=True, slots=True)
class PooledEmbeddings:
    """Per-feature pooled embeddings, concatenated along dim 1.

    Args:
        keys: feature names, in column order.
        dims: embedding dim of each key.
        values: ``(B, sum(dims))`` tensor.
    """

    keys: tuple[str, ...]
    dims: tuple[int, ...]
    values: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.dims):
            raise ValueError(f"{len(self.keys)} keys but {len(self.dims)} dims")
        if self.values.dim() != 2 or self.values.shape[1] != sum(self.dims):
            raise ValueError(
                f"values must be (B, {sum(self.dims)}), got {tuple(self.values.shape)}"
            )

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{key: (B, dim) tensor}`` (views, no copy)."""
        return dict(zip(self.keys, torch.split(self.values, list(self.dims), dim=1)))

    def stacked(self) -> torch.Tensor:
        """``(B, F, D)`` view; requires every key to have the same dim.

        Raises:
            ValueError: if the dims differ.
        """
        if len(set(self.dims)) != 1:
            raise ValueError(f"stacked() needs equal dims, got {self.dims}")
        return self.values.view(self.values.shape[0], len(self.keys), self.dims[0])
