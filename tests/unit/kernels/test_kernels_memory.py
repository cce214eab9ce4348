"""Huge-page-backed host buffers for the flat tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tetrarec.kernels.memory import advise_huge_pages, host_buffer

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_memory_host_buffer_is_filled_and_typed() -> None:
    t = host_buffer(3 << 20, torch.float32, torch.device("cpu"), fill=0.25)
    assert t.shape == (3 << 20,)
    assert t.dtype == torch.float32
    assert bool((t == 0.25).all())
    assert host_buffer(5, torch.float16, torch.device("cpu")).dtype == torch.float16


def test_memory_small_or_disabled_buffers_are_not_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not advise_huge_pages(torch.empty(1024))
    monkeypatch.setenv("TETRAREC_HUGE_PAGES", "0")
    assert not advise_huge_pages(torch.empty(16 << 20))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_memory_large_buffer_gets_huge_pages_where_the_kernel_allows() -> None:
    t = torch.empty(16 << 20)  # 64 MiB
    assert advise_huge_pages(t)
    if not _THP.exists() or "[never]" in _THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    t.fill_(1.0)  # first touch, after the advice
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    huge_kib = 0
    current = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header line: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo < end and start < hi
        elif current and line.startswith("AnonHugePages:"):
            huge_kib += int(line.split()[1])
    assert huge_kib >= 32 << 10  # most of the 64 MiB sits on 2 MiB pages
