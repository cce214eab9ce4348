"""No code execution from files: nothing in ``tetrarec/`` loads a pickle, and files that
hold one are refused without running it.

Checkpoints and exported models are safetensors plus JSON (DESIGN.md, "Safe files"). A
pickle (``torch.load`` without ``weights_only=True``, ``pickle.load``,
``numpy.load(allow_pickle=True)``, ``dill``, ``joblib``) runs whatever code the file
names, so a checkpoint downloaded from elsewhere could run anything. Two guards:

- ``find_pickle_loading`` reads the package's source as Python syntax trees (not text:
  comments, strings and ``model.eval()`` never match; aliases such as
  ``import torch as t`` or ``from pickle import loads`` do) and names each file:line
  that could load a pickle or run file content (``eval``/``exec``). Its own tests show
  it catches each pattern;
- a checkpoint and an exported model whose tensor file is a live pickle payload (a
  ``torch.save`` of an object whose ``__reduce__`` creates a marker file) are refused
  with their documented one-line errors, and the marker never appears.
"""

from __future__ import annotations

import ast
import hashlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.inference.format import (
    MANIFEST,
    TENSORS,
    Manifest,
    ModelFileError,
    read_model_dir,
    write_model_dir,
)
from tetrarec.testing.checkpoint_crash import reseal
from tetrarec.train import build_parts
from tetrarec.train.checkpoint import rank_file, read_checkpoint, read_rank_tensors
from tetrarec.train.state import load_model_state, load_run_state, save_run_state

PACKAGE = Path(__file__).resolve().parents[2] / "tetrarec"

# Modules whose import alone is a finding: each exists to load pickles.
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "joblib", "cloudpickle", "shelve"}
# Calls that unpickle whatever their file or bytes hold.
UNPICKLING_CALLS = {
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "_pickle.load",
    "_pickle.loads",
    "marshal.load",
    "marshal.loads",
    "pandas.read_pickle",
    "torch.serialization.load",
}


@dataclass(frozen=True)
class Finding:
    """One place that could run code from a file."""

    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """``{local name: dotted name it stands for}`` from the module's imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    """The dotted name a call's function spells, imports resolved (``t.load`` ->
    ``torch.load``); None for anything else (a call's result, a subscript)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = names.get(node.id, node.id)
    return ".".join([head, *reversed(parts)])


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_false(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def find_pickle_loading(source: str, path: str = "<snippet>") -> list[Finding]:
    """Every place in ``source`` that could load a pickle or execute file content.

    Findings: an import of a pickle module; ``torch.load`` without a literal
    ``weights_only=True``; ``numpy.load`` with ``allow_pickle`` other than a literal
    ``False``; the calls of ``UNPICKLING_CALLS``; the builtins ``eval`` and ``exec``.
    """
    tree = ast.parse(source, filename=path)
    names = _imported_names(tree)
    found: list[Finding] = []

    def add(node: ast.AST, what: str) -> None:
        found.append(Finding(path, getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PICKLE_MODULES:
                    add(node, f"imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in PICKLE_MODULES:
                add(node, f"imports from {node.module}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func, names)
            if name is None:
                continue
            if name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
                add(node, "torch.load without weights_only=True (unpickles)")
            elif name in ("numpy.load", "numpy.lib.npyio.load"):
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not _is_false(allow):
                    add(node, "numpy.load with allow_pickle (unpickles object arrays)")
            elif name in UNPICKLING_CALLS:
                add(node, f"{name} (unpickles)")
            elif isinstance(node.func, ast.Name) and name in ("eval", "exec"):
                add(node, f"{name}() (runs text as code)")
    return found


# -- the scanner catches each pattern -------------------------------------------------------

CAUGHT = {
    "torch.load": "import torch\nstate = torch.load(path)\n",
    "torch.load weights_only=False": "import torch\ntorch.load(path, weights_only=False)\n",
    "torch.load weights_only from a variable": "import torch\ntorch.load(p, weights_only=flag)\n",
    "torch aliased": "import torch as t\nt.load(path)\n",
    "from torch import load": "from torch import load\nload(path)\n",
    "torch.serialization.load": "import torch.serialization\ntorch.serialization.load(p)\n",
    "import pickle": "import pickle\n",
    "pickle.loads via from-import": "from pickle import loads\nloads(blob)\n",
    "import dill": "import dill as d\n",
    "import joblib": "import joblib\n",
    "from cloudpickle": "from cloudpickle import loads\n",
    "numpy allow_pickle": "import numpy as np\nnp.load(path, allow_pickle=True)\n",
    "numpy allow_pickle variable": "import numpy\nnumpy.load(path, allow_pickle=ok)\n",
    "pandas.read_pickle": "import pandas as pd\npd.read_pickle(path)\n",
    "marshal": "import marshal\nmarshal.loads(blob)\n",
    "eval": "value = eval(open(path).read())\n",
    "exec": "exec(Path(path).read_text())\n",
}
CLEAN = {
    "torch.load weights_only=True": "import torch\ntorch.load(path, weights_only=True)\n",
    "numpy.load default": "import numpy as np\nnp.load(path)\n",
    "numpy.load allow_pickle=False": "import numpy as np\nnp.load(path, allow_pickle=False)\n",
    "a method named eval": "model.eval()\n",
    "a method named load": "config.load(path)\nsafetensors.torch.load_file(path)\n",
    "json.load": "import json\njson.load(f)\n",
    "in a string or comment": "# torch.load(path)\ntext = 'import pickle; pickle.loads(x)'\n",
    "ast.literal_eval": "import ast\nast.literal_eval(text)\n",
}


@pytest.mark.parametrize("snippet", CAUGHT.values(), ids=CAUGHT.keys())
def test_the_scanner_catches_each_pattern(snippet) -> None:
    """A scanner that misses an alias, a from-import or a keyword's value would let that
    pattern into the package unnoticed."""
    found = find_pickle_loading(snippet)
    assert len(found) >= 1, snippet
    assert all(str(f).startswith("<snippet>:") for f in found)


@pytest.mark.parametrize("snippet", CLEAN.values(), ids=CLEAN.keys())
def test_the_scanner_leaves_safe_code_alone(snippet) -> None:
    """A scanner that matched text (comments, strings, ``model.eval()``) would fail the
    package test for code that loads nothing."""
    assert find_pickle_loading(snippet) == []


def test_the_scanner_names_file_and_line() -> None:
    """The failure message says where: file:line of the call, not of the import."""
    found = find_pickle_loading("import torch\n\n\nx = torch.load(p)\n", "pkg/mod.py")
    assert [str(f) for f in found] == [
        "pkg/mod.py:4: torch.load without weights_only=True (unpickles)"
    ]


def test_the_package_loads_no_pickle_and_runs_no_file_content() -> None:
    """Every .py file under tetrarec/: no pickle loading, no eval/exec (a checkpoint or
    model file could otherwise run code on load)."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the package, not an empty folder
    found = [
        f
        for p in files
        for f in find_pickle_loading(p.read_text(), str(p.relative_to(PACKAGE.parent)))
    ]
    assert not found, "code that could run a file's content:\n" + "\n".join(map(str, found))


# -- files holding a pickle payload are refused, and the payload never runs -----------------


class _Payload:
    """Unpickling this creates ``path``: proof that the pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def marker(tmp_path) -> Path:
    """A marker file path; the payload is checked live (unpickled, it creates it)."""
    path = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Payload(path)))
    assert path.exists()
    path.unlink()
    return path


TINY = [
    "data.source=synthetic",
    "model.num_sparse=2",
    "model.num_embeddings=[10, 7]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
]


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch.save zip", "torch.save legacy"])
def test_a_checkpoint_whose_tensor_file_is_a_pickle_is_refused_unrun(
    tmp_path, marker, zip_format
) -> None:
    """``tensors.safetensors`` (and a sharded rank's file) replaced by ``torch.save`` of a
    payload: resume, evaluation and the raw reader refuse it as damaged tensors (a
    ``ValueError``, exit status 2), and the payload never runs. A reader that fell back
    to ``torch.load`` would create the marker."""
    cfg = RunConfig().with_overrides(TINY)
    path = save_run_state(
        tmp_path / "ck", build_parts(cfg, num_dense=13), step=1, config=cfg, keep=1
    )
    for name in ("tensors.safetensors", rank_file(0)):
        torch.save(
            {"model.dense_arch.layers.0.weight": _Payload(marker)},
            path / name,
            _use_new_zipfile_serialization=zip_format,
        )
    reseal(path)  # a crafted checkpoint may come with a matching manifest
    readers = [
        lambda: read_checkpoint(path),
        lambda: load_run_state(path, build_parts(cfg, num_dense=13)),
        lambda: load_model_state(path, build_parts(cfg, num_dense=13).model),
        lambda: read_rank_tensors(path, 0),
    ]
    for read in readers:
        with pytest.raises(ValueError, match="damaged checkpoint tensors"):
            read()
        assert not marker.exists()


def test_an_exported_model_whose_tensor_file_is_a_pickle_is_refused_unrun(tmp_path, marker) -> None:
    """An exported model directory (``tetrarec.inference.format``) whose tensor file is
    a payload, with a manifest re-hashed to match it (what a forger who knows the format
    writes): ``ModelFileError``, and the payload never runs."""
    model = tmp_path / "model"
    manifest = Manifest(config={}, dense_transform=None, tables=[], dense={})
    write_model_dir(model, manifest, {"dense.w": torch.zeros(2)})
    read_model_dir(model)  # the directory reads before it is forged
    torch.save({"dense.w": _Payload(marker)}, model / TENSORS)
    values = json.loads((model / MANIFEST).read_text())
    data = (model / TENSORS).read_bytes()
    values["files"][TENSORS] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    values["content_hash"] = Manifest.from_dict(values, "x").computed_hash()
    (model / MANIFEST).write_text(json.dumps(values))
    with pytest.raises(ModelFileError, match=r"tensors\.safetensors: not a readable safetensors"):
        read_model_dir(model)
    assert not marker.exists()
