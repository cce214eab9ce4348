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
def raises_exactly() -> Callable[[str], AbstractContextManager[object]]:
    """``raises_exactly(message)``: ``pytest.raises(ValueError)`` whose message must be
    exactly ``message`` (not only contain it), for the tests of exact error messages."""

    def expect(message: str) -> AbstractContextManager[object]:
        return pytest.raises(ValueError, match=f"^{re.escape(message)}$")

    return expect
