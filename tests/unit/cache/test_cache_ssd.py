"""The SSD tier: backing rows in memory-mapped files train as in process memory."""

import dataclasses
import gc
import resource
import shutil
from pathlib import Path

import pytest
import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec
from tetrarec.cache.files import map_to_files
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

TABLES = [
    TableConfig(name="a", num_embeddings=40, dim=6, precision="int8"),
    TableConfig(name="b", num_embeddings=20, dim=4, precision="fp16", pooling="mean"),
]
ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2)


def batches(n):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        bags = {
            t.name: [
                (torch.rand(3, generator=gen) ** 2 * t.num_embeddings).long().tolist()
                for _ in range(4)
            ]
            for t in TABLES
        }
        out.append(SparseFeatures.from_lists(bags))
    return out


def train(module, data):
    for i, sf in enumerate(data):
        out = module(sf).values
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(i)))


def test_ssd_tier_trains_as_the_in_memory_backing_and_its_files_have_the_table_size(tmp_path):
    """Placement ``ssd`` (one table) equals ``cached`` bitwise; files sized as the store.

    Catches: rows or state not initialized in the file (zeros), writes that do not reach
    the file-backed tensor, a file of the wrong size (rows lost or overrun), files left
    behind after the module is gone.
    """
    spec = CacheSpec(fraction=0.2, directory=str(tmp_path))
    ssd = CachedEmbeddingBagCollection(TABLES, ADAGRAD, spec, placements={"a": "ssd"}, seed=3)
    ram = CachedEmbeddingBagCollection(TABLES, ADAGRAD, spec, seed=3)
    data = batches(5)
    train(ssd, data)
    train(ram, data)
    for key, value in ram.state_dict().items():
        assert torch.equal(ssd.state_dict()[key], value), key
    row_bytes = Precision.INT8.row_bytes(6)  # 6 codes, fp16 scale and bias, aligned
    assert ssd.memory().backing_ssd == 40 * row_bytes
    files = {p.name: p.stat().st_size for p in ssd.ssd_files()}
    assert files == {"rows-0-int8.bin": 40 * row_bytes, "state-0-sum.bin": 40 * 4}
    # the file holds the table: its bytes are the saved rows of table "a"
    rows = torch.from_file(str(ssd.ssd_files()[0]), size=40 * row_bytes, dtype=torch.uint8)
    assert torch.equal(rows.view(40, row_bytes), ssd.state_dict()["weights.a"])
    directory = ssd.ssd_files()[0].parent
    del ssd
    gc.collect()  # the module and its optimizer refer to each other
    assert not directory.exists()


def test_ssd_tier_with_every_table_on_file(tmp_path):
    """Catches: a collection with no in-memory backing part (only ssd tables) failing."""
    spec = CacheSpec(policy="lfu", fraction=0.25, directory=str(tmp_path))
    tables = [dataclasses.replace(t, precision="bf16") for t in TABLES]
    ssd = CachedEmbeddingBagCollection(
        tables, ADAGRAD, spec, placements={"a": "ssd", "b": "ssd"}, seed=1
    )
    ram = CachedEmbeddingBagCollection(tables, ADAGRAD, spec, seed=1)
    data = batches(4)
    train(ssd, data)
    train(ram, data)
    for name, w in ram.table_weights().items():
        assert torch.equal(ssd.table_weights()[name], w), name
    assert ssd.memory().backing_ram == 0


def test_ssd_rows_written_in_small_chunks_are_the_in_memory_rows(tmp_path):
    """Catches: a chunked write of the initial rows into the files that skips, repeats
    or shifts rows at chunk boundaries (7-row chunks over 40 and 20 rows)."""
    fused = FusedEmbeddingBagCollection(TABLES, ADAGRAD, seed=5)
    meta = FusedEmbeddingBagCollection(TABLES, ADAGRAD, seed=5, device="meta")
    directory = map_to_files(meta, ADAGRAD, str(tmp_path), init_chunk_rows=7)
    for i in range(len(TABLES)):
        assert torch.equal(meta._table_rows(i), fused._table_rows(i)), TABLES[i].name
    shutil.rmtree(directory)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_ssd_table_beyond_a_data_limit_initializes_in_chunks(tmp_path):
    """An SSD table of 400k x 64 INT8 rows builds with 112 MiB of private memory to spare.

    Catches: the initial rows written in chunks of up to 1M FP32 rows (here the whole
    table at once: 102 MB of process memory, more than its 27 MB file) when the store
    is a file, which breaks any memory budget the file-backed table is meant to exceed.
    """
    table = TableConfig(name="big", num_embeddings=400_000, dim=64, precision="int8")
    spec = CacheSpec(fraction=0.001, directory=str(tmp_path))
    # imports and the kernel library load before the limit (they map memory too)
    small = dataclasses.replace(table, num_embeddings=10)
    CachedEmbeddingBagCollection([small], ADAGRAD, spec, placements={"big": "ssd"})
    gc.collect()
    with open("/proc/self/status") as f:
        vm_data = next(int(ln.split()[1]) for ln in f if ln.startswith("VmData:")) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data + 112 * 2**20, hard))
    try:
        ebc = CachedEmbeddingBagCollection([table], ADAGRAD, spec, placements={"big": "ssd"})
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    assert ebc.memory().backing_ssd == 400_000 * Precision.INT8.row_bytes(64)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux smaps")
def test_ssd_files_are_mapped_for_random_reads(tmp_path):
    """Every SSD file map is advised MADV_RANDOM (``rr`` in its smaps VmFlags).

    Catches: a map left with the kernel's read-around, where each fault on a missed row
    reads ``read_ahead_kb`` of the file (8 MiB on the development VM: 2.2 GB per step
    for 8,200 rows in ``bench tiers``).
    """
    spec = CacheSpec(fraction=0.2, directory=str(tmp_path))
    ebc = CachedEmbeddingBagCollection(
        TABLES, ADAGRAD, spec, placements={"a": "ssd", "b": "ssd"}, seed=0
    )
    files = {str(p) for p in ebc.ssd_files()}
    flags, current = {}, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
            current = parts[5] if len(parts) > 5 and parts[5] in files else None
        elif parts[0] == "VmFlags:" and current is not None:
            flags[current] = parts[1:]
    assert set(flags) == files
    assert all("rr" in f for f in flags.values()), flags


def _resident_pages(t: torch.Tensor) -> set[int]:
    """Indices of ``t``'s pages in memory, from the page holding its first byte."""
    import ctypes
    import os

    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = t.data_ptr() // page * page
    n = (t.data_ptr() + t.numel() * t.element_size() - start + page - 1) // page
    vec = np.zeros(n, dtype=np.uint8)
    assert libc.mincore(start, n * page, vec.ctypes.data) == 0
    return set(np.flatnonzero(vec & 1).tolist())


def _drop_pages(t: torch.Tensor, path: Path) -> None:
    """Write ``t``'s file map out, unmap its pages from this process, drop them from the
    page cache (a mapped page is never dropped)."""
    import ctypes
    import mmap
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = (t.data_ptr() + t.numel() * t.element_size() - start + page - 1) // page * page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.msync(start, length, 4) == 0  # MS_SYNC (Linux)
    assert libc.madvise(start, length, mmap.MADV_DONTNEED) == 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_prefetch_asks_for_exactly_the_missing_pages_of_the_rows(tmp_path):
    """``prefetch_rows`` reads the pages of the rows asked for, and only those.

    Catches: addresses computed from the wrong row width or base (other pages read, or
    an error for an address outside the map), a row that straddles two pages counted
    once, resident pages asked for again, advice never given (nothing becomes resident).
    """
    import os
    import time

    from tetrarec.cache.files import advise_random_, prefetch_rows

    page = os.sysconf("SC_PAGE_SIZE")
    width = 1000  # bytes per row: rows straddle page boundaries
    path = tmp_path / "rows.bin"
    t = torch.from_file(str(path), shared=True, size=200 * width, dtype=torch.uint8)
    advise_random_(t)
    t.copy_(torch.arange(200 * width, dtype=torch.int64).remainder(251).to(torch.uint8))
    before = t.clone()
    _drop_pages(t, path)
    if _resident_pages(t):
        pytest.skip(f"{tmp_path} keeps its pages in memory (a tmpfs): nothing to prefetch")
    rows = torch.tensor([3, 3, 150, 4])  # 3 and 4 share a page; 4 straddles two
    want = set()
    for r in (3, 4, 150):
        want |= {r * width // page, (r * width + width - 1) // page}
    view = t.view(200, width)
    assert prefetch_rows(view, rows) == len(want)
    deadline = time.monotonic() + 5
    while not want <= _resident_pages(t) and time.monotonic() < deadline:
        time.sleep(0.01)
    got = _resident_pages(t)
    assert want <= got
    assert got <= want, f"pages read that no row asked for: {sorted(got - want)}"
    assert prefetch_rows(view, rows) == 0  # now resident: not asked for again
    assert torch.equal(t, before)


def test_ssd_tables_prefetch_their_missed_rows_and_train_as_in_memory(tmp_path):
    """With its file pages dropped, an SSD table's policy step asks for its rows' pages
    ahead of the reads, and training still equals the in-memory backing bitwise.

    Catches: the prefetch never wired into the policy step (no page asked for), or one
    that changes what is read or written (any bit off against ``cached``).
    """
    spec = CacheSpec(fraction=0.2, directory=str(tmp_path))
    ssd = CachedEmbeddingBagCollection(TABLES, ADAGRAD, spec, placements={"a": "ssd"}, seed=3)
    ram = CachedEmbeddingBagCollection(TABLES, ADAGRAD, spec, seed=3)
    data = batches(6)
    train(ssd, data[:3])
    train(ram, data[:3])
    backing, k = ssd._backing(0)
    maps = [backing._table_rows(k), *backing._table_state(k).values()]
    for t, path in zip(maps, ssd.ssd_files()):
        _drop_pages(t, path)
    if any(_resident_pages(t) for t in maps):
        pytest.skip(f"{tmp_path} keeps its pages in memory (a tmpfs): nothing to prefetch")
    before = ssd.prefetched_pages
    train(ssd, data[3:])
    train(ram, data[3:])
    assert ssd.prefetched_pages > before
    for key, value in ram.state_dict().items():
        assert torch.equal(ssd.state_dict()[key], value), key


def test_a_full_disk_fails_when_the_files_are_made_and_leaves_nothing(tmp_path, monkeypatch):
    """A sparse file on a full disk mapped fine, then the first write of the initial rows
    killed the process with SIGBUS (no message), and the scratch directory stayed behind,
    filling the disk for the next run. The files' blocks are now reserved first
    (``posix_fallocate``): ENOSPC is an OSError naming the file and bytes, and the new
    directory is deleted."""
    import errno
    import os

    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate here")

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    meta = FusedEmbeddingBagCollection(TABLES, ADAGRAD, seed=5, device="meta")
    with pytest.raises(
        OSError,
        match=r"cannot reserve [\d,]+ bytes for rows-0-\w+\.bin in .* \(No space left on device\)",
    ) as info:
        map_to_files(meta, ADAGRAD, str(tmp_path))
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
