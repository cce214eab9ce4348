"""The dense layers' gradient all-reduce, as a ``DistributedDataParallel`` comm hook.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run
time and wants the ``GradBucket`` class itself, not its name.)
"""

import torch
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # exported at run time

from tetrarec.comm.collectives import Communicator

__all__ = ["sum_gradients_hook"]


def sum_gradients_hook(
    comm: Communicator, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sum a bucket of gradients over the ranks (DDP's default averages them).

    Each rank's loss is its share of the global batch's mean loss, so the sum of the
    ranks' gradients is the one-process gradient. Counted as ``dense_allreduce``.
    """
    return comm.all_reduce_future(bucket.buffer(), label="dense_allreduce")
