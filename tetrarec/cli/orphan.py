"""A torchrun rank stops when its launcher is gone.

When ``torchrun`` itself is killed (SIGKILL, an out-of-memory kill, a lost login shell),
its ranks are not told: they kept training and writing checkpoints as orphans, and a new
launch then raced them for the checkpoint directory. A rank started by a launcher runs
``watch_launcher``: a daemon thread that polls the parent process id; when it changes
(the rank was re-parented), it sends the rank SIGTERM, which unwinds the run as a
scheduler's SIGTERM does (exit status 143), and if the rank is still alive ``grace_s``
later (stuck in a collective with a peer that is gone), ends it with that status at once.
A checkpoint being written then stays a temporary directory that the next run removes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["watch_launcher"]


def watch_launcher(poll_s: float = 1.0, grace_s: float = 60.0) -> threading.Thread:
    """Start the watch of this process's launcher (its parent process).

    Args:
        poll_s: how often the parent process id is read.
        grace_s: how long SIGTERM may take to end the process before it is ended.

    Returns:
        The daemon thread (started).
    """
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(143)

    thread = threading.Thread(target=watch, name="tetrarec-launcher-watch", daemon=True)
    thread.start()
    return thread
