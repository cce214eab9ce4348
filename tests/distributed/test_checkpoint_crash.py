"""Crash injection into sharded checkpoint writes, on 2 gloo ranks (issue 31 item 1).

One spawn runs every case in turn (``tetrarec.testing.checkpoint_crash.crash_worker``):
a sharded checkpoint of step 1 is written, the write of step 2 crashes at one
``WriteStage`` on one rank, and step 3 is written after it. The one-process writer's
crashes are in ``tests/unit/train/test_train_checkpoint_manifest.py``.
"""

from __future__ import annotations

import pytest

from tetrarec.testing import run_ranks
from tetrarec.testing.checkpoint_crash import CrashCase, crash_worker
from tetrarec.train.checkpoint import rank_file
from tetrarec.train.checkpoint_manifest import WriteStage

pytestmark = pytest.mark.distributed

RANK_STAGES = (WriteStage.RANK_FILES_BEFORE, WriteStage.RANK_FILES_AFTER)
CASES = [
    *(CrashCase(stage, rank) for stage in RANK_STAGES for rank in (0, 1)),
    *(CrashCase(stage, 0) for stage in WriteStage if stage not in RANK_STAGES),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What each of 2 ranks saw: ``(results per rank, root)``."""
    root = tmp_path_factory.mktemp("crash")
    results = run_ranks(
        crash_worker, world_size=2, args=(str(root), CASES), timeout_s=300, collective_timeout_s=60
    )
    return results, root


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{c.stage.value}-rank{c.rank}" for c in CASES]
)
def test_a_crash_at_each_stage_keeps_the_previous_checkpoint_on_every_rank(two_ranks, index):
    """Bugs caught: the manifest written (or the directory renamed) although a rank's
    files were not complete, a rank waiting for a crashed one until the collective
    timeout (the others must fail at once), the previous checkpoint damaged or pruned,
    the partial one taken as complete by any rank, its temporary directory left behind
    by the next write."""
    results, _ = two_ranks
    case = CASES[index]
    renamed = case.stage == WriteStage.RENAME_AFTER
    for rank, result in enumerate(r["crashes"][index] for r in results):
        if rank == case.rank:
            assert result["error"] == f"InjectedCrashError: injected crash at {case.stage.value}"
        else:
            assert result["error"].startswith("OSError: checkpoint ")
            assert f"not written: rank {case.rank} failed: InjectedCrashError" in result["error"]
        seen = result["after_crash"]
        step = 2 if renamed else 1
        assert seen["newest"] == f"step_{step:08d}"
        assert seen["complete"] == [f"step_{s:08d}" for s in range(1, step + 1)]
        # what the newest holds, verified on every rank: the dense file and its own rows
        assert seen["dense"] == [float(step)] * 3
        assert seen["own"] == [float(step * 10 + rank)] * 4
        assert seen["temporaries"] == ([] if renamed else [".tmp-step_00000002"])
        after = result["after_next"]
        assert after["newest"] == "step_00000003"
        assert after["temporaries"] == []
        assert after["own"] == [float(30 + rank)] * 4


def test_a_damaged_rank_file_is_an_error_on_every_rank(two_ranks):
    """Rank 1's file of a complete checkpoint has a flipped byte; only rank 1 reads it.
    Bug caught: rank 1 alone refuses it while rank 0 loads and waits in the first
    collective until the timeout; every rank must name the file."""
    results, root = two_ranks
    file = root / "damaged" / "step_00000001" / rank_file(1)
    message = f"{file}: damaged checkpoint file (its SHA-256 differs from manifest.json's)"
    assert results[1]["damaged"] == message
    assert results[0]["damaged"] == f"{message} (found by rank 1)"
