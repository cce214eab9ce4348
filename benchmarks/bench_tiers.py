"""The SSD tier's store, by measurement: a memory map against pread/pwrite, SQLite and LMDB.

Per training step the SSD tier (``docs/design/cache.md``, "The SSD tier") reads the rows
of the batch's unique missed ids (admitted into the FP32 cache) and writes back the dirty
rows the cache evicts. This script does exactly that, for a table larger than its memory
budget, in one child process under the budget (``_memory_limit.py``: by default a memory
cgroup, which counts the page cache), for each store:

    mmap     torch.from_file(shared=True) of a flat file, rows[ids] and rows[ids] = new
             (what the ``ssd`` placement shipped until this benchmark measured it)
    mmap-random  the same map after madvise(MADV_RANDOM) (``advise_random_``, what the
             ``ssd`` placement does now): a page fault reads its page only, not the
             kernel's read-around window (``read_ahead_kb``) around it
    mmap-prefetch  mmap-random that first asks for all the step's rows at once
             (posix_fadvise WILLNEED per row), so many reads are in flight (a candidate,
             not what ships)
    pread    os.preadv / os.pwritev of each row of the same flat file (no user-space cache)
    sqlite   sqlite3 (standard library): one BLOB per row keyed by its id (INTEGER PRIMARY
             KEY), WAL journal; reads ``id IN (...)`` in chunks, writes one executemany in
             one transaction per step
    lmdb     the ``lmdb`` binding (optional: ``pip install lmdb``; skipped with a note
             when absent): 8-byte big-endian keys, ``getmulti`` in one read transaction,
             ``putmulti`` in one write transaction per step

A row is 72 bytes: an INT8 row of D = 64 (64 codes + FP16 scale and bias, 68 B) and its
row-wise Adagrad state (4 B), one record per row, the same bytes in every store; its
first 8 bytes hold its id, which every read checks. Ids per step: ``--batch`` x
``--pooling`` Zipf(1.05) ids (``bench_cache.zipf_ids``), unique, minus a static cache of
the ``--cache-fraction`` hottest rows: the misses. Write-back: the previous step's misses
with new contents (at steady state LRU evicts as many rows as it admits). No store
forces data to the disk on commit (the SSD files are scratch; a checkpoint holds the
rows): SQLite ``synchronous=OFF``, LMDB ``sync=False``, the map is never ``msync``ed.

The stores are built by this process, their pages are dropped from the page cache
(``fsync`` + ``fadvise DONTNEED``: otherwise they are cached and charged to this
process, and the child would read them from RAM for free), and the child times
``--rounds`` rounds; each round runs every store for ``--steps`` steps on the same ids,
starting with the next store each round. Rows/s read and written, the ratio to ``mmap``
(median of the per-round ratios) and the bytes that reached the disk per step
(``/proc/self/io``).

    tetrarec bench tiers [--rows 16000000] [--budget-mib 512] [--limit auto] [--json PATH]
    python benchmarks/bench_tiers.py --smoke      # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from _cache_big import zipf_ids
from _harness import (
    cpu_summary,
    describe_run,
    json_path,
    print_table,
    unwind_on_signals,
    write_json,
)
from _memory_limit import (
    METHODS,
    block_device_facts,
    disk_io,
    drop_file_pages,
    limit_method,
    run_limited,
)

from tetrarec.cache.files import advise_random_

ROW_BYTES = 72  # INT8 row of D = 64 (64 codes + FP16 scale, bias) + row-wise Adagrad state
BUILD_CHUNK = 1 << 20  # rows generated at a time while building
STORES = ("mmap", "mmap-random", "mmap-prefetch", "pread", "sqlite", "lmdb")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16_000_000, help="rows of the table")
    p.add_argument("--budget-mib", type=int, default=512, help="memory budget of the child")
    p.add_argument("--limit", choices=(*METHODS, "none"), default="auto")
    p.add_argument("--dir", help="directory of the stores (default: the temp dir; not tmpfs)")
    p.add_argument("--stores", default=",".join(STORES), help="comma-separated subset")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--cache-fraction", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps per store per round")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, no budget check")
    p.add_argument("--json", type=json_path, metavar="PATH")
    p.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.batch, args.pooling, args.rounds, args.steps = 50_000, 256, 4, 2, 2
    unknown = set(args.stores.split(",")) - set(STORES)
    if unknown:
        p.error(f"--stores: unknown {sorted(unknown)}; valid: {', '.join(STORES)}")
    return args


# -- the rows -------------------------------------------------------------------------------


def make_rows(ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(len(ids), ROW_BYTES)`` uint8 rows: random bytes, each headed by its id (int64)."""
    rows = rng.integers(0, 256, (len(ids), ROW_BYTES), dtype=np.uint8)
    rows[:, :8] = ids.astype("<i8").view(np.uint8).reshape(-1, 8)
    return rows


def check_ids(rows: np.ndarray, ids: np.ndarray, store: str) -> None:
    """Raise if a row read for ``ids`` does not carry its id (the store returned another)."""
    got = rows[:, :8].copy().view("<i8").ravel()
    if not np.array_equal(got, ids):
        bad = int(np.flatnonzero(got != ids)[0])
        raise AssertionError(f"{store}: asked for row {ids[bad]}, got row {got[bad]}")


def _chunks(rows: int) -> Iterator[np.ndarray]:
    for start in range(0, rows, BUILD_CHUNK):
        yield np.arange(start, min(rows, start + BUILD_CHUNK), dtype=np.int64)


# -- the stores -----------------------------------------------------------------------------


class Store(Protocol):
    """One way to hold the rows. Call order: ``build`` (parent), then in the child
    ``open``, ``read``/``write`` per step, ``close``."""

    name: str

    def build(self, rows: int, rng: np.random.Generator) -> list[Path]:
        """Write every row; the files made (to drop from the page cache)."""
        ...

    def open(self) -> None:
        """Open the built store."""
        ...

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (sorted, unique) as ``(n, ROW_BYTES)`` uint8, in order."""
        ...

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store ``rows`` at ``ids`` (sorted, unique)."""
        ...

    def close(self) -> None:
        """Close it (flushing what it buffers, without forcing it to the disk)."""
        ...


class FlatFile:
    """Rows at ``id * ROW_BYTES`` of one file: the layout of the ``ssd`` placement."""

    def __init__(self, directory: Path, name: str) -> None:
        self.name = name
        self.path = directory / f"{name}.bin"

    def build(self, rows: int, rng: np.random.Generator) -> list[Path]:
        with open(self.path, "wb") as f:
            for ids in _chunks(rows):
                f.write(make_rows(ids, rng).tobytes())
        return [self.path]


class MmapStore(FlatFile):
    """``torch.from_file(shared=True)``: the page cache is the store (what ships)."""

    def open(self) -> None:
        n = self.path.stat().st_size
        flat = torch.from_file(str(self.path), shared=True, size=n, dtype=torch.uint8)
        self.rows = flat.view(n // ROW_BYTES, ROW_BYTES)

    def read(self, ids: np.ndarray) -> np.ndarray:
        return self.rows[torch.from_numpy(ids)].numpy()

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self.rows[torch.from_numpy(ids)] = torch.from_numpy(rows)

    def close(self) -> None:
        del self.rows


class RandomMmapStore(MmapStore):
    """``MmapStore`` plus ``madvise(MADV_RANDOM)`` on the map: a fault reads its own page,
    not the kernel's read-around window (128 KiB by default) of neighbours never used."""

    def open(self) -> None:
        super().open()
        advise_random_(self.rows)


class PrefetchMmapStore(RandomMmapStore):
    """``RandomMmapStore`` that first asks for all of a step's pages at once
    (``posix_fadvise(WILLNEED)`` per row: the kernel queues the reads without waiting),
    so the disk sees many reads in flight instead of one fault at a time."""

    def open(self) -> None:
        super().open()
        self.fd = os.open(self.path, os.O_RDONLY)

    def _prefetch(self, ids: np.ndarray) -> None:
        fd = self.fd
        for off in (ids * ROW_BYTES).tolist():
            os.posix_fadvise(fd, off, ROW_BYTES, os.POSIX_FADV_WILLNEED)

    def read(self, ids: np.ndarray) -> np.ndarray:
        self._prefetch(ids)
        return super().read(ids)

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self._prefetch(ids)  # a row is written into its page: the page is read first
        super().write(ids, rows)

    def close(self) -> None:
        os.close(self.fd)
        super().close()


class PreadStore(FlatFile):
    """One ``os.preadv`` / ``os.pwritev`` per row, no cache of its own."""

    def open(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR)

    def read(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), ROW_BYTES), dtype=np.uint8)
        view = memoryview(out).cast("B")
        fd = self.fd
        for k, off in enumerate((ids * ROW_BYTES).tolist()):
            os.preadv(fd, [view[k * ROW_BYTES : (k + 1) * ROW_BYTES]], off)
        return out

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(rows)).cast("B")
        fd = self.fd
        for k, off in enumerate((ids * ROW_BYTES).tolist()):
            os.pwritev(fd, [view[k * ROW_BYTES : (k + 1) * ROW_BYTES]], off)

    def close(self) -> None:
        os.close(self.fd)


class SqliteStore:
    """sqlite3: ``rows(id INTEGER PRIMARY KEY, v BLOB)``, WAL, no sync."""

    # SQLite >= 3.32 allows 32,766 parameters per statement (999 before)
    CHUNK = 30_000 if sqlite3.sqlite_version_info >= (3, 32) else 999

    def __init__(self, directory: Path) -> None:
        self.name = "sqlite"
        self.path = directory / "rows.sqlite"

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, isolation_level=None)  # explicit transactions
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=OFF")
        return con

    def build(self, rows: int, rng: np.random.Generator) -> list[Path]:
        con = self._connect()
        con.execute("CREATE TABLE rows (id INTEGER PRIMARY KEY, v BLOB NOT NULL)")
        for ids in _chunks(rows):
            data = make_rows(ids, rng)
            con.execute("BEGIN")
            con.executemany(
                "INSERT INTO rows (id, v) VALUES (?, ?)",
                zip(ids.tolist(), (r.tobytes() for r in data)),
            )
            con.execute("COMMIT")
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
        return [p for p in self.path.parent.glob(self.path.name + "*") if p.is_file()]

    def open(self) -> None:
        self.con = self._connect()

    def read(self, ids: np.ndarray) -> np.ndarray:
        parts: list[bytes] = []
        for start in range(0, len(ids), self.CHUNK):
            chunk = ids[start : start + self.CHUNK].tolist()
            marks = ",".join("?" * len(chunk))
            got = self.con.execute(
                f"SELECT id, v FROM rows WHERE id IN ({marks}) ORDER BY id", chunk
            ).fetchall()
            if len(got) != len(chunk):
                raise KeyError(f"sqlite: {len(chunk) - len(got)} of the ids are missing")
            parts += [v for _, v in got]
        return np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(len(ids), ROW_BYTES)

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self.con.execute("BEGIN")
        self.con.executemany(
            "UPDATE rows SET v = ? WHERE id = ?", zip((r.tobytes() for r in rows), ids.tolist())
        )
        self.con.execute("COMMIT")

    def close(self) -> None:
        self.con.close()


class LmdbStore:
    """LMDB: 8-byte big-endian keys (id order = key order), no sync, no read-ahead."""

    def __init__(self, directory: Path, lmdb: Any) -> None:
        self.name = "lmdb"
        self.path = directory / "rows.lmdb"
        self.lmdb = lmdb

    def _env(self, rows: int) -> Any:
        size = max(1 << 26, 3 * rows * (ROW_BYTES + 32))  # the map's upper bound
        return self.lmdb.open(
            str(self.path), map_size=size, sync=False, metasync=False, readahead=False
        )

    @staticmethod
    def _keys(ids: np.ndarray) -> list[bytes]:
        raw = ids.astype(">u8").tobytes()
        return [raw[i : i + 8] for i in range(0, len(raw), 8)]

    def build(self, rows: int, rng: np.random.Generator) -> list[Path]:
        env = self._env(rows)
        for ids in _chunks(rows):
            data = make_rows(ids, rng)
            with env.begin(write=True) as txn:
                txn.cursor().putmulti(
                    zip(self._keys(ids), (r.tobytes() for r in data)), append=True
                )
        env.close()
        return [p for p in self.path.iterdir() if p.is_file()]

    def open(self) -> None:
        rows = (self.path / "data.mdb").stat().st_size // ROW_BYTES
        self.env = self._env(rows)

    def read(self, ids: np.ndarray) -> np.ndarray:
        with self.env.begin() as txn:
            got = txn.cursor().getmulti(self._keys(ids))
        if len(got) != len(ids):
            raise KeyError(f"lmdb: {len(ids) - len(got)} of the ids are missing")
        return np.frombuffer(b"".join(v for _, v in got), dtype=np.uint8).reshape(
            len(ids), ROW_BYTES
        )

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(self._keys(ids), (r.tobytes() for r in rows)))

    def close(self) -> None:
        self.env.close()


def make_stores(directory: Path, names: list[str]) -> tuple[list[Store], dict[str, str]]:
    """The stores asked for, and a note for each that cannot run here."""
    stores: list[Store] = []
    skipped: dict[str, str] = {}
    for name in names:
        if name == "mmap":
            stores.append(MmapStore(directory, "mmap"))
        elif name == "mmap-random":
            stores.append(RandomMmapStore(directory, "mmap-random"))
        elif name == "mmap-prefetch":
            stores.append(PrefetchMmapStore(directory, "mmap-prefetch"))
        elif name == "pread":
            stores.append(PreadStore(directory, "pread"))
        elif name == "sqlite":
            stores.append(SqliteStore(directory))
        else:
            try:
                import lmdb
            except ImportError:
                skipped[name] = "the lmdb module is not installed (pip install lmdb)"
                continue
            stores.append(LmdbStore(directory, lmdb))
    return stores, skipped


# -- the child: timed rounds under the budget -----------------------------------------------


def misses_per_step(args: argparse.Namespace, rng: np.random.Generator) -> list[np.ndarray]:
    """Each step's unique missed ids (sorted): Zipf ids minus the static hot rows."""
    hot_ranks = np.arange(int(args.cache_fraction * args.rows), dtype=np.int64)
    hot = np.unique((hot_ranks * 2_654_435_761 + 12_345) % args.rows)  # zipf_ids' spreading
    out = []
    for _ in range(args.rounds * args.steps + 1):  # + 1: the write-back of the first step
        ids = np.unique(zipf_ids(args.rows, args.batch * args.pooling, 1.05, rng).numpy())
        out.append(ids[~np.isin(ids, hot, assume_unique=True)])
    return out


def run_store(store: Store, steps: list[np.ndarray], rng: np.random.Generator) -> dict[str, Any]:
    """Read ``steps[k + 1]`` and write back ``steps[k]`` per step; times and disk bytes."""
    read_s = write_s = 0.0
    rows_read = rows_written = 0
    io0 = disk_io()
    for prev, ids in itertools.pairwise(steps):
        t = time.perf_counter()
        got = store.read(ids)
        read_s += time.perf_counter() - t
        check_ids(got, ids, store.name)
        new = make_rows(prev, rng)
        t = time.perf_counter()
        store.write(prev, new)
        write_s += time.perf_counter() - t
        rows_read += len(ids)
        rows_written += len(prev)
    io1 = disk_io()
    return {
        "read_s": read_s,
        "write_s": write_s,
        "rows_read": rows_read,
        "rows_written": rows_written,
        "disk_read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "disk_write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "last": (prev, new),
    }


def child(args: argparse.Namespace) -> None:
    """Time every store in rounds under the budget; write the per-round figures."""
    torch.set_num_threads(1)
    stores, _ = make_stores(Path(args.child), args.stores.split(","))
    for s in stores:
        s.open()
    ids = misses_per_step(args, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in stores}
    last: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for r in range(args.rounds):
        steps = ids[r * args.steps : (r + 1) * args.steps + 1]
        for k in range(len(stores)):
            s = stores[(r + k) % len(stores)]  # each round starts with the next store
            fig = run_store(s, steps, rng)
            last[s.name] = fig.pop("last")
            rounds[s.name].append(fig)
    verified = {}
    for s in stores:  # the rows written last read back as written
        written_ids, written = last[s.name]
        verified[s.name] = bool(np.array_equal(s.read(written_ids), written))
        s.close()
    status = Path("/proc/self/status").read_text().splitlines()
    kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in status if ln.endswith(" kB")}
    out = {"rounds": rounds, "verified": verified, "peak_rss_kib": kib.get("VmHWM", 0)}
    out["rss_anon_kib"] = kib.get("RssAnon", 0)
    Path(args.child_out).write_text(json.dumps(out))


# -- the parent -----------------------------------------------------------------------------


def summarize(name: str, rounds: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One result row: rows/s read and written over all rounds, per-round rates too."""
    read_rate = [f["rows_read"] / f["read_s"] for f in rounds]
    write_rate = [f["rows_written"] / f["write_s"] for f in rounds]
    n = len(rounds) * steps
    return {
        "store": name,
        "rows_read_per_s": statistics.median(read_rate),
        "rows_written_per_s": statistics.median(write_rate),
        "round_rows_read_per_s": read_rate,
        "round_rows_written_per_s": write_rate,
        "step_ms": 1e3 * statistics.median([(f["read_s"] + f["write_s"]) / steps for f in rounds]),
        "rows_read_per_step": sum(f["rows_read"] for f in rounds) / n,
        "rows_written_per_step": sum(f["rows_written"] for f in rounds) / n,
        "disk_read_mib_per_step": sum(f["disk_read_bytes"] for f in rounds) / n / 2**20,
        "disk_write_mib_per_step": sum(f["disk_write_bytes"] for f in rounds) / n / 2**20,
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each store's read and write rate over mmap's, the median of per-round ratios."""
    ref = next((r for r in rows if r["store"] == "mmap"), None)
    if ref is None:
        return
    for r in rows:
        for key, out in (("round_rows_read_per_s", "read_vs_mmap"),
                         ("round_rows_written_per_s", "write_vs_mmap")):  # fmt: skip
            r[out] = statistics.median(a / b for a, b in zip(r[key], ref[key]))


def build(stores: list[Store], rows: int) -> dict[str, dict[str, Any]]:
    """Build every store; its build time and bytes on disk; drop its pages from the cache."""
    out = {}
    for s in stores:
        t = time.perf_counter()
        files = s.build(rows, np.random.default_rng(0))
        seconds = time.perf_counter() - t
        for f in files:
            drop_file_pages(f)
        out[s.name] = {
            "build_s": round(seconds, 1),
            "disk_bytes": sum(f.stat().st_size for f in files),
        }
        print(f"  built {s.name} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    limit, limits_skipped = ("none", {}) if args.limit == "none" else limit_method(args.limit)
    base = Path(args.dir or tempfile.gettempdir())
    disk = block_device_facts(base)  # refuses a tmpfs
    scratch = Path(tempfile.mkdtemp(prefix="tetrarec-tiers-", dir=base))
    try:
        stores, skipped = make_stores(scratch, args.stores.split(","))
        for name, why in skipped.items():
            print(f"bench_tiers: skipping {name}: {why}", file=sys.stderr)
        built = build(stores, args.rows)
        out = scratch / "child.json"
        argv_child = [sys.executable, __file__, "--child", str(scratch), "--child-out", str(out)]
        for key in ("rows", "batch", "pooling", "cache_fraction", "rounds", "steps", "stores"):
            argv_child += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        budget = args.budget_mib * 2**20
        run = run_limited(argv_child, limit, budget if limit != "none" else None)
        if run.returncode != 0:
            raise SystemExit(
                f"bench_tiers: the child exited with {run.returncode} under {run.summary()}:\n"
                f"{run.stderr[-3000:]}"
            )
        result = json.loads(out.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    table_bytes = args.rows * ROW_BYTES
    rows = []
    for s in stores:
        row = summarize(s.name, result["rounds"][s.name], args.steps)
        row.update(impl=f"store-{s.name}", kernels="none", verified=result["verified"][s.name])
        row.update(built[s.name])
        rows.append(row)
    add_ratios(rows)
    budget_facts = {
        **run.summary(),
        "limits_skipped": limits_skipped,
        "table_bytes": table_bytes,
        "table_over_budget": table_bytes / budget if limit != "none" else None,
        "child_peak_rss_mib": result["peak_rss_kib"] / 1024,
        "child_rss_anon_mib_at_end": result["rss_anon_kib"] / 1024,
    }
    kernels = {"kernels": "none"}
    print(describe_run(kernels))
    print(f"disk: {disk}; budget: {budget_facts}")
    print_table(
        rows,
        ["store", "rows_read_per_s", "read_vs_mmap", "rows_written_per_s", "write_vs_mmap",
         "step_ms", "rows_read_per_step", "disk_read_mib_per_step", "disk_write_mib_per_step",
         "disk_bytes", "build_s", "verified"],
    )  # fmt: skip
    if not all(r["verified"] for r in rows):
        raise SystemExit("bench_tiers: a store did not read back the rows written to it")
    if limit != "none" and table_bytes < 2 * budget and not args.smoke:
        print("bench_tiers: the table is < 2x the budget: raise --rows", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if not k.startswith("child")}
    write_json(
        args.json, config, rows, kernels, budget=budget_facts, disk=disk, cpu=cpu_summary(),
        skipped=skipped,
    )  # fmt: skip


if __name__ == "__main__":
    with unwind_on_signals("bench_tiers"):  # SIGTERM deletes the scratch too
        main()
