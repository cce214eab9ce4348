"""A checkpoint's manifest: what it holds, each file's size and SHA-256, written last.

``<checkpoint>/manifest.json`` is the last file written into a checkpoint's temporary
directory (by rank 0 of a sharded run, once every rank reported its files complete),
just before the directory is renamed into place::

    {"manifest_format": 1, "checkpoint_format": 2, "step": 400, "data_position": 400,
     "world_size": 2, "plan_fingerprint": "3f2a...",   (null in one process)
     "files": {"meta.json": {"bytes": 5012, "sha256": "9b1c..."},
               "tensors.safetensors": {...}, "rank_00000.safetensors": {...}, ...}}

Loading verifies it before any tensor is read (``verify_checkpoint``): every listed
file exists with its size, and each file the reader will read hashes to its SHA-256;
anything else is one ``ValueError`` naming the file. Hashing streams the file (a
checkpoint's files can be GBs).

A checkpoint without ``manifest.json`` was written before manifests existed (a new one
is renamed into place only with it); it is loaded unverified, with a warning.

``WriteStage`` names the points of a write where a test's crash hook is called
(``write_checkpoint(..., on_stage=hook)``), in order.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetrarec import jsonio

__all__ = [
    "MANIFEST",
    "MANIFEST_FORMAT",
    "FileEntry",
    "StageHook",
    "WriteStage",
    "file_entry",
    "verify_checkpoint",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file in the directory, no path
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class WriteStage(enum.StrEnum):
    """The points of a checkpoint write where the crash hook is called, in order.

    ``RANK_FILES_*`` are called on every rank (in one process: around ``meta.json`` and
    ``tensors.safetensors``); the others on rank 0 only. Until ``RENAME_AFTER`` the
    checkpoint is a temporary directory that nothing takes as complete.
    """

    RANK_FILES_BEFORE = "rank_files_before"
    RANK_FILES_AFTER = "rank_files_after"
    MANIFEST_BEFORE = "manifest_before"
    MANIFEST_AFTER = "manifest_after"
    RENAME_BEFORE = "rename_before"
    RENAME_AFTER = "rename_after"


# ``hook(stage, directory)``: ``directory`` is the one being written (the temporary one
# until the rename, then the final one). A test's hook raises to simulate a crash there.
StageHook = Callable[[WriteStage, Path], None]


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint, as its manifest lists it.

    Args:
        name: its name in the checkpoint directory.
        bytes: its size.
        sha256: its SHA-256, hex.
    """

    name: str
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        """``{"bytes": ..., "sha256": ...}`` (the name is the manifest's key)."""
        return {"bytes": self.bytes, "sha256": self.sha256}


def file_entry(path: Path, *, fsync: bool = False) -> FileEntry:
    """Size and SHA-256 of the file ``path``, read in a stream.

    Args:
        path: the file.
        fsync: also flush it to disk (the writer's call, on the open file).
    """
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if fsync:
            os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
    return FileEntry(name=path.name, bytes=size, sha256=digest)


def write_manifest(
    directory: Path,
    entries: Collection[FileEntry],
    *,
    step: int,
    meta: dict[str, Any],
    checkpoint_format: int,
) -> None:
    """Write ``directory/manifest.json`` listing ``entries``, flushed to disk.

    Args:
        directory: the checkpoint's (temporary) directory, its files complete.
        entries: every file of the checkpoint.
        step: the checkpoint's step.
        meta: what ``meta.json`` holds (its data position and sharded layout are
            repeated in the manifest).
        checkpoint_format: the checkpoint format version.
    """
    sharding = meta.get("sharding") if isinstance(meta.get("sharding"), dict) else None
    manifest = {
        "manifest_format": MANIFEST_FORMAT,
        "checkpoint_format": checkpoint_format,
        "step": step,
        "data_position": meta.get("data_position"),
        "world_size": sharding.get("world_size", 1) if sharding else 1,
        "plan_fingerprint": sharding.get("fingerprint") if sharding else None,
        "files": {e.name: e.to_dict() for e in sorted(entries, key=lambda e: e.name)},
    }
    with open(directory / MANIFEST, "w") as f:
        f.write(jsonio.dumps(manifest, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())


def _damaged(path: Path, why: str) -> ValueError:
    return ValueError(f"{path / MANIFEST}: damaged checkpoint manifest ({why})")


def _read_manifest(path: Path) -> dict[str, FileEntry]:
    """The files ``path``'s manifest lists, checked for shape.

    Raises:
        ValueError: naming the manifest, if it is not what ``write_manifest`` writes.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _damaged(path, " ".join(str(e).split())) from e
    if not isinstance(manifest, dict):
        raise _damaged(path, "not a JSON object")
    if manifest.get("manifest_format") != MANIFEST_FORMAT:
        raise ValueError(
            f"{path / MANIFEST}: manifest format {manifest.get('manifest_format')!r}, this "
            f"tetrarec reads {MANIFEST_FORMAT}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise _damaged(path, "no 'files' object")
    entries = {}
    for name, entry in files.items():
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if (
            not _SAFE_NAME.match(name)
            or not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(digest, str)
            or not _SHA256.match(digest)
        ):
            raise _damaged(path, f"bad entry for {name[:60]!r}")
        entries[name] = FileEntry(name=name, bytes=size, sha256=digest)
    step = re.fullmatch(r"step_(\d{8,})", path.resolve().name)
    if step and manifest.get("step") != int(step.group(1)):
        raise _damaged(path, f"'step' {manifest.get('step')!r} in {path.resolve().name}")
    return entries


def verify_checkpoint(
    path: str | Path, *, hash_files: Collection[str] | None = None
) -> dict[str, FileEntry] | None:
    """Check checkpoint ``path`` against its manifest, before any tensor is read.

    Every file the manifest lists must exist with its recorded size; those in
    ``hash_files`` (default: all) must also hash to their SHA-256. A checkpoint with no
    manifest (written before manifests) is not verified, with a warning.

    Args:
        path: the checkpoint directory (or ``<root>/best``).
        hash_files: the names of the files the caller will read (default: every file
            of the checkpoint). Each one that exists must be listed; one that does not
            is left to the reader to report missing.

    Returns:
        The manifest's files by name, or ``None`` for a checkpoint without a manifest.

    Raises:
        ValueError: naming the first file that is missing, unlisted, of another size or
            another hash, or the manifest, if it is damaged.
    """
    path = Path(path)
    if not (path / MANIFEST).is_file():
        logger.warning(
            "%s has no %s (written by an older tetrarec): its files are not verified",
            path,
            MANIFEST,
        )
        return None
    entries = _read_manifest(path)
    # A file the manifest leaves out would be read unverified: an entry dropped from a
    # damaged manifest must not vouch for less than the checkpoint holds.
    present = (
        [p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST]
        if hash_files is None
        else [n for n in hash_files if (path / n).is_file()]
    )
    unlisted = sorted(set(present) - set(entries))
    if unlisted:
        raise ValueError(
            f"{path / unlisted[0]}: not listed in {MANIFEST} (a damaged manifest, or a file "
            "added to the checkpoint)"
        )
    for entry in entries.values():
        file = path / entry.name
        if not file.is_file():
            raise ValueError(f"{file}: missing from the checkpoint ({MANIFEST} lists it)")
        size = file.stat().st_size
        if size != entry.bytes:
            raise ValueError(
                f"{file}: damaged checkpoint file ({size} bytes, {MANIFEST} says {entry.bytes})"
            )
    for name in sorted(entries if hash_files is None else set(hash_files) & set(entries)):
        if file_entry(path / name).sha256 != entries[name].sha256:
            raise ValueError(
                f"{path / name}: damaged checkpoint file (its SHA-256 differs from {MANIFEST}'s)"
            )
    return entries
