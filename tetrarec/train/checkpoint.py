"""Checkpoint files: safetensors plus JSON, written atomically, never pickle.

A checkpoint is a directory ``<root>/step_<8 digits>/`` holding::

    tensors.safetensors   every tensor: weights, optimizer state, RNG states
    meta.json             everything else: step, data position, config, the non-tensor
                          parts of optimizer and RNG states, format version
    rank_<5 digits>.safetensors
                          (sharded runs) each rank's blocks of the tables, their
                          optimizer state and the rank's RNG states; tensors.safetensors
                          then holds the dense layers and their optimizer (rank 0's)

    manifest.json         written last: step, data position, world size, plan
                          fingerprint, and each file's size and SHA-256
                          (``tetrarec.train.checkpoint_manifest``)

It is written into ``<root>/.tmp-step_<...>/`` and renamed into place only when every
file and then the manifest are complete and flushed, so a crash leaves either the whole
checkpoint or a temporary directory that ``latest_checkpoint`` never picks (and the next
save removes). Readers verify the manifest, the files' sizes and the SHA-256 of the
files they read before reading any tensor. Pruning (``prune_checkpoints``) runs only
after a newer checkpoint is complete, so the newest complete one always survives a crash.

``<root>/best`` (a run with ``train.keep_best``) is a relative symbolic link to the best
evaluated checkpoint, ``best -> step_<...>``. It is replaced atomically (a new link is
made under a temporary name and renamed over the old one), so it always names a
complete checkpoint, and ``prune_checkpoints`` never deletes the checkpoint it names.
Anything that takes a checkpoint directory takes ``<root>/best``
(``tetrarec eval --checkpoint <root>/best``); ``latest_checkpoint`` ignores it.

This module knows files and state layouts; ``tetrarec.train.state`` decides what a
training run puts in them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tetrarec import jsonio
from tetrarec.comm import Communicator
from tetrarec.train.checkpoint_manifest import (
    FileEntry,
    StageHook,
    WriteStage,
    file_entry,
    verify_checkpoint,
    write_manifest,
)

__all__ = [
    "BEST_LINK",
    "CHECKPOINT_FORMAT",
    "CheckpointData",
    "best_checkpoint",
    "capture_rng_state",
    "flatten_optimizer_state",
    "latest_checkpoint",
    "list_checkpoints",
    "mark_best",
    "prune_checkpoints",
    "rank_file",
    "read_checkpoint",
    "read_meta",
    "read_rank_tensors",
    "restore_rng_state",
    "unflatten_optimizer_state",
    "verify_for_load",
    "write_checkpoint",
    "write_sharded_checkpoint",
]

CHECKPOINT_FORMAT = 2  # 2: fused optimizer state under sparse_optim, keyed by table
_TENSORS = "tensors.safetensors"
_META = "meta.json"
_NAME = re.compile(r"^step_(\d{8,})$")
BEST_LINK = "best"  # <root>/best -> step_<...>: the best evaluated checkpoint


@dataclass(frozen=True, kw_only=True)
class CheckpointData:
    """The contents of one checkpoint.

    Args:
        step: training steps done.
        tensors: ``{name: tensor}``; names are dotted (``"model.top.0.weight"``).
        meta: JSON-compatible values (the format version is added on write).
    """

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _clear_stale(root: Path) -> None:
    """Remove what crashed writes left in ``root``: temporaries, never complete."""
    for stale in [*root.glob(".tmp-step_*"), *root.glob(".tmp-old-step_*")]:
        shutil.rmtree(stale, ignore_errors=True)


def _stage(on_stage: StageHook | None, stage: WriteStage, directory: Path) -> None:
    if on_stage is not None:
        on_stage(stage, directory)


def write_checkpoint(
    root: str | Path, data: CheckpointData, *, on_stage: StageHook | None = None
) -> Path:
    """Write ``data`` atomically as ``<root>/step_<step>``; return its path.

    The files, then the manifest, are written into ``<root>/.tmp-step_<step>`` and
    flushed; the directory is then renamed into place. An existing checkpoint of the
    same step is replaced (the new one is complete before the old one is removed). On an
    error the temporary directory is removed; one a crash leaves is removed by the next
    write.

    Args:
        root: the run's checkpoint directory.
        data: what to write.
        on_stage: called at each ``WriteStage`` (tests inject crashes there).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _clear_stale(root)
    final = root / f"step_{data.step:08d}"
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    try:
        _stage(on_stage, WriteStage.RANK_FILES_BEFORE, tmp)
        entries = [_save_flushed(data.tensors, tmp / _TENSORS), _write_meta(tmp, data)]
        _stage(on_stage, WriteStage.RANK_FILES_AFTER, tmp)
        _seal(tmp, entries, data, on_stage)
    except BaseException:  # a full disk, Ctrl-C: the partial files are never read
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace(root, tmp, final)
    _stage(on_stage, WriteStage.RENAME_AFTER, final)
    return final


def _seal(
    tmp: Path, entries: list[FileEntry], data: CheckpointData, on_stage: StageHook | None
) -> None:
    """Write the manifest of the complete files ``entries`` into ``tmp``, last."""
    _stage(on_stage, WriteStage.MANIFEST_BEFORE, tmp)
    write_manifest(
        tmp, entries, step=data.step, meta=data.meta, checkpoint_format=CHECKPOINT_FORMAT
    )
    _stage(on_stage, WriteStage.MANIFEST_AFTER, tmp)
    _stage(on_stage, WriteStage.RENAME_BEFORE, tmp)


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s file in a sharded checkpoint."""
    return f"rank_{rank:05d}.safetensors"


def write_sharded_checkpoint(
    root: str | Path,
    data: CheckpointData,
    rank_tensors: dict[str, torch.Tensor],
    comm: Communicator,
    *,
    on_stage: StageHook | None = None,
) -> Path:
    """Write a checkpoint with one file per rank, atomically; every rank calls it.

    Rank 0 writes ``data`` (dense tensors and meta); every rank writes ``rank_tensors``
    into the same temporary directory (the ranks share a file system); once every rank
    reported its files complete (their sizes and SHA-256), rank 0 writes the manifest
    and renames the directory into place::

        rank 0: clear stale temporaries, make .tmp-step_N          | exchange outcomes
        every rank: rank_<r>.safetensors flushed and hashed        | exchange outcomes
          (rank 0 also tensors.safetensors and meta.json)          |   and file entries
        rank 0: manifest.json, rename to step_N, flush the root    | exchange outcomes

    Each exchange is an all-gather of every rank's outcome: when one rank fails, every
    rank raises (that rank its own error, the others an ``OSError`` naming it) instead
    of waiting for it until the collective timeout, and no manifest is written. The
    temporary directory is left for the next write to remove.

    Args:
        root: the run's checkpoint directory.
        data: rank 0's dense tensors and meta (other ranks' ``tensors`` are ignored).
        rank_tensors: this rank's tensors.
        comm: the ranks' collectives.
        on_stage: called at each ``WriteStage`` (tests inject crashes there).

    Returns:
        The checkpoint's final path.
    """
    root = Path(root)
    final = root / f"step_{data.step:08d}"
    tmp = root / f".tmp-{final.name}"
    lead = comm.rank == 0

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        _clear_stale(root)
        tmp.mkdir()

    def own_files() -> list[dict[str, Any]]:
        _stage(on_stage, WriteStage.RANK_FILES_BEFORE, tmp)
        entries = [_save_flushed(rank_tensors, tmp / rank_file(comm.rank))]
        if lead:
            entries += [_save_flushed(data.tensors, tmp / _TENSORS), _write_meta(tmp, data)]
        _stage(on_stage, WriteStage.RANK_FILES_AFTER, tmp)
        return [{"name": e.name, **e.to_dict()} for e in entries]

    def seal(entries: list[FileEntry]) -> None:
        _seal(tmp, entries, data, on_stage)
        _replace(root, tmp, final)
        _stage(on_stage, WriteStage.RENAME_AFTER, final)

    _together(comm, final, prepare if lead else None)
    files = _together(comm, final, own_files)
    entries = [FileEntry(**e) for rank in files for e in rank]
    _together(comm, final, (lambda: seal(entries)) if lead else None)
    return final


def _together(comm: Communicator, final: Path, work: Callable[[], Any] | None) -> list[Any]:
    """Run ``work`` (``None``: nothing) on this rank, then agree with every rank.

    Returns:
        Every rank's result, in rank order.

    Raises:
        BaseException: this rank's own error, if ``work`` raised.
        OSError: naming the rank and its error, if another rank's ``work`` raised.
    """
    error: BaseException | None = None
    value = None
    try:
        value = work() if work is not None else None
    except BaseException as e:  # a crash injected, a full disk: every rank must know
        error = e
    why = None if error is None else " ".join(f"{type(error).__name__}: {error}".split())
    outcomes = comm.all_gather_json({"error": why, "value": value}, label="checkpoint")
    if error is not None:
        raise error
    for rank, outcome in enumerate(outcomes):
        if outcome["error"] is not None:
            raise OSError(f"checkpoint {final} not written: rank {rank} failed: {outcome['error']}")
    return [o["value"] for o in outcomes]


def _save_flushed(tensors: dict[str, torch.Tensor], path: Path) -> FileEntry:
    """Write ``tensors`` to ``path`` and flush it to disk; return its size and hash.

    Raises:
        OSError: if the file cannot be written (a full disk: safetensors raises its own
            error type, which the command would otherwise report as a traceback).
    """
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    except SafetensorError as e:
        raise OSError(f"cannot write checkpoint file {path}: {e}") from e
    return file_entry(path, fsync=True)


def _write_meta(directory: Path, data: CheckpointData) -> FileEntry:
    meta = {"format": CHECKPOINT_FORMAT, "step": data.step, **data.meta}
    with open(directory / _META, "w") as f:
        f.write(jsonio.dumps(meta, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    return file_entry(directory / _META)


def _replace(root: Path, tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final`` (replacing an older one) and flush."""
    if final.exists():
        old = root / f".tmp-old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def verify_for_load(path: str | Path, comm: Communicator | None = None) -> None:
    """Verify checkpoint ``path`` before a run loads it; with ``comm``, on every rank.

    Each process hashes what it reads: ``meta.json``, ``tensors.safetensors`` and, in a
    sharded run, its own rank's file (every listed file's size is checked). With
    ``comm`` the ranks then exchange what they found, so that a file damaged for one
    rank is an error on every rank (the others would wait for it until the timeout).

    Args:
        path: the checkpoint.
        comm: the ranks' collectives (``None``: one process).

    Raises:
        ValueError: naming the first missing or damaged file (and the rank that found
            it, on the other ranks).
    """
    files = [_META, _TENSORS] + ([rank_file(comm.rank)] if comm is not None else [])
    problem = None
    try:
        verify_checkpoint(path, hash_files=files)
    except ValueError as e:
        if comm is None:
            raise
        problem = str(e)
    if comm is None:
        return
    problems = comm.all_gather_json(problem, label="checkpoint")
    for rank, found in enumerate(problems):
        if found is not None:
            raise ValueError(found if rank == comm.rank else f"{found} (found by rank {rank})")


def read_rank_tensors(
    path: str | Path, rank: int, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors of a sharded checkpoint.

    Args:
        path: the checkpoint.
        rank: whose file to read.
        verify: check the file against the manifest first (``verify_checkpoint``);
            ``False`` where the caller did (``verify_for_load``).

    Raises:
        FileNotFoundError: if the checkpoint has no file for that rank.
        ValueError: if that file is damaged, or differs from the manifest (naming it).
    """
    file = Path(path) / rank_file(rank)
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {rank_file(rank)} (written by another world?)")
    if verify:
        verify_checkpoint(path, hash_files=[rank_file(rank)])
    try:
        return load_file(str(file))
    except SafetensorError as e:
        raise ValueError(f"{file}: damaged checkpoint tensors ({e})") from e


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / _META).is_file() and (p / _TENSORS).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``."""
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints; return the deleted paths.

    Call it only once the newest checkpoint is complete (after ``write_checkpoint``
    returned, on rank 0 after ``write_sharded_checkpoint``): the checkpoints it counts
    are the complete ones, so a crashed write's temporary directory never displaces one.

    The checkpoint ``<root>/best`` names (``mark_best``) is never deleted: it is kept
    besides the ``keep`` newest when older than them.
    """
    best = best_checkpoint(root)
    ckpts = list_checkpoints(root)
    doomed = ckpts[:-keep] if keep > 0 else ckpts
    doomed = [p for p in doomed if best is None or p.name != best.name]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def mark_best(checkpoint: str | Path) -> Path:
    """Point ``<root>/best`` at ``checkpoint`` (``<root>/step_<n>``), atomically.

    Returns:
        The link, ``<root>/best``.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete checkpoint.
    """
    checkpoint = Path(checkpoint)
    if not (checkpoint / _META).is_file() or not (checkpoint / _TENSORS).is_file():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint (no {_META} and {_TENSORS})")
    root = checkpoint.parent
    for stale in root.glob(f".tmp-{BEST_LINK}-*"):  # left by a crash between the two calls
        stale.unlink(missing_ok=True)
    tmp = root / f".tmp-{BEST_LINK}-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(checkpoint.name, tmp, target_is_directory=True)  # relative: the root may move
    os.replace(tmp, root / BEST_LINK)
    _fsync_dir(root)
    return root / BEST_LINK


def best_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``<root>/best`` names (``<root>/step_<n>``), or ``None``.

    ``None`` also when the link is missing, is not a link, or names no complete
    checkpoint.
    """
    link = Path(root) / BEST_LINK
    if not link.is_symlink():
        return None
    target = Path(root) / os.readlink(link)
    if not _NAME.match(target.name) or not (target / _META).is_file():
        return None
    return target


_JSON_TYPES = {int: "an integer", dict: "a JSON object"}


def _not_a_checkpoint(path: Path, missing: str) -> FileNotFoundError:
    """The error for ``path``, which lacks ``missing``; a run's directory names its own.

    ``<checkpoint_dir>`` itself is the likely slip (``tetrarec eval --checkpoint
    <checkpoint_dir>``): the message then offers its ``best`` link and newest checkpoint.
    """
    found = list_checkpoints(path)
    hint = ""
    if found:
        best = f"{path / BEST_LINK} (its best) or " if best_checkpoint(path) else ""
        hint = f"; it holds a run's checkpoints: give {best}{found[-1]} (its newest)"
    return FileNotFoundError(f"{path} is not a checkpoint (no {missing}){hint}")


def read_meta(path: str | Path, *, require: Mapping[str, type] | None = None) -> dict[str, Any]:
    """Only the ``meta.json`` of checkpoint ``path`` (no tensors are read).

    Args:
        path: the checkpoint directory.
        require: the keys the caller reads, besides ``step`` (which every checkpoint
            has), with their JSON type: ``int`` or ``dict`` (``{"config": dict}``).

    Raises:
        FileNotFoundError: if ``path`` has no ``meta.json``.
        ValueError: if it is damaged (naming it): not a JSON object, or a required key
            missing or of another type.
    """
    path = Path(path)
    if not (path / _META).is_file():
        raise _not_a_checkpoint(path, _META)
    try:
        meta = json.loads((path / _META).read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path / _META}: damaged checkpoint metadata ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path / _META}: damaged checkpoint metadata (not a JSON object)")
    for key, kind in {"step": int, **(require or {})}.items():
        value = meta.get(key)
        if key not in meta:
            problem = f"no {key!r}"
        elif not isinstance(value, kind) or isinstance(value, bool):  # JSON true is no int
            problem = f"{key!r} is not {_JSON_TYPES[kind]}: {json.dumps(value)[:40]}"
        else:
            continue
        raise ValueError(f"{path / _META}: damaged checkpoint metadata ({problem})")
    return meta


@contextlib.contextmanager
def _damaged_meta(path: str | Path) -> Iterator[None]:
    """Turn what a damaged ``meta.json`` raises while it is read into one ``ValueError``.

    ``read_meta`` checks the keys every reader needs; the other parts (the optimizers'
    and RNGs' states, the config, a sharded run's layout) are read where they are used,
    and a missing key or a value of another type there surfaced as a ``KeyError``,
    ``TypeError``, ... (or a ``ValueError`` not naming the file). An error that names
    the checkpoint already is left as it is.
    """
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(str(path)):
            raise
        why = " ".join(f"{type(e).__name__}: {e}".split())
        raise ValueError(f"{Path(path) / 'meta.json'}: damaged checkpoint metadata ({why})") from e


def read_checkpoint(
    path: str | Path,
    *,
    require: Mapping[str, type] | None = None,
    prefixes: Sequence[str] | None = None,
    verify: bool = True,
) -> CheckpointData:
    """Read a checkpoint directory written by ``write_checkpoint``.

    ``require``: the meta keys the caller reads, with their JSON types (``read_meta``).
    ``prefixes``: read only the tensors whose names start with one of these (``None``:
    all). Evaluation reads the model's (``"model."``, ``"embedding."``) and leaves the
    optimizer states, up to twice the tables' size under Adam, on disk.
    ``verify``: first check the manifest, every file's size and the SHA-256 of
    ``meta.json`` and ``tensors.safetensors`` (``verify_checkpoint``); ``False`` where
    the caller did (``verify_for_load``).

    Raises:
        FileNotFoundError: if ``path`` is not a complete checkpoint.
        ValueError: if its format version is unknown, a file is damaged, or a file is
            missing or differs from the manifest (naming it).
    """
    path = Path(path)
    if not (path / _META).is_file() or not (path / _TENSORS).is_file():
        raise _not_a_checkpoint(path, f"{_META} and {_TENSORS}")
    if verify:
        verify_checkpoint(path, hash_files=[_META, _TENSORS])
    meta = read_meta(path, require=require)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{path}: checkpoint format {meta.get('format')!r}, this tetrarec reads "
            f"{CHECKPOINT_FORMAT}"
        )
    try:
        if prefixes is None:
            tensors = load_file(str(path / _TENSORS))
        else:
            with safe_open(str(path / _TENSORS), framework="pt") as f:
                names = [k for k in f.keys() if k.startswith(tuple(prefixes))]  # noqa: SIM118
                tensors = {k: f.get_tensor(k) for k in names}
    except SafetensorError as e:
        raise ValueError(f"{path / _TENSORS}: damaged checkpoint tensors ({e})") from e
    return CheckpointData(step=meta["step"], tensors=tensors, meta=meta)


# --- optimizer and RNG states as named tensors plus JSON -------------------------------


def flatten_optimizer_state(
    state_dict: dict[str, Any], prefix: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a ``torch.optim`` state dict into named tensors and a JSON part.

    Tensors become ``"<prefix>.<key>.<name>"``, where the key is a parameter index
    (``torch.optim``) or a table name (a fused optimizer); non-tensor state values and
    the parameter groups go to the JSON part, which also records the keys and their
    kind (a key whose entry is empty, as every table's is under SGD, has no tensor to
    name it, and a fused optimizer's load needs every table).
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    string_keys = any(isinstance(k, str) for k in state_dict["state"])
    keys = [str(k) for k in state_dict["state"]]
    for idx, entry in state_dict["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{idx}.{name}"] = value
            else:
                scalars.setdefault(str(idx), {})[name] = value
    extra = {"scalars": scalars, "param_groups": state_dict["param_groups"]}
    return tensors, {**extra, "string_keys": string_keys, "keys": keys}


def unflatten_optimizer_state(
    tensors: dict[str, torch.Tensor], extra: dict[str, Any], prefix: str
) -> dict[str, Any]:
    """Inverse of ``flatten_optimizer_state``: a state dict for ``load_state_dict``."""
    state: dict[int | str, dict[str, Any]] = {}
    head = prefix + "."
    as_key = str if extra.get("string_keys") else int
    for idx in extra.get("keys", ()):  # absent from checkpoints written before it was kept
        state[as_key(idx)] = {}
    for key, value in tensors.items():
        if key.startswith(head):
            idx, name = key[len(head) :].split(".", 1)
            state.setdefault(as_key(idx), {})[name] = value
    for idx, entry in extra["scalars"].items():
        state.setdefault(as_key(idx), {}).update(entry)
    groups = [_tuples_back(g) for g in extra["param_groups"]]
    return {"state": state, "param_groups": groups}


def _tuples_back(group: dict[str, Any]) -> dict[str, Any]:
    # JSON turns tuples (Adam's betas) into lists; torch.optim expects tuples there.
    return {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}


def capture_rng_state(
    prefix: str = "rng", device: torch.device | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The torch CPU, numpy and python RNG states as named tensors plus JSON.

    Args:
        prefix: the tensors' name prefix.
        device: the run's device; for a CUDA device its generator's state (what
            dropout draws from there) is saved too, as ``<prefix>.cuda``.
    """
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    py_version, py_internal, py_gauss = random.getstate()
    tensors = {
        f"{prefix}.torch": torch.get_rng_state(),  # uint8
        f"{prefix}.numpy": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        f"{prefix}.python": torch.tensor(py_internal, dtype=torch.int64),
    }
    if device is not None and device.type == "cuda":
        tensors[f"{prefix}.cuda"] = torch.cuda.get_rng_state(device)  # uint8, on the host
    extra = {
        "numpy": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "python": [py_version, py_gauss],
    }
    return tensors, extra


def restore_rng_state(
    tensors: dict[str, torch.Tensor],
    extra: dict[str, Any],
    prefix: str = "rng",
    device: torch.device | None = None,
) -> None:
    """Set the torch CPU, numpy and python RNGs from ``capture_rng_state``'s output.

    On a CUDA ``device`` its generator is set too, when the state holds one (a run
    saved on the CPU and resumed on a GPU keeps the GPU's seeded generator).
    """
    torch.set_rng_state(tensors[f"{prefix}.torch"])
    cuda = tensors.get(f"{prefix}.cuda")
    if cuda is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
    np_kind, np_pos, np_has_gauss, np_gauss = extra["numpy"]
    keys = tensors[f"{prefix}.numpy"].numpy().astype(np.uint32)
    np.random.set_state((np_kind, keys, np_pos, np_has_gauss, np_gauss))
    py_version, py_gauss = extra["python"]
    internal = tuple(int(v) for v in tensors[f"{prefix}.python"].tolist())
    random.setstate((py_version, internal, py_gauss))
