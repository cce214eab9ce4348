"""The dense layers' gradient all-reduce, as a ``DistributedDataParallel`` comm hook.

The sum must not depend on where a gradient sits in DDP's bucket. gloo's ring
all-reduce (at 3 or more ranks) adds an element's terms in an order set by its
position in the buffer, and DDP lays its buckets out once by parameter order and then,
after the first backward, by the order the gradients became ready. A resumed run's
first step would then round its dense gradients otherwise than the uninterrupted run's
step did. So ``shard_model`` makes one bucket of all the dense gradients, and the hook
reduces them laid out in the model's parameter order, the same at every step::

    bucket (DDP's order, e.g. top.b, top.w, bottom.b, bottom.w)
      -> flat in model order (bottom.w, bottom.b, top.w, top.b)
      -> all-reduce (sum) -> back into the bucket's views

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run
time and wants the ``GradBucket`` class itself, not its name.)
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # exported at run time

from tetrarec.comm.collectives import Communicator

__all__ = ["DenseGradients", "sum_gradients_hook"]


@dataclass(frozen=True)
class DenseGradients:
    """The hook's state: the communicator and each parameter's place in the model.

    Args:
        comm: the dense layers' communicator.
        position: ``{id(parameter): its index in the model's parameters}``.
    """

    comm: Communicator
    position: Mapping[int, int]

    @classmethod
    def of(cls, comm: Communicator, parameters: Iterable[nn.Parameter]) -> "DenseGradients":
        """The state for a model's ``parameters()`` (in that order)."""
        return cls(comm=comm, position={id(p): i for i, p in enumerate(parameters)})


def sum_gradients_hook(
    state: DenseGradients, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sum a bucket of gradients over the ranks (DDP's default averages them).

    Each rank's loss is its share of the global batch's mean loss, so the sum of the
    ranks' gradients is the one-process gradient. The gradients are reduced in the
    model's parameter order (module docstring). Counted as ``dense_allreduce``.
    """
    grads = bucket.gradients()
    params = bucket.parameters()
    order = sorted(range(len(params)), key=lambda i: state.position[id(params[i])])
    flat = torch.cat([grads[i].reshape(-1) for i in order])

    def unpack(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        summed, start = done.value(), 0
        for i in order:
            n = grads[i].numel()
            grads[i].copy_(summed[start : start + n].view_as(grads[i]))
            start += n
        return bucket.buffer()

    return state.comm.all_reduce_future(flat, label="dense_allreduce").then(unpack)
