"""Under torchrun an error line prints once per distinct message (issue 31 item 6)."""

from __future__ import annotations

import os
import subprocess
import sys

from tetrarec.cli.errors import first_to_say


def test_each_distinct_line_is_said_once_per_launcher(tmp_path) -> None:
    """Bug caught: every rank printed the same error line (8 lines from 8 ranks), or a
    second, different error was swallowed with the first."""
    assert first_to_say("tetrarec train: error: x", 4, tmp_path)
    assert not first_to_say("tetrarec train: error: x", 4, tmp_path)
    assert first_to_say("tetrarec train: error: y", 4, tmp_path)
    assert not first_to_say("tetrarec train: error: y", 4, tmp_path)


def test_one_process_always_says_it(tmp_path) -> None:
    """Bug caught: a plain run's repeated error (a second command in one shell) silenced."""
    assert first_to_say("m", 1, tmp_path)
    assert first_to_say("m", 1, tmp_path)
    assert not list(tmp_path.iterdir())  # no markers for one process


def test_another_launcher_says_it_again_and_dead_launchers_are_cleaned(tmp_path) -> None:
    """Bug caught: a marker outliving its launch silenced the next launch's same error, or
    markers piled up in the temporary directory."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f"tetrarec-errors-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "marker").touch()
    assert first_to_say("m", 2, tmp_path)
    assert not stale.exists()
    assert (tmp_path / f"tetrarec-errors-{os.getppid()}").is_dir()
