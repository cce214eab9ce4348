"""The preprocessed Criteo format: memory-mappable ``.npy`` columns plus ``meta.json``.

One directory per dataset::

    meta.json     {"format": "tetrarec-criteo", "version": 2, "rows": N, "files": [...],
                   "bad_lines": {...}, "positives": P, ...}
    labels.npy    (N,)     float32   0/1
    dense.npy     (N, 13)  float32   raw values, missing -> 0
    sparse.npy    (N, 26)  uint32    raw categorical values, missing -> 0

Both stay raw: ``tetrarec.data.dense`` transforms the dense values and ``hash_ids``
maps the categoricals into each table's rows at read time, so one preprocessed copy
serves any transform and any table sizes. Version 1 (older tetrarec) stored the dense
values as ``log(1 + max(x, 0))``; it is still read, with ``dense_applied = log1p``, so
the default ``log1p`` is not applied twice and any other transform is refused with a
message to re-run ``tetrarec preprocess``. ``np.load(..., mmap_mode="r")`` opens
the columns without reading them. ``preprocess_criteo`` writes everything to a
temporary directory beside ``output`` and renames it into place at the end, so an
interrupted run never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from tetrarec import jsonio
from tetrarec.data.config import BadLinePolicy, DenseKind
from tetrarec.data.criteo import NUM_DENSE, NUM_SPARSE, iter_criteo_blocks
from tetrarec.data.errors import BadLineSummary, BadLineTally, DataError, DataFileNotFoundError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "BinaryColumns",
    "PreprocessSummary",
    "open_binary",
    "preprocess_criteo",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "tetrarec-criteo"
FORMAT_VERSION = 2  # 2: raw dense values; 1: log1p'd dense values (still read)
# What the dense column of each readable version already went through.
_DENSE_APPLIED = {1: DenseKind.LOG1P, 2: DenseKind.NONE}
_HEADER_BYTES = 128  # fixed .npy header size, so the row count can be patched in at the end


class _NpyAppender:
    """Streams rows into a ``.npy`` file whose row count is known only at the end."""

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), row_shape
        self.rows = 0
        self.file: BinaryIO = path.open("wb")
        self.file.write(self._header())

    def _header(self) -> bytes:
        shape = (self.rows, *self.row_shape)
        text = f"{{'descr': '{self.dtype.str}', 'fortran_order': False, 'shape': {shape}, }}"
        head = b"\x93NUMPY\x01\x00" + (_HEADER_BYTES - 10).to_bytes(2, "little")
        body = text.encode("latin1").ljust(_HEADER_BYTES - 10 - 1) + b"\n"
        assert len(head) + len(body) == _HEADER_BYTES, "npy header overflow"
        return head + body

    def append(self, rows: np.ndarray) -> None:
        assert rows.shape[1:] == self.row_shape, (rows.shape, self.row_shape)
        assert rows.dtype == self.dtype, (rows.dtype, self.dtype)
        self.file.write(np.ascontiguousarray(rows).tobytes())
        self.rows += rows.shape[0]

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(self._header())
        self.file.close()


@dataclass(frozen=True, kw_only=True)
class PreprocessSummary:
    """What ``preprocess_criteo`` (or ``preprocess_to_parquet``) wrote.

    Args:
        output: the dataset directory (binary) or the Parquet file.
        rows: rows written.
        positives: rows with label 1.
        files: ``(input path, rows kept from it)`` per input, in order.
        bad_lines: lines skipped (all zero with ``on_bad_line="error"``).
        seconds: wall time of the run.
    """

    output: Path
    rows: int
    positives: int
    files: tuple[tuple[str, int], ...]
    bad_lines: BadLineSummary
    seconds: float

    def summary(self) -> str:
        """One line for the log or the terminal."""
        rate = self.rows / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"wrote {self.rows} rows ({self.positives} positive) from {len(self.files)} file(s) "
            f"to {self.output} in {self.seconds:.1f} s ({rate:,.0f} rows/s); "
            f"{self.bad_lines.summary()}"
        )

    def to_dict(self) -> dict[str, object]:
        """Plain data for JSON (``tetrarec preprocess --json``)."""
        return {
            "output": str(self.output),
            "rows": self.rows,
            "positives": self.positives,
            "files": [{"path": path, "rows": rows} for path, rows in self.files],
            "bad_lines": self.bad_lines.to_dict(),
            "seconds": self.seconds,
            "rows_per_s": self.rows / self.seconds if self.seconds > 0 else None,
        }


def _check_inputs(inputs: Sequence[str | Path], output: Path) -> list[Path]:
    if not inputs:
        raise ValueError("preprocess_criteo needs at least one input file")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.exists():
            raise DataFileNotFoundError(p)
        if p.is_dir():
            raise DataError("expected a file, got a directory", path=p)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DataError("the output already exists; remove it or choose another", path=output)
    return paths


def _write_columns(
    paths: list[Path], tmp: Path, policy: BadLinePolicy, progress: bool
) -> tuple[list[tuple[str, int]], int, BadLineTally, int]:
    labels = _NpyAppender(tmp / "labels.npy", np.dtype(np.float32), ())
    dense = _NpyAppender(tmp / "dense.npy", np.dtype(np.float32), (NUM_DENSE,))
    sparse = _NpyAppender(tmp / "sparse.npy", np.dtype(np.uint32), (NUM_SPARSE,))
    tally = BadLineTally()
    files: list[tuple[str, int]] = []
    positives = 0
    total = sum(p.stat().st_size for p in paths)
    bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, disable=not progress)
    with bar:
        for p in paths:
            bar.set_description(p.name)
            before = labels.rows
            for block in iter_criteo_blocks(
                p, on_bad_line=policy, tally=tally, on_bytes=bar.update
            ):
                labels.append(block.labels)
                dense.append(block.dense)
                sparse.append(block.sparse)
                positives += int(block.labels.sum())
                bar.set_postfix(rows=labels.rows, refresh=False)
            files.append((str(p), labels.rows - before))
    for col in (labels, dense, sparse):
        col.close()
    return files, positives, tally, labels.rows


def _write_meta(
    tmp: Path, rows: int, positives: int, files: list[tuple[str, int]], bad: BadLineSummary
) -> None:
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "rows": rows,
        "positives": positives,
        "num_dense": NUM_DENSE,
        "num_sparse": NUM_SPARSE,
        "dense": "float32 raw value, missing -> 0; transformed at read time",
        "sparse": "uint32 raw hex value, missing -> 0; hashed at read time",
        "files": [{"path": p, "rows": n} for p, n in files],
        "bad_lines": bad.to_dict(),
    }
    (tmp / "meta.json").write_text(jsonio.dumps(meta, indent=2) + "\n")


def preprocess_criteo(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    on_bad_line: str | BadLinePolicy = "error",
    progress: bool = True,
) -> PreprocessSummary:
    """Convert raw Criteo files (TSV or .gz) into the memory-mappable binary format.

    Args:
        inputs: raw files, concatenated in this order.
        output: the directory to create (must not exist, or be empty).
        on_bad_line: ``"error"`` (raise on the first bad line) or ``"skip"``.
        progress: show a tqdm bar (bytes read, rows written) on stderr.

    Returns:
        The summary (rows, per-file rows, skipped lines).

    Raises:
        DataFileNotFoundError: if an input does not exist.
        DataError: for an empty or truncated input, a bad line (by default), no rows at
            all, or an ``output`` that already exists.
    """
    t0 = time.perf_counter()
    output = Path(output)
    policy = BadLinePolicy.parse(on_bad_line)
    paths = _check_inputs(inputs, output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files, positives, tally, rows = _write_columns(paths, tmp, policy, progress)
        if rows == 0:
            raise tally.no_rows_error("the input", path=paths[0] if len(paths) == 1 else None)
        bad = tally.freeze(rows)
        _write_meta(tmp, rows, positives, files, bad)
        if output.exists():
            output.rmdir()  # checked empty above
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = PreprocessSummary(
        output=output,
        rows=rows,
        positives=positives,
        files=tuple(files),
        bad_lines=bad,
        seconds=time.perf_counter() - t0,
    )
    logger.info("%s", summary.summary())
    return summary


@dataclass(frozen=True, kw_only=True)
class BinaryColumns:
    """The memory-mapped columns of a preprocessed directory (see the module docstring).

    ``dense_applied`` is the transform the stored dense values already went through:
    ``none`` (raw, format version 2) or ``log1p`` (format version 1).
    """

    path: Path
    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    meta: dict[str, object]
    bad_lines: BadLineSummary
    dense_applied: DenseKind = DenseKind.NONE

    @property
    def rows(self) -> int:
        """``N``."""
        return int(self.labels.shape[0])


def _load_column(path: Path, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DataFileNotFoundError(path, "column file") from None
    except (ValueError, OSError) as e:
        raise DataError(f"unreadable or truncated column ({e})", path=path) from None
    if not isinstance(arr, np.ndarray):  # np.load opens an .npz archive as an NpzFile
        raise DataError(f"expected one .npy array, got {type(arr).__name__}", path=path)
    if arr.shape != shape or arr.dtype != np.dtype(dtype):
        raise DataError(
            f"expected shape {shape} {np.dtype(dtype)}, got {arr.shape} {arr.dtype}", path=path
        )
    return arr


def open_binary(path: str | Path) -> BinaryColumns:
    """Open a directory written by ``preprocess_criteo`` (memory-mapped, nothing read).

    Raises:
        DataFileNotFoundError: if the directory or one of its files is missing.
        DataError: if ``path`` is a file, or ``meta.json`` is not of this format and a
            readable version (1 or 2), or a column's shape disagrees with it.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DataError(
            "data.source = 'binary' reads a directory written by tetrarec preprocess, and "
            "this is a file (for raw rows set data.source to criteo, csv or parquet, or "
            "preprocess it first)",
            path=path,
        )
    if not path.is_dir():
        raise DataFileNotFoundError(path, "preprocessed data directory")
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise DataFileNotFoundError(meta_path, "meta.json of preprocessed data")
    try:
        meta = json.loads(meta_path.read_text())
        version = meta.get("version")
        ok = meta.get("format") == FORMAT_NAME and version in _DENSE_APPLIED
        rows = int(meta["rows"])
    except (ValueError, KeyError, AttributeError) as e:
        raise DataError(f"unreadable meta.json ({e})", path=meta_path) from None
    if not ok:
        raise DataError(
            f"not a {FORMAT_NAME} directory of a version this tetrarec reads "
            f"({', '.join(f'v{v}' for v in _DENSE_APPLIED)}): format={meta.get('format')!r}, "
            f"version={meta.get('version')!r}",
            path=meta_path,
        )
    bad = meta.get("bad_lines", {})
    return BinaryColumns(
        path=path,
        labels=_load_column(path / "labels.npy", (rows,), np.float32),
        dense=_load_column(path / "dense.npy", (rows, NUM_DENSE), np.float32),
        sparse=_load_column(path / "sparse.npy", (rows, NUM_SPARSE), np.uint32),
        meta=meta,
        bad_lines=BadLineSummary(
            rows_read=rows,
            counts=MappingProxyType(dict(bad.get("counts", {}))),
            examples=tuple(bad.get("examples", ())),
        ),
        dense_applied=_DENSE_APPLIED[version],
    )
