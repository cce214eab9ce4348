"""A torchrun rank stops when its launcher dies (issue 31 item 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import time
    from tetrarec.cli.orphan import watch_launcher
    watch_launcher(poll_s=0.05, grace_s={grace})
    {body}
    """
)
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", {child!r}])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _gone(pid: int) -> bool:
    """Exited (or a zombie waiting for a reaper that is not its launcher)."""
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(ln for ln in status.read_text().splitlines() if ln.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "Z" in state.split()[1]


def _orphan_lives_for(body: str, grace: float) -> float:
    """Seconds the child ran on after its parent was killed with SIGKILL."""
    child = CHILD.format(grace=grace, body=body)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(child=child)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    time.sleep(1.0)  # the child imported tetrarec and started its watch
    assert not _gone(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    start = time.monotonic()
    while not _gone(pid) and time.monotonic() - start < 30:
        time.sleep(0.05)
    alive = time.monotonic() - start
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)
    return alive


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_rank_whose_launcher_is_killed_stops() -> None:
    """Bug caught: after `kill -9` of torchrun its ranks trained on as orphans (here a
    child that would sleep two minutes stops within seconds of its parent's death)."""
    assert _orphan_lives_for("time.sleep(120)", grace=30) < 10


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_rank_that_ignores_sigterm_is_ended_after_the_grace() -> None:
    """Bug caught: a rank stuck where SIGTERM cannot reach it (a collective with a peer
    that is gone; here SIGTERM ignored) lived on forever."""
    body = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    assert _orphan_lives_for(body, grace=1.0) < 10
