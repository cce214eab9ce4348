"""The SSD tier: a fused collection whose flat storages are memory-mapped files.

``FusedEmbeddingBagCollection`` keeps each row store in one flat tensor, and its
kernels take any CPU tensor, so a store backed by a file needs no other change::

    <directory>/tetrarec-ssd-XXXX/
      rows-<store>-<precision>.bin     the store's rows, exactly its in-memory layout
      state-<store>-<name>.bin         FP32 optimizer state of every row

``torch.from_file(shared=True)`` maps each file; its pages are the kernel's page cache,
not anonymous process memory, so under a memory limit the kernel writes dirty pages
back and drops clean ones, and the rows need not fit in RAM.

Each map is advised ``MADV_RANDOM``: the rows a batch misses are scattered over the
file, and without the advice every page fault reads the device's whole read-around
window (``read_ahead_kb``: 128 KiB by default, 8 MiB on the development VM) of rows
nobody asked for. Measured (``benchmarks/results/2026-12-01-tiers.md``): 2.2 GB read
from the disk per step for 8,200 missed 72-byte rows without it, 41 MiB with it, and
about 3x the rows read per second.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from pathlib import Path

import torch

from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.embedding.init import INIT_CHUNK_ROWS
from tetrarec.kernels import FusedEmbeddingBagCollection

__all__ = ["advise_random_", "map_to_files"]


def advise_random_(t: torch.Tensor) -> None:
    """``madvise(MADV_RANDOM)`` the pages under ``t`` (a file map): no read-around on faults.

    A no-op where the platform has no ``madvise`` (``mmap.MADV_RANDOM`` absent).

    Args:
        t: a tensor whose storage is a memory-mapped file (``torch.from_file``).

    Raises:
        OSError: the kernel refused the advice (its errno).
    """
    advice = getattr(mmap, "MADV_RANDOM", None)
    if advice is None or t.numel() == 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() & ~(page - 1)
    length = t.data_ptr() + t.numel() * t.element_size() - start
    if libc.madvise(start, length, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise(MADV_RANDOM) of a file map: {os.strerror(errno)}")


def map_to_files(
    module: FusedEmbeddingBagCollection,
    optimizer: SparseOptimizerSpec,
    root: str | None,
    *,
    init_chunk_rows: int = INIT_CHUNK_ROWS,  # init_rows draws rows in chunks of this
) -> Path:
    """Back a meta-device ``module``'s storages by files, then write its initial rows.

    Args:
        module: a collection built with ``device="meta"`` (it allocated nothing).
        optimizer: its optimizer (the initial value of Adagrad's state).
        root: the directory for the files' directory (default: the system's temporary
            directory, often a RAM-backed tmpfs: point it at the SSD).
        init_chunk_rows: rows of each table initialized at a time. Each chunk is a
            temporary FP32 block in process memory (16 MiB at D = 64 for the default,
            ``init_rows``'s own chunk, so no row is drawn twice), small beside a memory
            budget the file-backed table may exceed many times over; the in-memory
            default of ``_init_weights`` (1M rows, 256 MB at D = 64) is not.

    Returns:
        The new directory holding the files (the caller deletes it).
    """
    base = Path(root or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="tetrarec-ssd-", dir=base))
    for s, store in enumerate(module._stores):
        path = directory / f"rows-{s}-{store.precision.value}.bin"
        w = torch.from_file(
            str(path), shared=True, size=store.numel, dtype=store.precision.torch_dtype
        )
        advise_random_(w)
        setattr(module, f"_weights_{s}", w)
        for k, n in enumerate(store.state_numel):
            name = store.state_names[k]
            path = directory / f"state-{s}-{name}.bin"
            st = torch.from_file(str(path), shared=True, size=n, dtype=torch.float32)
            advise_random_(st)
            st.fill_(optimizer.initial_accumulator if name == "sum" else 0.0)
            setattr(module, f"_state_{s}_{k}", st)
    # the same initial rows as in memory (init_rows), in small chunks
    module._init_weights(chunk_rows=init_chunk_rows)
    return directory
