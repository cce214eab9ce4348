"""The exported model directory: safetensors plus a JSON manifest, checked before use.

::

    MODEL_DIR/
      manifest.json        what the model is (see ``Manifest``), and each file's size
                           and SHA-256; ``content_hash`` covers the manifest and files
      tensors.safetensors  every tensor: table rows (in their stored precision), the
                           pruned tables' id maps, the dense layers (FP32, BF16 or INT8
                           with their scales)

A directory is written into ``<parent>/.tmp-<name>-<pid>/`` and renamed into place when
both files are complete and flushed, so a crash never leaves a directory that loads.
Reading checks, in order: the manifest is there and is JSON of this format, its
version is one this tetrarec reads, every file it lists is there with its size and
SHA-256, the content hash matches; only then are the tensors read, by safetensors
(which never runs code: no pickle anywhere). Each failure is one ``ModelFileError``
line that names the file and what is wrong with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tetrarec import jsonio

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "TENSORS",
    "Manifest",
    "ModelFileError",
    "read_model_dir",
    "write_model_dir",
]

FORMAT_NAME = "tetrarec-model"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
_CHUNK = 1 << 20


class ModelFileError(ValueError):
    """An exported model directory that cannot be used; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What an exported model is, as ``manifest.json`` holds it.

    Args:
        config: the run's config (``RunConfig.to_dict()``): the model's architecture,
            its tables, and the data settings that turn raw rows into features (the
            source's columns, hashing of string ids, bad-line rules).
        dense_transform: the fitted dense transform (``DenseTransform.to_dict()``) of
            the training rows, or ``None`` for a model trained without one.
        tables: one entry per table (the embedding tables, then a first-order term's):
            ``name``, ``rows`` (ids the table answers), ``stored_rows`` (rows kept:
            fewer when pruned), ``dim``, ``precision``, ``pooling``, ``features``.
        dense: how the dense layers are stored and run: ``{"precision": "fp32" |
            "bf16" | "int8"}``, and for INT8 ``"activations": "dynamic" | "static"``.
        source: where the model came from (the checkpoint, its step, world size and
            plan fingerprint; a quantized model also names the model it came from).
        quantization: the precision choices and the accuracy report that chose them
            (``{}`` for a model as exported).
        files: ``{file name: {"bytes": n, "sha256": hex}}``, filled in when written.
        content_hash: SHA-256 of the manifest's other fields and the files' hashes.
        format_version: the directory layout's version.
    """

    config: dict[str, Any]
    dense_transform: dict[str, Any] | None
    tables: list[dict[str, Any]]
    dense: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    content_hash: str = ""
    format_version: int = FORMAT_VERSION

    def body(self) -> dict[str, Any]:
        """Every field but ``content_hash`` (what the hash covers, with the files)."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "config": self.config,
            "dense_transform": self.dense_transform,
            "tables": self.tables,
            "dense": self.dense,
            "source": self.source,
            "quantization": self.quantization,
            "files": self.files,
        }

    def computed_hash(self) -> str:
        """The content hash of this manifest (its body, canonical JSON)."""
        text = jsonio.dumps(self.body(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``manifest.json`` holds."""
        return {**self.body(), "content_hash": self.content_hash}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str) -> Manifest:
        """Read a manifest's JSON object.

        Raises:
            ModelFileError: naming ``where`` for another format, a version newer than
                this tetrarec reads, or a missing or mistyped field.
        """
        if values.get("format") != FORMAT_NAME:
            raise ModelFileError(
                f"{where}: not a tetrarec model manifest (format {values.get('format')!r}, "
                f"expected {FORMAT_NAME!r})"
            )
        version = values.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ModelFileError(f"{where}: bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise ModelFileError(
                f"{where}: model format version {version} is newer than this tetrarec reads "
                f"(up to {FORMAT_VERSION}); upgrade tetrarec to load it"
            )
        kinds: dict[str, type | tuple[type, ...]] = {
            "config": dict,
            "dense_transform": (dict, type(None)),
            "tables": list,
            "dense": dict,
            "source": dict,
            "quantization": dict,
            "files": dict,
            "content_hash": str,
        }
        for key, kind in kinds.items():
            if not isinstance(values.get(key), kind):
                raise ModelFileError(f"{where}: field {key!r} is missing or of the wrong type")
        return cls(
            config=values["config"],
            dense_transform=values["dense_transform"],
            tables=values["tables"],
            dense=values["dense"],
            source=values["source"],
            quantization=values["quantization"],
            files=values["files"],
            content_hash=values["content_hash"],
            format_version=version,
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model_dir(
    path: str | Path, manifest: Manifest, tensors: Mapping[str, torch.Tensor]
) -> Manifest:
    """Write ``tensors`` and ``manifest`` as a model directory at ``path``, atomically.

    An existing directory at ``path`` is replaced only once the new one is complete.

    Returns:
        The manifest as written (files and content hash filled in).

    Raises:
        ModelFileError: if ``path`` exists and is not a model directory (it is not
            replaced), or its parent does not exist.
    """
    final = Path(path)
    if final.exists() and not (final / MANIFEST).is_file():
        raise ModelFileError(
            f"{final}: exists and is not a tetrarec model directory; not overwriting it"
        )
    if not final.parent.is_dir():
        raise ModelFileError(f"{final}: its parent directory {final.parent} does not exist")
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensor_path = tmp / TENSORS
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tensor_path)
        _fsync(tensor_path)
        files = {TENSORS: {"bytes": tensor_path.stat().st_size, "sha256": _sha256(tensor_path)}}
        written = Manifest(**{**manifest.__dict__, "files": files, "content_hash": ""})
        written = Manifest(**{**written.__dict__, "content_hash": written.computed_hash()})
        (tmp / MANIFEST).write_text(jsonio.dumps(written.to_dict(), indent=2) + "\n")
        _fsync(tmp / MANIFEST)
        if final.exists():
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def read_model_dir(path: str | Path) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Check and read a model directory: its manifest and every tensor (on the CPU).

    Raises:
        ModelFileError: one line naming the file: no such directory, a missing manifest
            or tensor file, a manifest that is not JSON or is of a newer format version,
            a file whose size or SHA-256 differs from the manifest's (changed or
            damaged), a content hash that does not match, a tensor file safetensors
            cannot read.
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelFileError(f"{root}: no such model directory")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise ModelFileError(f"{manifest_path}: missing (not an exported tetrarec model?)")
    try:
        values = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{manifest_path}: not readable JSON ({e})") from None
    if not isinstance(values, dict):
        raise ModelFileError(f"{manifest_path}: not a JSON object")
    manifest = Manifest.from_dict(values, str(manifest_path))
    if TENSORS not in manifest.files:
        raise ModelFileError(f"{manifest_path}: lists no {TENSORS}")
    for name, info in sorted(manifest.files.items()):
        file = root / name
        if Path(name).name != name:
            raise ModelFileError(f"{manifest_path}: file name {name!r} is not a plain name")
        if not file.is_file():
            raise ModelFileError(f"{file}: missing (the manifest lists it)")
        size = file.stat().st_size
        if size != info.get("bytes"):
            raise ModelFileError(
                f"{file}: {size} bytes, the manifest says {info.get('bytes')} (changed or "
                "truncated)"
            )
        if _sha256(file) != info.get("sha256"):
            raise ModelFileError(
                f"{file}: SHA-256 differs from the manifest's (the file was changed or damaged)"
            )
    if manifest.computed_hash() != manifest.content_hash:
        raise ModelFileError(
            f"{manifest_path}: content hash does not match its fields (the manifest was edited)"
        )
    try:
        tensors = load_file(root / TENSORS)
    except (SafetensorError, OSError) as e:
        raise ModelFileError(f"{root / TENSORS}: not a readable safetensors file ({e})") from None
    return manifest, tensors
