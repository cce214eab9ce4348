"""Crash injection into checkpoint writes, and resealing a checkpoint a test edited.

``CrashAt(stage)`` is a write's ``on_stage`` hook (``tetrarec.train.checkpoint``) that
raises ``InjectedCrashError`` at one ``WriteStage``. ``crash_worker`` runs every stage's
crash in turn on the ranks of a sharded write (``tests/distributed/
test_checkpoint_crash.py``); ``reseal`` rewrites a checkpoint's manifest after a test
edited its files on purpose, so that the readers behind the manifest see the edit.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tetrarec.testing.multiprocess import RankContext
from tetrarec.train.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointData,
    latest_checkpoint,
    list_checkpoints,
    rank_file,
    read_checkpoint,
    read_rank_tensors,
    verify_for_load,
    write_sharded_checkpoint,
)
from tetrarec.train.checkpoint_manifest import (
    MANIFEST,
    WriteStage,
    file_entry,
    write_manifest,
)

__all__ = ["CrashAt", "CrashCase", "InjectedCrashError", "crash_worker", "reseal"]


class InjectedCrashError(RuntimeError):
    """The crash a test injected into a checkpoint write."""


@dataclass(frozen=True)
class CrashAt:
    """An ``on_stage`` hook that raises ``InjectedCrashError`` at ``stage``.

    Args:
        stage: where to crash.
        image: if set, the checkpoint root is first copied there as it stands (what a
            process killed at that point leaves on disk; the raise lets ``finally``
            and ``except`` blocks run, which a kill does not).
    """

    stage: WriteStage
    image: Path | None = None

    def __call__(self, stage: WriteStage, directory: Path) -> None:
        """Crash if ``stage`` is this hook's stage."""
        if stage != self.stage:
            return
        if self.image is not None:
            shutil.copytree(directory.parent, self.image, symlinks=True)
        raise InjectedCrashError(f"injected crash at {stage.value}")


def reseal(path: str | Path) -> None:
    """Rewrite checkpoint ``path``'s manifest from its files as they are now.

    Tests that edit a checkpoint's files on purpose (to check the readers behind the
    manifest) call it; an edit left unsealed is refused by the manifest check first.
    ``meta.json`` may be damaged too: the manifest then repeats none of its values.
    """
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_bytes())
    except ValueError:
        meta = None
    names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)
    write_manifest(
        path,
        [file_entry(path / n) for n in names],
        step=int(path.resolve().name.removeprefix("step_")),
        meta=meta if isinstance(meta, dict) else {},
        checkpoint_format=CHECKPOINT_FORMAT,
    )


@dataclass(frozen=True)
class CrashCase:
    """One crash of a sharded write.

    Args:
        stage: where the write crashes.
        rank: the rank that crashes there (rank 0 for the stages only it reaches).
    """

    stage: WriteStage
    rank: int


def _write(ctx: RankContext, root: Path, step: int, hook: CrashAt | None) -> Path:
    """A sharded checkpoint of ``step``: rank 0's dense file, each rank's own file."""
    data = CheckpointData(
        step=step,
        tensors={"dense": torch.full((3,), float(step))},
        meta={"data_position": step, "sharding": {"world_size": ctx.world_size}},
    )
    mine = {"rows": torch.full((2, 2), float(step * 10 + ctx.rank))}
    return write_sharded_checkpoint(root, data, mine, ctx.comm, on_stage=hook)


def _observe(ctx: RankContext, root: Path) -> dict[str, Any]:
    """What this rank sees in ``root``: the newest checkpoint and what it holds."""
    newest = latest_checkpoint(root)
    assert newest is not None
    # listed before the collective below: after it, a faster rank goes on to its next
    # write and its new temporary would show up here (a race seen under load)
    temporaries = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp"))
    verify_for_load(newest, ctx.comm)  # collective: every rank verifies its files
    own = read_rank_tensors(newest, ctx.rank, verify=False)["rows"]
    return {
        "newest": newest.name,
        "complete": [p.name for p in list_checkpoints(root)],
        "dense": read_checkpoint(newest, verify=False).tensors["dense"].tolist(),
        "own": own.flatten().tolist(),
        "temporaries": temporaries,
    }


def crash_worker(ctx: RankContext, root: str, cases: list[CrashCase]) -> dict[str, Any]:
    """Every case's crash in turn, then a damaged rank file; what this rank saw.

    For each case (its own directory under ``root``): step 1 written, step 2 crashed at
    the case's stage on the case's rank, step 3 written. ``crashes[i]`` holds the error
    this rank raised, and what it saw after the crash (``after_crash``) and after the
    next write (``after_next``). ``damaged``: the error each rank's verification gives
    once rank 1's file of a complete checkpoint has a flipped byte.
    """
    crashes = []
    for i, case in enumerate(cases):
        where = Path(root) / f"case{i}"
        _write(ctx, where, 1, None)
        hook = CrashAt(case.stage) if ctx.rank == case.rank else None
        try:
            _write(ctx, where, 2, hook)
            error = None
        except (InjectedCrashError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
        ctx.comm.barrier(label="test")  # every rank out of the write before looking
        after_crash = _observe(ctx, where)
        _write(ctx, where, 3, None)
        crashes.append(
            {"error": error, "after_crash": after_crash, "after_next": _observe(ctx, where)}
        )
    where = Path(root) / "damaged"
    path = _write(ctx, where, 1, None)
    if ctx.rank == 1:
        file = path / rank_file(1)
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 0x40
        file.write_bytes(bytes(raw))
    ctx.comm.barrier(label="test")
    try:
        verify_for_load(path, ctx.comm)
        damaged = None
    except ValueError as e:
        damaged = str(e)
    return {"crashes": crashes, "damaged": damaged}
