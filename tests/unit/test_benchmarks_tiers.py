"""The memory budget of the SSD-tier benchmarks (``benchmarks/_memory_limit.py``) and the
stores of ``benchmarks/bench_tiers.py``. Timings are never asserted.

The cgroup tests need a writable memory cgroup (root, or a delegated subtree) and skip
without one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench_module(name: str) -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


limit = _bench_module("_memory_limit")
tiers = _bench_module("bench_tiers")


def _no_cgroup() -> str | None:
    """Why no memory cgroup can be made here (None: one can). Not ``probe_cgroup``:
    that also checks the child is charged, which is what the tests below check."""
    try:
        with limit.memory_group(64 * 2**20):
            return None
    except OSError as e:
        return str(e)


NO_CGROUP = _no_cgroup()
needs_cgroup = pytest.mark.skipif(NO_CGROUP is not None, reason=f"no memory cgroup: {NO_CGROUP}")
MIB = 2**20


@needs_cgroup
def test_cgroup_budget_counts_the_page_cache_of_a_mapped_file(tmp_path: Path) -> None:
    """Fails if the child is not charged to the group (it would keep the whole file
    resident, as under RLIMIT_DATA) or if the file's pages were left cached by the parent
    (the child would then read RAM, not the disk)."""
    data = tmp_path / "rows.bin"
    data.write_bytes(os.urandom(64 * MIB))
    limit.drop_file_pages(data)
    code = (
        "import mmap, sys\n"
        f"f = open({str(data)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "s = sum(m[i] for i in range(0, len(m), 4096))\n"
        "io = dict(l.split(': ') for l in open('/proc/self/io').read().splitlines())\n"
        "st = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines())\n"
        "sys.stderr.write(f\"{io['read_bytes']} {st['RssFile'].split()[0]}\")\n"
    )
    run = limit.run_limited([sys.executable, "-S", "-c", code], "cgroup", 24 * MIB)
    assert run.returncode == 0, run.stderr
    read_bytes, rss_file_kib = map(int, run.stderr.split()[-2:])
    assert read_bytes >= 64 * MIB  # every page came from the disk
    # the kernel dropped the file's pages to stay in budget (RssFile also holds the
    # interpreter's own pages, cached and charged elsewhere before the child ran)
    assert rss_file_kib * 1024 < 40 * MIB
    assert run.group_peak_bytes is not None
    assert 0 < run.group_peak_bytes <= 24 * MIB
    assert run.summary()["limit"] == "cgroup"


@needs_cgroup
def test_cgroup_reports_an_oom_kill_and_is_removed_after() -> None:
    """Fails if a child killed at the budget is not reported as such, or if the group
    is left behind."""
    code = "b = bytearray(64 << 20); b[::4096] = bytes(len(b[::4096]))"
    run = limit.run_limited([sys.executable, "-S", "-c", code], "cgroup", 32 * MIB)
    assert run.returncode < 0
    assert run.group is not None
    assert run.group.get("oom_kill", run.group.get("oom", 0)) >= 1
    parent = limit._own_cgroup(limit.cgroup_version())
    assert not list(parent.glob(f"tetrarec-bench-{os.getpid()}-*"))


@needs_cgroup
def test_cgroup_is_removed_when_the_body_raises() -> None:
    """Fails if an error inside the ``with`` leaks the group."""
    seen: list[Path] = []

    def body() -> None:
        with limit.memory_group(64 * MIB) as group:
            seen.append(group.path)
            assert (group.path / "cgroup.procs").exists()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        body()
    assert seen
    assert not seen[0].exists()


def test_limit_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match="cgroup"):
        limit.limit_method("ulimit")
    assert limit.limit_method("rlimit") == ("rlimit", {})
    with pytest.raises(ValueError, match="limit_bytes"), limit.memory_group(0):
        pass


def test_require_disk_refuses_a_tmpfs() -> None:
    """Fails if SSD files could be put in RAM and reported as on the disk."""
    with open("/proc/mounts") as f:
        tmpfs = [ln.split()[1] for ln in f if ln.split()[2] == "tmpfs"]
    usable = [m for m in tmpfs if os.path.isdir(m)]
    if not usable:
        pytest.skip("no tmpfs mounted here")
    with pytest.raises(ValueError, match="tmpfs"):
        limit.require_disk(Path(usable[0]))


@pytest.mark.parametrize("name", tiers.STORES)
def test_store_reads_the_rows_asked_for_and_keeps_writes(name: str, tmp_path: Path) -> None:
    """Fails if a store returns rows out of order or of other ids, or loses a write."""
    stores, skipped = tiers.make_stores(tmp_path, [name])
    if skipped:
        pytest.skip(skipped[name])
    (store,) = stores
    files = store.build(3000, np.random.default_rng(0))
    assert sum(f.stat().st_size for f in files) >= 3000 * tiers.ROW_BYTES
    store.open()
    try:
        ids = np.array([0, 5, 17, 2048, 2999], dtype=np.int64)
        tiers.check_ids(store.read(ids), ids, name)
        new = tiers.make_rows(ids[1:4], np.random.default_rng(1))
        store.write(ids[1:4], new)
        got = store.read(ids)
        np.testing.assert_array_equal(got[1:4], new)
    finally:
        store.close()
    store.open()  # and after reopening
    try:
        np.testing.assert_array_equal(store.read(ids[1:4]), new)
    finally:
        store.close()


def test_check_ids_catches_a_row_of_another_id() -> None:
    ids = np.array([3, 4, 9], dtype=np.int64)
    rows = tiers.make_rows(ids, np.random.default_rng(0))
    tiers.check_ids(rows, ids, "x")
    with pytest.raises(AssertionError, match="asked for row 4, got row 9"):
        tiers.check_ids(rows[[0, 2, 1]], ids, "x")


def test_misses_leave_out_the_cached_rows() -> None:
    """Fails if the hot rows the cache holds are counted as reads from the store."""
    args = tiers.parse_args(["--smoke"])
    steps = tiers.misses_per_step(args, np.random.default_rng(0))
    assert len(steps) == args.rounds * args.steps + 1
    hot = (np.arange(int(args.cache_fraction * args.rows)) * 2_654_435_761 + 12_345) % args.rows
    for ids in steps:
        assert len(ids)
        assert np.all(np.diff(ids) > 0)
        assert not np.isin(ids, hot).any()
