"""``BatchLoader``: each rank's slice of every global batch, prefetched by a thread.

Global batch ``g`` (counted from 0 over all epochs) is rows
``order_e[j*B : (j+1)*B]`` of epoch ``e = g // batches_per_epoch``, ``j = g % batches_per_epoch``,
where ``order_e`` is ``arange(N)`` or, with ``shuffle``, a permutation that depends only
on ``(seed, e)``. Rank ``r`` of ``W`` reads the ``r``-th of ``W`` equal contiguous slices,
exactly as ``tetrarec.sparse.split_batch`` splits the global batch::

    N=10, B=4, W=2, shuffle off, drop_last      global batch 0: rows [0 1 2 3]
        rank 0 reads [0 1], then [4 5]          global batch 1: rows [4 5 6 7]
        rank 1 reads [2 3], then [6 7]          (rows 8, 9 dropped)

Resuming is ``start_batch=g``: the loader continues at global batch ``g`` with the same
rows it would have produced had it never stopped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import numpy as np

from tetrarec.data.datasets import Dataset
from tetrarec.sparse import Batch

__all__ = ["BatchLoader"]

logger = logging.getLogger(__name__)


class _End:
    """The producer's last queue item: the source is exhausted."""


_END = _End()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_Item = Batch | _Failure | _End


class _Prefetcher:
    """Runs an iterator in a daemon thread, ``depth`` items ahead of the consumer."""

    def __init__(self, source: Iterator[Batch], depth: int) -> None:
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._source = source
        self._thread = threading.Thread(target=self._run, name="tetrarec-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: _Item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(_Failure(e))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            item = self._queue.get()
            if isinstance(item, _End):
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            logger.warning("the prefetch thread did not stop within 10 s")


class BatchLoader:
    """Iterable of this rank's ``Batch`` of each global batch (see the module docstring).

    Args:
        dataset: rows to read.
        batch_size: the global batch ``B`` (all ranks together).
        rank: this rank ``r``.
        world_size: ranks ``W``: each reads ``B/W`` rows of a global batch; a ``B`` that
            does not divide by ``W`` splits as evenly as it can (``np.array_split``: the
            first ``B % W`` ranks read one row more), in training and evaluation alike.
        shuffle: permute rows each epoch (depends only on ``(seed, epoch)``).
        seed: the shuffle seed; every rank must pass the same.
        drop_last: drop the last, partial global batch of an epoch. When kept, it is
            split as evenly as possible (``np.array_split``), so ranks may differ by a
            row.
        prefetch: batches read ahead in a background thread; 0 reads in the caller.
        start_batch: the global batch number to start at (resume).
        epochs: stop after this many epochs (counted from batch 0); None runs forever.

    Raises:
        ValueError: on a bad rank, or a dataset smaller than one batch with
            ``drop_last``.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
        prefetch: int = 2,
        start_batch: int = 0,
        epochs: int | None = None,
    ) -> None:
        if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size > 0 and 0 <= rank < world_size, got batch_size={batch_size}, "
                f"rank={rank}, world_size={world_size}"
            )
        if prefetch < 0 or start_batch < 0 or (epochs is not None and epochs < 0):
            raise ValueError(
                f"prefetch, start_batch and epochs must be >= 0, "
                f"got {prefetch}, {start_batch}, {epochs}"
            )
        n = dataset.num_samples
        self.batches_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"{n} rows make no full batch of {batch_size} (drop_last=True)")
        self.dataset = dataset
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.prefetch, self.start_batch, self.epochs = prefetch, start_batch, epochs
        self._order: tuple[int, np.ndarray] | None = None
        self._active: _Prefetcher | None = None

    @property
    def local_batch_size(self) -> int:
        """Rows per rank in a full batch, ``B / W`` (the most a rank reads: rounded up)."""
        return -(-self.batch_size // self.world_size)

    @property
    def num_batches(self) -> int | None:
        """Global batches an iteration yields from ``start_batch`` (None: forever)."""
        if self.epochs is None:
            return None
        return max(0, self.epochs * self.batches_per_epoch - self.start_batch)

    def __len__(self) -> int:
        """``num_batches``; raises ``TypeError`` for an endless loader."""
        if self.num_batches is None:
            raise TypeError("an endless BatchLoader (epochs=None) has no length")
        return self.num_batches

    def epoch_order(self, epoch: int) -> np.ndarray:
        """``(N,)`` row order of ``epoch``: a permutation of ``(seed, epoch)`` or arange."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        n = self.dataset.num_samples
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        else:
            order = np.arange(n, dtype=np.int64)
        self._order = (epoch, order)
        return order

    def global_indices(self, number: int) -> np.ndarray:
        """Rows of global batch ``number`` (all ranks)."""
        epoch, j = divmod(number, self.batches_per_epoch)
        return self.epoch_order(epoch)[j * self.batch_size : (j + 1) * self.batch_size]

    def rank_indices(self, number: int) -> np.ndarray:
        """Rows of this rank's slice of global batch ``number``."""
        rows = self.global_indices(number)
        if rows.shape[0] == self.batch_size and self.batch_size % self.world_size == 0:
            step = self.batch_size // self.world_size
            return rows[self.rank * step : (self.rank + 1) * step]
        return np.array_split(rows, self.world_size)[self.rank]

    def _batches(self) -> Iterator[Batch]:
        number = self.start_batch
        while self.num_batches is None or number < self.start_batch + self.num_batches:
            yield self.dataset.read(self.rank_indices(number))
            number += 1

    def __iter__(self) -> Iterator[Batch]:
        """Yield this rank's batches from ``start_batch`` on; a new call starts over."""
        self.close()
        if self.prefetch == 0:
            yield from self._batches()
            return
        # A private generator so that the thread never shares the epoch cache with
        # the caller's calls to rank_indices().
        worker = BatchLoader(
            self.dataset,
            batch_size=self.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
            prefetch=0,
            start_batch=self.start_batch,
            epochs=self.epochs,
        )
        prefetcher = _Prefetcher(worker._batches(), self.prefetch)
        self._active = prefetcher
        try:
            yield from prefetcher
        finally:
            prefetcher.close()
            if self._active is prefetcher:
                self._active = None

    def close(self) -> None:
        """Stop the prefetch thread of the running iteration, if any."""
        if self._active is not None:
            self._active.close()
            self._active = None
