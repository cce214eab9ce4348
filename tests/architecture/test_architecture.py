"""Layering rules of DESIGN.md, checked on the source (no imports executed)."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "tetrarec"

# package -> tetrarec packages it may import (DESIGN.md: imports point one way)
ALLOWED: dict[str, set[str]] = {
    "types": set(),
    "sparse": {"types"},
    "data": {"types", "sparse", "embedding", "_utils"},
    "embedding": {"types", "sparse", "_utils"},
    "kernels": {"types", "sparse", "embedding", "_utils"},
    "cache": {"types", "sparse", "embedding", "kernels", "_utils"},
    "comm": {"types", "sparse", "embedding", "_utils"},
    "models": {"types", "sparse", "embedding", "kernels", "_utils"},
    "sharding": {"types", "sparse", "embedding", "kernels", "cache", "comm", "_utils"},
    "_utils": {"types"},
}
FORBIDDEN_EVERYWHERE = {"testing", "experiments", "tests", "benchmarks"}


def _tetrarec_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for n in names:
            parts = n.split(".")
            if parts[0] == "tetrarec" and len(parts) > 1:
                found.add(parts[1])
            elif parts[0] in {"tests", "benchmarks"}:
                found.add(parts[0])
    return found


def _package_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_one_way(path: Path) -> None:
    pkg = _package_of(path)
    imported = _tetrarec_imports(path) - {pkg}
    if pkg != "testing":
        bad = imported & FORBIDDEN_EVERYWHERE
        assert not bad, f"{path} imports {bad}"
    if pkg in ALLOWED:
        bad = imported - ALLOWED[pkg]
        assert not bad, f"{path} ({pkg}) may not import {sorted(bad)}"


def test_only_comm_calls_collectives() -> None:
    """torch.distributed is imported by comm/ (and the test harness, which starts ranks)."""
    for path in _sources():
        if _package_of(path) in {"comm", "testing"}:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("torch.distributed") for n in names), path


def test_models_never_import_sharding() -> None:
    for path in (PKG / "models").rglob("*.py"):
        assert not {"sharding", "planner", "train"} & _tetrarec_imports(path), path


def test_import_is_lean() -> None:
    """``import tetrarec`` pulls in no Triton and initializes no CUDA (torchao's rule)."""
    code = (
        "import sys, torch, tetrarec, tetrarec.kernels, tetrarec.models, tetrarec.data\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialized'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


API_SNAPSHOT = Path(__file__).with_name("public_api.json")


def _public_modules() -> list[str]:
    """``tetrarec``, its subpackages and public top-level modules, found on disk (so a
    new public module needs a snapshot entry too)."""
    names = ["tetrarec"]
    for p in sorted(PKG.iterdir()):
        if p.name.startswith("_"):
            continue
        if p.is_dir() and (p / "__init__.py").exists():
            names.append(f"tetrarec.{p.name}")
        elif p.suffix == ".py":
            names.append(f"tetrarec.{p.stem}")
    return names


def test_public_api_matches_the_written_snapshot() -> None:
    """Adding, removing or renaming a public name (or module) fails until
    ``tests/architecture/public_api.json`` is edited in the same change, so the public
    API changes deliberately, never as a side effect. Each ``__all__`` must also name
    only what its module has."""
    snapshot = json.loads(API_SNAPSHOT.read_text())
    current: dict[str, list[str]] = {}
    for name in _public_modules():
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{name} has no __all__"
        missing = [n for n in exported if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what the module lacks: {missing}"
        assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
        current[name] = sorted(exported)
    diff = []
    for name in sorted(set(snapshot) | set(current)):
        if name not in current:
            diff.append(f"{name}: in the snapshot, but no such public module")
            continue
        if name not in snapshot:
            diff.append(f"{name}: a public module missing from the snapshot")
            continue
        added = sorted(set(current[name]) - set(snapshot[name]))
        removed = sorted(set(snapshot[name]) - set(current[name]))
        diff += [f"{name}: + {n}" for n in added] + [f"{name}: - {n}" for n in removed]
    assert not diff, (
        f"the public API differs from {API_SNAPSHOT.name} (edit it if the change is "
        "meant):\n" + "\n".join(diff)
    )
