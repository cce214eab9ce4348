"""Layering rules of DESIGN.md, checked on the source (no imports executed)."""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "tetrarec"

# package -> the tetrarec packages it may import (DESIGN.md: imports point one way).
# Every import counts: at module level, inside a function, under TYPE_CHECKING, and
# relative ones. Every package and top-level module of tetrarec has a row (a new one
# fails test_every_package_has_a_row until it gets one), and the table itself must be
# acyclic (test_the_allowed_table_is_acyclic), so it cannot permit a cycle.
ALLOWED: dict[str, set[str]] = {
    "types": set(),
    "jsonio": set(),
    "sparse": {"types"},
    "embedding": {"types", "sparse"},
    "data": {"types", "sparse", "embedding", "jsonio"},
    "kernels": {"types", "sparse", "embedding"},
    "cache": {"types", "sparse", "embedding", "kernels"},
    "comm": {"types", "sparse", "embedding"},
    "models": {"types", "sparse", "embedding", "kernels"},
    "sharding": {"types", "sparse", "embedding", "kernels", "cache", "comm", "jsonio"},
    # the run's config and its tables (config/tables.py), read by planner/ and train/
    "config": {"types", "embedding", "data", "kernels", "cache", "models", "sharding", "jsonio"},
    "planner": {"types", "embedding", "data", "models", "sharding", "config", "jsonio"},
    "train": {
        "types",
        "sparse",
        "embedding",
        "data",
        "kernels",
        "cache",
        "comm",
        "models",
        "sharding",
        "config",
        "planner",
        "jsonio",
    },
    # export reads checkpoints (train.checkpoint_tables) and the accuracy tools score with
    # the run's metrics (train.metrics); loading a model never imports train
    # (test_inference_loads_without_training_code)
    "inference": {
        "types",
        "sparse",
        "embedding",
        "data",
        "kernels",
        "models",
        "config",
        "train",
        "jsonio",
    },
    "cli": {
        "types",
        "comm",
        "config",
        "data",
        "kernels",
        "planner",
        "train",
        "inference",
        "jsonio",
    },
    "__main__": {"cli"},
    "__init__": {"types", "sparse", "embedding"},
    # importable test support: may reach everything the library has, never cli
    "testing": {
        "types",
        "sparse",
        "embedding",
        "data",
        "kernels",
        "cache",
        "comm",
        "models",
        "sharding",
        "config",
        "planner",
        "train",
        "inference",
        "jsonio",
    },
}
FORBIDDEN_EVERYWHERE = {"testing", "experiments", "tests", "benchmarks"}


def _package_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _module_parts(path: Path) -> list[str]:
    """``tetrarec/planner/inputs.py`` -> ``["tetrarec", "planner", "inputs"]``."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every tetrarec package (or ``tests``/``benchmarks``) ``path`` imports, with the line.

    ``import tetrarec.x.y``, ``from tetrarec.x import y``, ``from tetrarec import x`` (x a
    package or module) and relative imports (``from ..x import y``), wherever they stand.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_parts(path)
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        modules: list[list[str]] = []
        if isinstance(node, ast.Import):
            modules = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = base + (node.module.split(".") if node.module else [])
            else:
                mod = (node.module or "").split(".")
            # `from tetrarec import jsonio` imports the module tetrarec.jsonio
            modules = [[*mod, a.name] for a in node.names] if mod == ["tetrarec"] else [mod]
        for parts in modules:
            if parts[0] == "tetrarec" and len(parts) > 1:
                found.append((parts[1], node.lineno))
            elif parts[0] in {"tests", "benchmarks"}:
                found.append((parts[0], node.lineno))
    return found


def _tetrarec_imports(path: Path) -> set[str]:
    return {name for name, _ in _imports(path)}


def _sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _packages() -> set[str]:
    return {_package_of(p) for p in _sources()}


def _import_graph() -> dict[str, dict[str, str]]:
    """``{package: {imported package: "file:line" of the first such import}}``."""
    graph: dict[str, dict[str, str]] = {}
    for path in _sources():
        pkg = _package_of(path)
        edges = graph.setdefault(pkg, {})
        for name, line in _imports(path):
            if name != pkg and name in _packages():
                edges.setdefault(name, f"{path.relative_to(PKG.parent)}:{line}")
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` (depth-first search).

    >>> find_cycle({"a": ["b"], "b": ["a"]})
    ['a', 'b', 'a']
    >>> find_cycle({"a": ["b"], "b": []}) is None
    True
    """
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_every_package_has_a_row() -> None:
    """A package with no row would import anything unchecked (today's planner had none)."""
    missing = sorted(_packages() - set(ALLOWED))
    assert not missing, f"packages with no row in ALLOWED: {missing}"
    gone = sorted(set(ALLOWED) - _packages())
    assert not gone, f"rows in ALLOWED for packages that do not exist: {gone}"


def test_the_allowed_table_is_acyclic() -> None:
    """The table must not permit a cycle (a row allowing train beside train allowing it)."""
    assert find_cycle(ALLOWED) is None, f"ALLOWED permits the cycle {find_cycle(ALLOWED)}"


def test_no_import_cycle_between_packages() -> None:
    """Catches package A importing B while B imports A, even inside a function (the
    planner once imported train.build inside inputs_from_config while train imported the
    planner).
    """
    graph = _import_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        where = [f"{a} -> {b} ({graph[a][b]})" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("import cycle between packages:\n  " + "\n  ".join(where))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_one_way(path: Path) -> None:
    pkg = _package_of(path)
    imported = _tetrarec_imports(path) - {pkg}
    if pkg != "testing":
        bad = imported & FORBIDDEN_EVERYWHERE
        assert not bad, f"{path} imports {bad}"
    bad = imported - ALLOWED.get(pkg, set()) - FORBIDDEN_EVERYWHERE
    where = [f"{n} (line {line})" for n, line in _imports(path) if n in bad]
    assert not bad, f"{path} ({pkg}) may not import {where}"


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


def test_inference_loads_without_training_code() -> None:
    """``tetrarec.inference`` (load, the model, its tables) imports nothing of ``train``,
    ``sharding``, ``planner`` or ``comm``: a server loads a model without them."""
    code = (
        "import sys, tetrarec.inference, tetrarec.inference.model\n"
        "bad = sorted({m.split('.')[1] for m in sys.modules if m.startswith('tetrarec.')}"
        " & {'train', 'sharding', 'planner', 'comm'})\n"
        "assert not bad, f'imported {bad}'\n"
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
