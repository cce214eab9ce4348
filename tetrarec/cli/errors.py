"""One error line per distinct message under torchrun.

Every rank of a launch meets the same bad config or file and raised the same error, so
``torchrun --nproc-per-node 8`` printed the line eight times. A rank prints an error line
only if no other rank of its node printed the same one: the first to create a marker
named after the launcher's process and the message wins (``O_CREAT | O_EXCL``, atomic on
one file system). Markers live in the temporary directory, in one folder per launcher;
a rank removes the folders of launchers that have exited. A one-process run always
prints.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["first_to_say"]

_PREFIX = "tetrarec-errors-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def first_to_say(message: str, world_size: int, root: Path | None = None) -> bool:
    """Whether this rank is the first of its node to report ``message``.

    Args:
        message: the error line.
        world_size: the launch's ranks (1: always True).
        root: where the markers go (default: the temporary directory).

    Returns:
        True for the first rank of this launcher (the parent process) to report it, or
        where the marker cannot be made (a read-only temporary directory: then every
        rank prints, as before).
    """
    if world_size <= 1:
        return True
    root = Path(tempfile.gettempdir()) if root is None else root
    launcher = os.getppid()
    try:
        for old in root.glob(f"{_PREFIX}*"):
            pid = old.name.removeprefix(_PREFIX)
            if pid.isdigit() and int(pid) != launcher and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        folder = root / f"{_PREFIX}{launcher}"
        folder.mkdir(exist_ok=True)
        digest = hashlib.sha256(message.encode()).hexdigest()[:32]
        fd = os.open(folder / digest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    except OSError:
        return True
    os.close(fd)
    return True
