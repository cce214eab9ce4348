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

Before a batch's policy step reads and writes rows of an SSD table, ``prefetch_rows``
asks the kernel for every one of their pages that is not resident, all at once
(``mincore``, then ``madvise(MADV_WILLNEED)`` per run of missing pages): the reads are
queued together and the device serves them in parallel, where page faults one row at a
time would wait for each read in turn.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.embedding.init import INIT_CHUNK_ROWS
from tetrarec.kernels import FusedEmbeddingBagCollection

__all__ = ["advise_random_", "map_to_files", "prefetch_rows"]


class _Libc:
    """``madvise`` and ``mincore`` through ctypes (None where the platform lacks them)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.willneed: int | None = getattr(mmap, "MADV_WILLNEED", None)
        libc = ctypes.CDLL(None, use_errno=True)
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.mincore = getattr(libc, "mincore", None)
        if self.mincore is not None:
            self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


_LIBC: _Libc | None = None


def _libc() -> _Libc:
    global _LIBC
    if _LIBC is None:
        _LIBC = _Libc()
    return _LIBC


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


def prefetch_rows(t: torch.Tensor, rows: torch.Tensor) -> int:
    """Start reading the pages of ``t``'s ``rows`` that are not in memory; no wait.

    Only advice: the data is unchanged whatever the kernel does with it, and a platform
    without ``madvise`` / ``mincore`` gets nothing done.

    Args:
        t: a 2-D view ``(rows, width)`` of a file map (``_table_rows`` / ``_table_state``).
        rows: row ids (int64, any order, repeats allowed).

    Returns:
        The number of pages asked for (0: every page was resident).

    Raises:
        OSError: the kernel refused ``mincore`` or ``madvise`` (its errno).
    """
    lib = _libc()
    if lib.willneed is None or lib.mincore is None or rows.numel() == 0 or t.numel() == 0:
        return 0
    page = lib.page
    row_bytes = t.stride(0) * t.element_size()
    base = t.data_ptr()
    first = base + rows.cpu().numpy().astype(np.int64) * row_bytes
    pages = np.unique(np.concatenate([first // page, (first + row_bytes - 1) // page]))
    lo, hi = int(pages[0]), int(pages[-1]) + 1
    resident = np.zeros(hi - lo, dtype=np.uint8)
    if lib.mincore(lo * page, (hi - lo) * page, resident.ctypes.data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mincore of a file map: {os.strerror(errno)}")
    missing = pages[(resident[pages - lo] & 1) == 0]
    if missing.size == 0:
        return 0
    # one call per run of consecutive missing pages
    breaks = np.flatnonzero(np.diff(missing) != 1) + 1
    for run in np.split(missing, breaks):
        start, length = int(run[0]) * page, int(run.size) * page
        if lib.madvise(start, length, lib.willneed) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"madvise(MADV_WILLNEED) of a file map: {os.strerror(errno)}")
    return int(missing.size)


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

    Raises:
        OSError: when the files cannot be created or their space reserved (a full
            disk), naming the file and the bytes; the new directory is deleted first.
    """
    base = Path(root or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="tetrarec-ssd-", dir=base))
    try:
        for s, store in enumerate(module._stores):
            dtype = store.precision.torch_dtype
            path = directory / f"rows-{s}-{store.precision.value}.bin"
            w = _mapped(path, store.numel, dtype)
            setattr(module, f"_weights_{s}", w)
            for k, n in enumerate(store.state_numel):
                name = store.state_names[k]
                st = _mapped(directory / f"state-{s}-{name}.bin", n, torch.float32)
                st.fill_(optimizer.initial_accumulator if name == "sum" else 0.0)
                setattr(module, f"_state_{s}_{k}", st)
        # the same initial rows as in memory (init_rows), in small chunks
        module._init_weights(chunk_rows=init_chunk_rows)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def _mapped(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``(numel,)`` of ``dtype`` shared-mapped from a new file whose blocks are reserved.

    A sparse file on a full disk maps fine and then kills the process with SIGBUS at the
    first page written; reserving the blocks (``posix_fallocate``) fails here instead.
    """
    size = numel * torch.empty(0, dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if size and hasattr(os, "posix_fallocate"):  # Linux; elsewhere the file is sparse
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise OSError(
            e.errno,
            f"the ssd placement cannot reserve {size:,} bytes for {path.name} in "
            f"{path.parent.parent} ({e.strerror})",
        ) from e
    finally:
        os.close(fd)
    mapped = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    advise_random_(mapped)
    return mapped
