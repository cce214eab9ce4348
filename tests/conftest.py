"""Test-wide settings: deterministic algorithms, fixed seeds, derandomized hypothesis."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    from hypothesis import settings

    settings.register_profile("tetrarec", derandomize=True, deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "tetrarec"))
except ImportError:  # pragma: no cover - hypothesis is a test extra
    pass

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
# Read once, before any test sets the variable (see ``portable_mode``).
_RUN_MODE = os.environ.get("TETRAREC_KERNELS", "").strip().lower()


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the repository; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data samples not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def portable_mode() -> str:
    """The ``TETRAREC_KERNELS`` mode of the portable path the tests that force one run on
    the CPU: the per-table loop (``reference``), or the batched path a GPU runs
    (``batched``) when the whole run is started under ``TETRAREC_KERNELS=batched``."""
    return "batched" if _RUN_MODE == "batched" else "reference"


@pytest.fixture
def raises_exactly() -> Callable[[str], AbstractContextManager[object]]:
    """``raises_exactly(message)``: ``pytest.raises(ValueError)`` whose message must be
    exactly ``message`` (not only contain it), for the tests of exact error messages."""

    def expect(message: str) -> AbstractContextManager[object]:
        return pytest.raises(ValueError, match=f"^{re.escape(message)}$")

    return expect
