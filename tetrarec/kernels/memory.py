"""Large host buffers for the flat tables, backed by transparent huge pages where possible.

An embedding lookup reads rows scattered over gigabytes: with 4 KiB pages nearly every
row costs a TLB miss and a page walk. 2 MiB pages cut the page-table footprint 512-fold.
Linux hands them out to anonymous memory only after ``madvise(MADV_HUGEPAGE)`` when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the usual default), and
the advice must come before the pages are first touched, so ``host_buffer`` allocates,
advises, then fills.

``TETRAREC_HUGE_PAGES=0`` turns the advice off (for A/B measurements). Elsewhere than
Linux, on a non-CPU device or below ``_MIN_BYTES`` the buffer is a plain tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

import torch

__all__ = ["advise_huge_pages", "host_buffer"]

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14  # <linux/mman.h>
_HUGE_PAGE = 2 << 20
_MIN_BYTES = 32 << 20  # smaller buffers gain little and may sit on the malloc heap


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back ``t``'s memory with huge pages; whether the advice was taken.

    Only the 2 MiB-aligned interior of the buffer is advised. Pages touched before the
    call keep their size, so call it on a fresh ``torch.empty`` buffer.
    """
    if (
        t.device.type != "cpu"
        or t.numel() * t.element_size() < _MIN_BYTES
        or os.environ.get("TETRAREC_HUGE_PAGES", "1") == "0"
    ):
        return False
    libc = _libc()
    if libc is None:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    aligned = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    length = (end - aligned) & ~(_HUGE_PAGE - 1)
    if length <= 0:
        return False
    if libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
        err = ctypes.get_errno()
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", os.strerror(err))
        return False
    return True


def host_buffer(
    numel: int, dtype: torch.dtype, device: torch.device, fill: float | None = None
) -> torch.Tensor:
    """A 1-D buffer of ``numel`` elements on ``device``, huge-page backed when large.

    Args:
        numel: elements.
        dtype: element type.
        device: where it lives (huge pages apply to CPU buffers only).
        fill: value of every element, or ``None`` to leave it uninitialized.
    """
    t = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(t)
    if fill is not None:
        t.fill_(fill)
    return t
