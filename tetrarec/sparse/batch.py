"""``Batch``: one training batch, dense features, sparse features and labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from tetrarec.sparse.features import SparseFeatures

__all__ = ["Batch"]


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch of ``B`` samples.

    Args:
        dense: ``(B, num_dense)`` float32 dense features.
        sparse: the categorical features, ``sparse.batch_size == B``.
        labels: ``(B,)`` float32 labels in {0, 1}.
    """

    dense: torch.Tensor
    sparse: SparseFeatures
    labels: torch.Tensor

    def __post_init__(self) -> None:
        b = self.sparse.batch_size
        if self.dense.dim() != 2 or self.dense.shape[0] != b:
            raise ValueError(f"dense must be ({b}, num_dense), got {tuple(self.dense.shape)}")
        if self.labels.shape != (b,):
            raise ValueError(f"labels must be ({b},), got {tuple(self.labels.shape)}")

    @property
    def batch_size(self) -> int:
        """``B``."""
        return self.sparse.batch_size

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """Copy every tensor to ``device``."""
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """Return a copy in pinned host memory."""
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor as in use on ``stream``."""
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)


pytree.register_pytree_node(
    Batch,
    lambda b: ([b.dense, b.sparse, b.labels], None),
    lambda children, _: Batch(*children),
)
