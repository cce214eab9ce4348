"""The mutation scripts still fit the code they mutate (``mutation/README.md``).

``make mutants`` is not part of ``make test``: without these checks a refactor of the
kernels leaves the C++ script's patterns pointing at lines that no longer exist, and
the script stops at its first run (8 of its 36 did, after the kernels' forward and
row-rule rewrites, until this test was written).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "mutation" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_every_cpp_mutant_patches_exactly_one_place_of_the_current_sources() -> None:
    """Fails when a seeded bug's pattern is missing from its file (the script would stop
    before building anything) or occurs twice (the patch would change more than the one
    place it describes), or when a mutant changes nothing."""
    cpp = _load("cpp_mutants")
    assert len(cpp.MUTANTS) >= 20
    for m in cpp.MUTANTS:
        text = (ROOT / m.file).read_text()
        assert text.count(m.old) == 1, f"{m.name}: {m.old!r} occurs {text.count(m.old)} times"
        assert m.new != m.old, m.name
