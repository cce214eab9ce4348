"""A memory budget for a benchmark's child process, and the facts that show it held.

``bench cache --big`` and ``bench tiers`` run a table larger than its memory budget in
a child process under that budget. The budget must count what the SSD tier really uses,
the **page cache** of its files included, or the kernel keeps the whole file resident
and nothing is read from the disk. Methods, best first (``auto`` probes in this order):

``cgroup``
    A memory cgroup made for the child, below this process's own cgroup (so the
    child's charges still count in every group above it): cgroup v2 ``memory.max``
    where ``/sys/fs/cgroup/cgroup.controllers`` exists, else the cgroup v1 memory
    controller's ``memory.limit_in_bytes``. The child joins it before ``exec``
    (``preexec_fn``), so its anonymous memory **and the page cache it brings in** are
    charged to it; at the limit the kernel reclaims the group's own clean pages and
    writes back its dirty ones (no swap here: anonymous memory cannot go). The group's
    peak usage (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``), its failure
    count and OOM kills are read after the child exits, and the group is removed, also
    on error. Needs root (or a delegated subtree).
``systemd``
    ``systemd-run --scope -p MemoryMax=``: also a cgroup, where systemd runs.
``rlimit``
    ``RLIMIT_DATA``: the process's private writable memory only. The page cache is not
    counted, so a file-backed table stays resident: not an honest budget for the SSD
    tier (kept as the last fallback, and reported as such).

Page cache is charged to the group that first brought a page in (cgroup v1 and v2). A
file written by the parent is already cached and charged to the parent: the child would
read it from RAM for free. ``drop_file_pages`` (``fsync`` then ``posix_fadvise
DONTNEED``) evicts one file's clean pages without touching the rest of the machine's
cache (unlike ``/proc/sys/vm/drop_caches``).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

METHODS = ("auto", "cgroup", "systemd", "rlimit")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# memory.stat keys kept in reports (v1 names; v2 has anon/file/pgmajfault)
STAT_KEYS = ("cache", "rss", "mapped_file", "dirty", "writeback", "pgmajfault", "anon", "file")
_serial = 0


@dataclass(frozen=True, kw_only=True)
class MemoryGroup:
    """A memory cgroup made for one child.

    Args:
        version: 1 (the v1 memory controller) or 2 (the unified hierarchy).
        path: its directory in the cgroup file system.
        limit_bytes: the limit written to it.
    """

    version: int
    path: Path
    limit_bytes: int

    def join(self) -> None:
        """Move the calling process into the group (a child calls it before ``exec``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        """The group's peak memory usage, page cache included (None: not reported)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        f = self.path / name
        return int(f.read_text()) if f.exists() else None

    def counters(self) -> dict[str, int]:
        """Times the limit was hit (``failcnt``, v1; ``max`` events, v2), OOM kills and
        the ``STAT_KEYS`` of ``memory.stat`` (bytes; ``pgmajfault`` a count)."""
        out: dict[str, int] = {}
        if self.version == 1:
            out["failcnt"] = int((self.path / "memory.failcnt").read_text())
            events = self.path / "memory.oom_control"
        else:
            events = self.path / "memory.events"
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("oom_kill", "max", "oom"):
                out["limit_hits" if key == "max" else key] = int(value)
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in STAT_KEYS:
                out[key] = int(value)
        return out


def _own_cgroup(version: int) -> Path:
    """This process's cgroup directory in the v1 memory hierarchy or the v2 tree."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if version == 2 and number == "0" and controllers == "":
            return CGROUP_ROOT / path.lstrip("/")
        if version == 1 and "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / path.lstrip("/")
    raise OSError(f"no cgroup v{version} memory entry in /proc/self/cgroup")


def cgroup_version() -> int | None:
    """2 for the unified hierarchy, 1 for a v1 memory controller, None for neither."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return 2
    if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
        return 1
    return None


@contextlib.contextmanager
def memory_group(limit_bytes: int) -> Iterator[MemoryGroup]:
    """A fresh memory cgroup with ``limit_bytes``, below this process's own; removed after.

    Args:
        limit_bytes: the limit (> 0), page cache included.

    Yields:
        The group; move a child in with ``MemoryGroup.join`` (``preexec_fn``).

    Raises:
        ValueError: ``limit_bytes`` is not positive.
        OSError: no writable memory cgroup here (not root, no controller, or a v2 parent
            that cannot enable the memory controller for its children).
    """
    global _serial
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
    version = cgroup_version()
    if version is None:
        raise OSError("no cgroup memory controller (neither v2 nor a v1 memory hierarchy)")
    parent = _own_cgroup(version)
    _serial += 1
    path = parent / f"tetrarec-bench-{os.getpid()}-{_serial}"
    if version == 2 and "memory" not in (parent / "cgroup.subtree_control").read_text().split():
        (parent / "cgroup.subtree_control").write_text("+memory")  # EBUSY with processes in it
    path.mkdir()
    try:
        if version == 1:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            written = int((path / "memory.limit_in_bytes").read_text())
        else:
            (path / "memory.max").write_text(str(limit_bytes))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
            written = int((path / "memory.max").read_text())
        if abs(written - limit_bytes) > 2 * 4096:  # the kernel rounds to pages
            raise OSError(f"{path}: asked for a limit of {limit_bytes}, it holds {written}")
        yield MemoryGroup(version=version, path=path, limit_bytes=limit_bytes)
    finally:
        _remove_group(path, version)


def _remove_group(path: Path, version: int) -> None:
    """Remove a group whose processes have exited (retrying while the kernel drains it)."""
    if version == 1 and (path / "memory.force_empty").exists():
        with contextlib.suppress(OSError):  # reclaim its page cache first (no tasks left)
            (path / "memory.force_empty").write_text("0")
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: an exiting task is still listed
            time.sleep(0.1)
    path.rmdir()  # the real error, if it still fails


def probe_cgroup() -> str | None:
    """Whether a memory cgroup can be made and joined here: None if so, else why not.

    Runs ``true`` in a 64 MiB group and checks that the group saw the child.
    """
    try:
        with memory_group(64 * 2**20) as group:
            proc = subprocess.run(["true"], preexec_fn=group.join, check=False)
            if proc.returncode != 0:
                return f"a child in {group.path} exited with {proc.returncode}"
            if (
                group.version == 1
                and int((group.path / "memory.max_usage_in_bytes").read_text()) == 0
            ):
                return f"{group.path}: the child was not charged to the group"
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def probe_systemd() -> str | None:
    """Whether a ``systemd-run`` scope with ``MemoryMax`` starts here: None if so."""
    if shutil.which("systemd-run") is None:
        return "systemd-run not found"
    probe = ["systemd-run", "--scope", "--quiet", "-p", "MemoryMax=64M", "true"]
    proc = subprocess.run(probe, capture_output=True, text=True, check=False)
    return None if proc.returncode == 0 else f"systemd-run failed: {proc.stderr.strip()[:200]}"


def limit_method(choice: str) -> tuple[str, dict[str, str]]:
    """The method to use for ``choice``, and why each better one was passed over.

    Args:
        choice: one of ``METHODS``; ``auto`` takes the first of cgroup, systemd, rlimit
            whose probe succeeds.

    Returns:
        ``(method, {passed-over method: reason})``.

    Raises:
        ValueError: ``choice`` is not one of ``METHODS``.
    """
    if choice not in METHODS:
        raise ValueError(f"limit must be one of {METHODS}, got {choice!r}")
    if choice != "auto":
        return choice, {}
    skipped: dict[str, str] = {}
    for method, probe in (("cgroup", probe_cgroup), ("systemd", probe_systemd)):
        why = probe()
        if why is None:
            return method, skipped
        skipped[method] = why
    return "rlimit", skipped


@dataclass(frozen=True, kw_only=True)
class LimitedRun:
    """A child that ran under a memory budget, and what the budget saw.

    Args:
        returncode: the child's exit status (negative: killed by that signal).
        stderr: the child's standard error.
        method: ``cgroup``, ``systemd``, ``rlimit`` or ``none``.
        limit_bytes: the budget (None without one).
        group_peak_bytes: the cgroup's peak usage, page cache included (cgroup only).
        group: the cgroup's counters (``MemoryGroup.counters``; cgroup only).
        cgroup_version: 1 or 2 (cgroup only).
    """

    returncode: int
    stderr: str
    method: str
    limit_bytes: int | None
    group_peak_bytes: int | None = None
    group: dict[str, int] | None = None
    cgroup_version: int | None = None

    def summary(self) -> dict[str, object]:
        """The budget's facts as report fields."""
        return {
            "limit": self.method,
            "limit_bytes": self.limit_bytes,
            "cgroup_version": self.cgroup_version,
            "group_peak_bytes": self.group_peak_bytes,
            "group_counters": self.group,
        }


def run_limited(argv: list[str], method: str, limit_bytes: int | None) -> LimitedRun:
    """Run ``argv`` to completion under ``limit_bytes`` by ``method`` (``none``: no limit).

    Args:
        argv: the child's command line (its stdout goes to this process's stdout).
        method: ``cgroup``, ``systemd``, ``rlimit`` or ``none``.
        limit_bytes: the budget (ignored for ``none``).

    Returns:
        The exit status, standard error and, under ``cgroup``, the group's peak and
        counters (read after the child exited, before the group is removed).

    Raises:
        ValueError: an unknown ``method``, or no ``limit_bytes`` for a real one.
    """
    if method == "none":
        proc = subprocess.run(argv, stderr=subprocess.PIPE, text=True, check=False)
        return LimitedRun(
            returncode=proc.returncode, stderr=proc.stderr, method=method, limit_bytes=None
        )
    if limit_bytes is None or method not in METHODS[1:]:
        raise ValueError(
            f"method must be one of {(*METHODS[1:], 'none')} with a limit, got {method!r}"
        )
    if method == "cgroup":
        with memory_group(limit_bytes) as group:
            proc = subprocess.run(
                argv, stderr=subprocess.PIPE, text=True, preexec_fn=group.join, check=False
            )
            return LimitedRun(
                returncode=proc.returncode,
                stderr=proc.stderr,
                method=method,
                limit_bytes=limit_bytes,
                group_peak_bytes=group.peak_bytes(),
                group=group.counters(),
                cgroup_version=group.version,
            )
    preexec: Callable[[], None] | None = None
    if method == "systemd":
        argv = ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={limit_bytes}", *argv]
    else:

        def preexec() -> None:
            resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))

    proc = subprocess.run(argv, stderr=subprocess.PIPE, text=True, preexec_fn=preexec, check=False)
    return LimitedRun(
        returncode=proc.returncode, stderr=proc.stderr, method=method, limit_bytes=limit_bytes
    )


def mount_of(path: Path) -> dict[str, str]:
    """The mount holding ``path``: its mount point, source device and file system type."""
    target = str(path.resolve())
    best = {"mount": "", "source": "unknown", "fs": "unknown"}
    with open("/proc/mounts") as f:
        for line in f:
            source, mount, fs = line.split()[:3]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best["mount"]):
                best = {"mount": mount, "source": source, "fs": fs}
    return best


def require_disk(path: Path) -> dict[str, str]:
    """``mount_of(path)``, refusing a file system held in RAM.

    Raises:
        ValueError: ``path`` is on tmpfs or ramfs (its "files" are memory: under a
            cgroup limit they cannot be reclaimed without swap, and nothing is read
            from a disk). Name a directory on the disk (``--ssd-dir``).
    """
    m = mount_of(path)
    if m["fs"] in ("tmpfs", "ramfs"):
        raise ValueError(
            f"{path} is on {m['fs']} ({m['mount']}): memory, not a disk; pass a directory "
            "on the SSD (--ssd-dir)"
        )
    return m


def drop_file_pages(path: Path) -> None:
    """Write ``path``'s dirty pages to the disk and evict its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_io() -> dict[str, int]:
    """This process's ``/proc/self/io``: ``read_bytes`` and ``write_bytes`` are what
    reached the storage layer (page-cache hits are not in them)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value)
    return out


def block_device_facts(path: Path) -> dict[str, object]:
    """The disk under ``path``: device, rotational flag, scheduler, read-ahead (sysfs)."""
    m = require_disk(path) if path.exists() else mount_of(path.parent)
    out: dict[str, object] = dict(m)
    name = Path(m["source"]).name
    block = Path("/sys/class/block") / name
    if block.exists():
        for key in ("queue/rotational", "queue/scheduler", "queue/read_ahead_kb", "size"):
            f = block / key
            if not f.exists():
                f = block.parent / key  # a partition: its disk's queue
            if f.exists():
                out[key.split("/")[-1]] = f.read_text().strip()
    return out
