"""``SparseFeatures``: a batch of bags of ids for several features, key-major.

Layout (the same physical layout as TorchRec's KeyedJaggedTensor)::

    batch of B=3 samples, F=2 features

                 sample 0   sample 1   sample 2
    "user"       [10, 11]   []         [12]
    "item"       [20]       [21, 22]   [23]

    keys    = ("user", "item")
    values  = [10, 11, 12, 20, 21, 22, 23]        # (N,)  all bags of key 0, then key 1
    lengths = [2, 0, 1, 1, 2, 1]                  # (F*B,) key-major
    offsets() = [0, 2, 2, 3, 4, 6, 7]             # (F*B+1,) derived, never stored
    weights = None or a (N,) float tensor, one per id

Lengths are canonical; offsets are derived. ``batch_size`` is a host int, so no
consumer ever syncs to learn B.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

__all__ = ["SparseFeatures", "offsets_from_lengths"]

_ID_DTYPES = (torch.int32, torch.int64)


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``(n+1,)`` exclusive prefix sum of ``lengths`` (no host sync)."""
    out = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


@dataclass(frozen=True, slots=True)
class SparseFeatures:
    """Bags of ids for ``len(keys)`` features over ``batch_size`` samples.

    Args:
        keys: feature names, in order.
        values: ``(N,)`` int32/int64 ids, key-major (see the module docstring).
        lengths: ``(F*B,)`` bag lengths, key-major.
        batch_size: ``B``, samples in the batch.
        weights: optional ``(N,)`` float weight per id.
        value_counts: optional host cache of the number of ids per key; loaders fill it
            for free so that nobody has to sync to learn it.

    ``values``, ``lengths`` and ``weights`` are stored contiguous (a strided tensor is
    copied). Float64 weights are stored as float32, the precision every lookup pools in
    (the compiled kernel cast them, the portable path failed on them).

    Raises:
        ValueError: on inconsistent shapes or dtypes (no device sync is done here;
            data-dependent checks live in ``tetrarec.sparse.validate``).
    """

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    batch_size: int
    weights: torch.Tensor | None = None
    value_counts: tuple[int, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # The kernels read flat arrays: a strided view (a slice with a step, a column of a
        # 2-D tensor) is copied once here, a contiguous tensor is kept as it is.
        for name in ("values", "lengths", "weights"):
            t = getattr(self, name)
            if t is not None and not t.is_contiguous():
                object.__setattr__(self, name, t.contiguous())
        if self.weights is not None and self.weights.dtype == torch.float64:
            object.__setattr__(self, "weights", self.weights.float())  # autograd follows
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"duplicate feature keys in {self.keys}")
        if self.values.dim() != 1 or self.values.dtype not in _ID_DTYPES:
            raise ValueError(
                f"values must be a 1-D int32/int64 tensor, got shape "
                f"{tuple(self.values.shape)} dtype {self.values.dtype}"
            )
        if self.lengths.dim() != 1 or self.lengths.dtype not in _ID_DTYPES:
            raise ValueError(
                f"lengths must be a 1-D int32/int64 tensor, got shape "
                f"{tuple(self.lengths.shape)} dtype {self.lengths.dtype}"
            )
        if self.lengths.numel() != len(self.keys) * self.batch_size:
            raise ValueError(
                f"lengths has {self.lengths.numel()} entries, expected "
                f"len(keys) * batch_size = {len(self.keys)} * {self.batch_size}"
            )
        if self.weights is not None and (
            self.weights.shape != self.values.shape or not self.weights.is_floating_point()
        ):
            raise ValueError(
                f"weights must be a float tensor shaped like values {tuple(self.values.shape)}, "
                f"got {tuple(self.weights.shape)} {self.weights.dtype}"
            )
        if self.value_counts is not None:
            if len(self.value_counts) != len(self.keys):
                raise ValueError(
                    f"value_counts has {len(self.value_counts)} entries for {len(self.keys)} keys"
                )
            if sum(self.value_counts) != self.values.numel():
                raise ValueError(
                    f"value_counts sum to {sum(self.value_counts)} but there are "
                    f"{self.values.numel()} values"
                )

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_lengths(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        *,
        weights: torch.Tensor | None = None,
    ) -> SparseFeatures:
        """Build from flat key-major ``values`` and ``lengths``; infers ``batch_size``.

        Raises:
            ValueError: if ``lengths`` does not split evenly over the keys.
        """
        keys = tuple(keys)
        if not keys:
            raise ValueError("at least one key is needed")
        if lengths.numel() % len(keys):
            raise ValueError(f"{lengths.numel()} lengths do not split over {len(keys)} keys")
        return cls(keys, values, lengths, lengths.numel() // len(keys), weights)

    @classmethod
    def from_lists(
        cls,
        bags: Mapping[str, Sequence[Sequence[int]]],
        *,
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> SparseFeatures:
        """Build from ``{"f": [[ids of sample 0], [ids of sample 1], ...], ...}``.

        >>> sf = SparseFeatures.from_lists({"a": [[1, 2], []], "b": [[3], [4]]})
        >>> sf.values.tolist(), sf.lengths.tolist()
        ([1, 2, 3, 4], [2, 0, 1, 1])

        Raises:
            ValueError: if the features disagree on the number of samples.
        """
        keys = tuple(bags)
        sizes = {len(b) for b in bags.values()}
        if len(sizes) != 1:
            raise ValueError(f"features disagree on batch size: {sizes}")
        flat = [i for k in keys for bag in bags[k] for i in bag]
        lens = [len(bag) for k in keys for bag in bags[k]]
        w = None
        if weights is not None:
            w = torch.tensor(
                [x for k in keys for bag in weights[k] for x in bag], dtype=torch.float32
            )
        counts = tuple(sum(len(bag) for bag in bags[k]) for k in keys)
        return cls(
            keys,
            torch.tensor(flat, dtype=torch.int64),
            torch.tensor(lens, dtype=torch.int64),
            sizes.pop(),
            w,
            counts,
        )

    # -- derived views ------------------------------------------------------------------

    @property
    def num_keys(self) -> int:
        """``F``, the number of features."""
        return len(self.keys)

    def offsets(self) -> torch.Tensor:
        """``(F*B+1,)`` exclusive prefix sum of ``lengths`` (no host sync)."""
        return offsets_from_lengths(self.lengths)

    def lengths_2d(self) -> torch.Tensor:
        """``(F, B)`` view of ``lengths``."""
        return self.lengths.view(self.num_keys, self.batch_size)

    def value_counts_host(self) -> tuple[int, ...]:
        """Ids per key as host ints. Syncs with the device unless ``value_counts`` is set."""
        if self.value_counts is not None:
            return self.value_counts
        return tuple(int(x) for x in self.lengths_2d().sum(1).tolist())

    def with_value_counts(self) -> SparseFeatures:
        """Return a copy with the ``value_counts`` cache filled (syncs once if needed)."""
        if self.value_counts is not None:
            return self
        return SparseFeatures(
            self.keys,
            self.values,
            self.lengths,
            self.batch_size,
            self.weights,
            self.value_counts_host(),
        )

    def to_dict(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{key: (values_k, lengths_k)}``; readable, for tests and debugging."""
        counts = self.value_counts_host()
        vals = torch.split(self.values, list(counts))
        lens = self.lengths_2d()
        return {k: (vals[i], lens[i]) for i, k in enumerate(self.keys)}

    # -- movement -----------------------------------------------------------------------

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> SparseFeatures:
        """Copy the tensors to ``device``; the host caches travel along."""
        w = self.weights.to(device, non_blocking=non_blocking) if self.weights is not None else None
        return SparseFeatures(
            self.keys,
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            self.batch_size,
            w,
            self.value_counts,
        )

    def pin_memory(self) -> SparseFeatures:
        """Return a copy in pinned host memory (for asynchronous host-to-device copies)."""
        w = self.weights.pin_memory() if self.weights is not None else None
        return SparseFeatures(
            self.keys,
            self.values.pin_memory(),
            self.lengths.pin_memory(),
            self.batch_size,
            w,
            self.value_counts,
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the tensors as in use on ``stream`` (CUDA caching-allocator safety)."""
        self.values.record_stream(stream)
        self.lengths.record_stream(stream)
        if self.weights is not None:
            self.weights.record_stream(stream)


# The static (non-tensor) part of a flattened SparseFeatures: keys, batch_size, value_counts.
_Context = tuple[tuple[str, ...], int, tuple[int, ...] | None]


def _flatten(sf: SparseFeatures) -> tuple[list[torch.Tensor | None], _Context]:
    return [sf.values, sf.lengths, sf.weights], (sf.keys, sf.batch_size, sf.value_counts)


def _unflatten(children: Iterable[torch.Tensor | None], ctx: _Context) -> SparseFeatures:
    keys, batch_size, counts = ctx
    values, lengths, weights = children
    assert values is not None
    assert lengths is not None
    return SparseFeatures(keys, values, lengths, batch_size, weights, counts)


pytree.register_pytree_node(SparseFeatures, _flatten, _unflatten)
