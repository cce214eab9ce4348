"""The compiled kernels' build: its cache key, and when a failed build is an error."""

from __future__ import annotations

import logging
import re
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# -- Found by mutation testing (mutation/README.md, "tetrarec/kernels ops", _build.py) -----
# Each test below fails on a seeded bug in ``_build.py`` that every other test left alive.
# None of them compiles: a build that must fail uses a compiler that does not exist (it
# fails in well under a second, after torch wrote its ninja file), and the one that loads
# the kernels reuses the build this process has already loaded.

_CPUINFO = (
    "processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nflags\t\t: fpu sse2 avx2\n\n"
    "processor\t: 1\nmodel name\t: Test CPU @ 2.0GHz\nflags\t\t: fpu sse2 avx2\n\n"
    "BogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\n"
)


def test_kernel_mode_reads_tetrarec_kernels_in_any_case(
    monkeypatch: pytest.MonkeyPatch, raises_exactly: Callable[[str], Any]
) -> None:
    """Fails if an unset ``TETRAREC_KERNELS`` is not ``auto``, if ``Reference`` or
    ``Batched`` (any case) is not a portable path (one compiled, or reported as the
    compiled kernel), or if a typo is not refused with the valid values."""
    monkeypatch.delenv("TETRAREC_KERNELS", raising=False)
    assert _build.kernel_mode() == "auto"
    for value, mode in (("Reference", "reference"), ("BATCHED", "batched")):
        monkeypatch.setenv("TETRAREC_KERNELS", value)
        assert _build.kernel_mode() == mode
        assert compiled_cpu_kernels() is None
        assert kernel_path() == "portable"
    monkeypatch.setenv("TETRAREC_KERNELS", "COMPILED")
    assert _build.kernel_mode() == "compiled"
    monkeypatch.setenv("TETRAREC_KERNELS", "fast")
    with raises_exactly("TETRAREC_KERNELS='fast'; valid: auto, reference, batched, compiled"):
        _build.kernel_mode()


@pytest.mark.parametrize(
    ("ci", "mode", "strict"),
    [
        (None, "auto", False),
        ("", "auto", False),
        ("false", "auto", False),
        ("0", "auto", False),
        ("true", "auto", True),
        (" TRUE ", "auto", True),
        ("1", "auto", True),
        ("Yes", "auto", True),
        (None, "compiled", True),
        (None, "reference", False),
    ],
)
def test_a_failed_build_is_an_error_in_ci_or_when_compiled_is_asked(
    monkeypatch: pytest.MonkeyPatch, ci: str | None, mode: str, strict: bool
) -> None:
    """Fails if CI (``CI`` set to true/1/yes, in any case and with spaces) or
    ``TETRAREC_KERNELS=compiled`` lets a broken kernel fall back to the portable path,
    or if a laptop (``CI`` unset, empty or false) is stopped by a missing compiler."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("TETRAREC_KERNELS", mode)
    assert _build.build_strict() is strict


def test_cpu_facts_are_the_model_and_flag_lines_of_proc_cpuinfo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Fails if the key misses the CPU's model or its feature flags (``flags`` on x86,
    ``Features`` on ARM): kernels built with ``-march=native`` on one CPU would be
    loaded on another from a shared cache. Without ``/proc/cpuinfo`` it falls back to
    ``platform.processor()``. (A recorded ``/proc/cpuinfo`` stands in for this one.)"""
    import builtins
    import platform

    recorded = tmp_path / "cpuinfo"
    recorded.write_text(_CPUINFO)
    where = {"/proc/cpuinfo": recorded}

    def recorded_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        return builtins.open(where.get(path, path), *args, **kwargs)

    monkeypatch.setattr(_build, "open", recorded_open, raising=False)
    assert _build._cpu_facts() == [
        "Features\t: fp asimd sve",
        "flags\t\t: fpu sse2 avx2",
        "model name\t: Test CPU @ 2.0GHz",
    ]
    where["/proc/cpuinfo"] = tmp_path / "absent"
    assert _build._cpu_facts() == [platform.processor()]


def test_build_key_is_16_hex_digits_and_an_explicit_default_compiler_keeps_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Fails if the key is not the 16 hex digits the cache directories are named by, if
    ``CXX=c++`` (the compiler torch runs when ``CXX`` is unset) keys another build of
    the same binary, or if a file other than a source (a README) changes the key."""
    monkeypatch.delenv("CXX", raising=False)
    key = build_key()
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    monkeypatch.setenv("CXX", "c++")
    assert build_key() == key
    checkout = _checkout(tmp_path / "checkout")
    (checkout / "README.md").write_text("notes\n")
    assert build_key(checkout) == key


def test_build_directory_is_under_the_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Fails if the build directory is not ``$XDG_CACHE_HOME/tetrarec/torch_extensions/
    <key>`` (``~/.cache`` when unset), is not created with its parents, or if asking
    for it again (every later run) fails because it exists."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh" / "cache"))
    path = _build._build_dir("0123456789abcdef")
    assert (
        path == tmp_path / "fresh" / "cache" / "tetrarec" / "torch_extensions" / "0123456789abcdef"
    )
    assert path.is_dir()
    assert _build._build_dir("0123456789abcdef") == path
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home_path = _build._build_dir("0123456789abcdef")
    assert (
        home_path
        == tmp_path / "home" / ".cache" / "tetrarec" / "torch_extensions" / "0123456789abcdef"
    )
    assert home_path.is_dir()


def test_sources_are_staged_in_the_build_directorys_src_past_other_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails if the sources are not staged in ``<build>/src`` (the paths every checkout's
    ninja file names) or if a file that is not a source (a README, which sorts before
    the sources) stops the staging of the sources after it."""
    checkout = _checkout(tmp_path / "checkout")
    (checkout / "README.md").write_text("notes\n")
    monkeypatch.setattr(_build, "_CSRC", checkout)
    src = _build._staged_sources(tmp_path)
    assert src == tmp_path / "src"
    assert sorted(p.name for p in src.iterdir()) == sorted(
        p.name for p in checkout.iterdir() if p.suffix in (".cpp", ".h")
    )


def _ninja_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[str, Path]:
    """The ninja file and build directory of a build that fails (no compiler)."""
    _failing_build(monkeypatch, tmp_path, ci="false")
    key = build_key()
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        _build._compile()
    build = tmp_path / "tetrarec" / "torch_extensions" / key
    return (build / "build.ninja").read_text(), build


def test_the_build_compiles_every_staged_source_with_the_keyed_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Fails if the command line that builds the kernels is not the one the key hashes:
    every source of ``_SOURCES`` compiled from the staged copy (``<build>/src``) with
    ``_CFLAGS`` (``-O3 -march=native -fopenmp -ffp-contract=off``: without the last,
    FMA contraction changes the bits) and linked with ``_LDFLAGS``, in the keyed
    directory, as a module named by the key (``tetrarec_cpu_<key>``); or if the build
    prints to stdout (``verbose``)."""
    ninja, build = _ninja_file(monkeypatch, tmp_path)
    key = build.name
    lines = dict(ln.split(" = ", 1) for ln in ninja.splitlines() if " = " in ln)
    assert f"-DTORCH_EXTENSION_NAME=tetrarec_cpu_{key} " in lines["cflags"]
    assert lines["cflags"].endswith(" " + " ".join(_build._CFLAGS))
    assert lines["ldflags"].split()[1 : 1 + len(_build._LDFLAGS)] == list(_build._LDFLAGS)
    for name in _build._SOURCES:
        assert f"build {name}.o: compile {build / 'src' / name}.cpp\n" in ninja
    assert f"build tetrarec_cpu_{key}.so: link " in ninja
    assert capfd.readouterr().out == ""


def test_a_failed_builds_error_and_warning_name_why_and_the_compilers_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails if a failed build's error does not say why it is an error (``CI`` or
    ``TETRAREC_KERNELS=compiled``) and give the build's own error (its type and message),
    or if the warning outside CI does not name that error and the fallback, once."""
    failed = "building tetrarec CPU kernels failed"
    build_error = "Error building extension 'tetrarec_cpu_"
    _failing_build(monkeypatch, tmp_path, ci="true")
    with pytest.raises(RuntimeError) as ci_error:
        compiled_cpu_kernels()
    assert str(ci_error.value).startswith(
        f"{failed} (CI is set, so this is an error, not a fallback to the portable path): "
        f"RuntimeError: {build_error}"
    )
    monkeypatch.delenv("CI")
    monkeypatch.setenv("TETRAREC_KERNELS", "compiled")
    with pytest.raises(RuntimeError) as compiled_error:
        compiled_cpu_kernels()
    assert str(compiled_error.value).startswith(
        f"{failed} (TETRAREC_KERNELS=compiled, so this is an error, not a fallback to the "
        f"portable path): RuntimeError: {build_error}"
    )
    _failing_build(monkeypatch, tmp_path / "laptop", ci=None)
    with caplog.at_level(logging.WARNING, logger="tetrarec.kernels._build"):
        assert compiled_cpu_kernels() is None
        assert compiled_cpu_kernels() is None
    [warning] = [r.getMessage() for r in caplog.records if r.name == _build.logger.name]
    assert warning.startswith(f"{failed} ({build_error}")
    assert "no-such-compiler" in warning
    assert warning.endswith("); using the portable PyTorch path, which is several times slower")


def test_compiled_mode_with_built_kernels_returns_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails if ``TETRAREC_KERNELS=compiled`` (or CI) raises although the kernels built."""
    monkeypatch.setenv("TETRAREC_KERNELS", "auto")
    module = compiled_cpu_kernels()
    if module is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    monkeypatch.setenv("TETRAREC_KERNELS", "compiled")
    monkeypatch.setenv("CI", "true")
    assert compiled_cpu_kernels() is module
    assert kernel_path() == "compiled"


def test_a_second_load_reuses_the_keyed_build_and_logs_its_time(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Fails if loading the kernels again (as a second process does, from the cache) does
    not give the build in ``<cache>/tetrarec/torch_extensions/<key>``, prints to stdout,
    or logs a wrong build time (``ready in <s> s``, measured from the start of this
    load)."""
    monkeypatch.setenv("TETRAREC_KERNELS", "auto")
    module = compiled_cpu_kernels()
    if module is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    key = build_key()
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="tetrarec.kernels._build"):
        again = _build._compile()
    assert Path(again.__file__) == _build._build_dir(key) / f"tetrarec_cpu_{key}.so"
    assert again.build_info() == module.build_info()
    assert capfd.readouterr().out == ""
    [message] = [r.getMessage() for r in caplog.records if r.name == _build.logger.name]
    seconds = re.fullmatch(r"tetrarec CPU kernels ready in (\d+\.\d) s", message)
    assert seconds is not None, message
    assert 0 <= float(seconds[1]) < 300
