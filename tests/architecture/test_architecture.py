"""Layering rules of DESIGN.md, checked on the source (no imports executed)."""

from __future__ import annotations

import ast
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


def test_public_api() -> None:
    import tetrarec

    for name in tetrarec.__all__:
        assert hasattr(tetrarec, name), name
