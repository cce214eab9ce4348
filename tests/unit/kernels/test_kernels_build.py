"""The compiled kernels' build: its cache key, and when a failed build is an error."""

from __future__ import annotations

import logging
import shutil
import sysconfig
from pathlib import Path

import pytest

from tetrarec.kernels import _build
from tetrarec.kernels._build import build_key, compiled_cpu_kernels, kernel_path

CSRC = Path(_build.__file__).parent / "csrc"


def _checkout(root: Path) -> Path:
    """A copy of the kernel sources, as another checkout of the repository has them."""
    shutil.copytree(CSRC, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_build_key_follows_the_sources_not_the_path(tmp_path: Path) -> None:
    """Fails if the key ignores the sources (two checkouts with different kernels share
    a build and rebuild each other's on every run) or depends on the checkout's path."""
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    assert build_key(a) == build_key(b) == build_key()
    for name in ("tbe_cpu.cpp", "tbe_cpu_backward.h"):  # a header counts as much as a .cpp
        c = _checkout(tmp_path / f"edit-{name}")
        (c / name).write_bytes((c / name).read_bytes() + b"\n// edited\n")
        assert build_key(c) != build_key(a), name


def test_build_key_follows_compiler_flags_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails if a binary built with other flags, another compiler or another torch is
    loaded from the cache, or if two venvs share one build directory (each run of one
    would rebuild the other's kernels: a 2-step training run took minutes)."""
    import torch

    base = build_key()
    monkeypatch.setattr(_build, "_CFLAGS", (*_build._CFLAGS, "-DTETRAREC_OTHER"))
    flags = build_key()
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    compiler = build_key()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    other_torch = build_key()
    monkeypatch.undo()
    assert build_key() == base
    # Another venv: ninja's command line names torch's and Python's headers by path, so
    # one build directory shared by two venvs is rebuilt by each in turn.
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    other_venv = build_key()
    monkeypatch.undo()
    real = sysconfig.get_paths
    monkeypatch.setattr(
        sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": "/other/py"}
    )
    other_python = build_key()
    assert len({base, flags, compiler, other_torch, other_venv, other_python}) == 6


def _failing_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, ci: str | None) -> None:
    """A fresh cache and a compiler that does not exist: the real build fails."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TETRAREC_KERNELS", "auto")
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(_build, "_STATE", {})
    monkeypatch.setattr(_build, "_ERRORS", {})
    # torch numbers the builds of one extension name per process; a failed build here
    # must not make a later test's load of the real build a rebuild under a new name.
    versioner = cpp_extension.JIT_EXTENSION_VERSIONER
    monkeypatch.setattr(versioner, "entries", dict(versioner.entries))


@pytest.mark.parametrize("ci", ["true", "1"])
def test_failed_build_in_ci_is_an_error_every_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str
) -> None:
    """Fails if CI falls back to the portable path (compiled-path tests then skip and a
    broken kernel passes CI), or if only the first call raises (later tests would
    silently run the portable path)."""
    _failing_build(monkeypatch, tmp_path, ci=ci)
    attempts = []
    real_compile = _build._compile

    def counted() -> object:
        attempts.append(1)
        return real_compile()

    monkeypatch.setattr(_build, "_compile", counted)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"CI is set.*no-such-compiler"):
            compiled_cpu_kernels()
    assert len(attempts) == 1  # remembered: no second compile per call
    assert kernel_path() == "portable"


def test_failed_build_outside_ci_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails if a failed build outside CI (a laptop without a compiler) stops the run,
    or if ``CI=false`` counts as CI."""
    _failing_build(monkeypatch, tmp_path, ci="false")
    with caplog.at_level(logging.WARNING, logger="tetrarec.kernels._build"):
        assert compiled_cpu_kernels() is None
    assert "portable PyTorch path" in caplog.text
    assert kernel_path() == "portable"


def test_kernel_path_names_what_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails if a benchmark could label the portable path as the compiled kernel."""
    monkeypatch.setenv("TETRAREC_KERNELS", "auto")
    module = compiled_cpu_kernels()  # raises in CI if the build fails
    assert kernel_path() == ("compiled" if module is not None else "portable")
    if module is not None:
        assert set(module.build_info()) == {"isa", "vector_paths", "compiler"}
    monkeypatch.setattr(_build, "_STATE", {})
    assert kernel_path() == "none"
    monkeypatch.setenv("TETRAREC_KERNELS", "reference")
    monkeypatch.setattr(_build, "_STATE", {"cpu": module})
    assert kernel_path() == "portable"


def test_training_time_excludes_the_kernel_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Fails if the loop builds the kernels inside its first timed step: samples_per_s
    would then include the build (here one that takes 2 s)."""
    import time

    from tetrarec.config import RunConfig
    from tetrarec.train import train

    monkeypatch.setenv("TETRAREC_KERNELS", "auto")
    module = compiled_cpu_kernels()
    build_s = 2.0

    def slow_build() -> object:
        time.sleep(build_s)
        return module

    monkeypatch.setattr(_build, "_STATE", {})
    monkeypatch.setattr(_build, "_compile", slow_build)
    config = RunConfig().with_overrides(
        [
            "data.source=synthetic",
            "data.batch_size=16",
            "data.synthetic.num_samples=64",
            "data.synthetic.eval_samples=16",
            "model.num_sparse=2",
            "model.num_embeddings=[20, 30]",
            "model.dlrm.bottom_mlp=[8, 4]",
            "model.dlrm.top_mlp=[4, 1]",
            "train.steps=2",
            "train.progress=false",
            "train.log_every=0",
        ]
    )
    result = train(config)
    assert "cpu" in _build._STATE  # the (slow) build did happen in this run
    assert result.train_seconds < build_s


def test_sources_are_staged_once_so_checkouts_share_a_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails if staging rewrites an identical file (its new mtime would make ninja rebuild
    the shared build on every run from another checkout), or misses a changed one."""
    from tetrarec.kernels import _build

    checkout = _checkout(tmp_path / "checkout")
    monkeypatch.setattr(_build, "_CSRC", checkout)
    build = tmp_path / "build"
    build.mkdir()
    src = _build._staged_sources(build)
    staged = sorted(p.name for p in src.iterdir())
    assert staged == sorted(p.name for p in checkout.iterdir() if p.suffix in (".cpp", ".h"))
    assert all((src / n).read_bytes() == (checkout / n).read_bytes() for n in staged)
    mtimes = {n: (src / n).stat().st_mtime_ns for n in staged}
    _build._staged_sources(build)  # another checkout with the same sources
    assert {n: (src / n).stat().st_mtime_ns for n in staged} == mtimes
    (checkout / "copy_cpu.cpp").write_bytes(b"// edited\n")
    _build._staged_sources(build)
    assert (src / "copy_cpu.cpp").read_bytes() == b"// edited\n"
    assert not list(src.glob(".*.tmp"))
