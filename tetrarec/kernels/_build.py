"""Lazy just-in-time build of the compiled CPU kernels (``csrc/*.cpp``).

Nothing here runs at ``import tetrarec``: the extension is compiled (or loaded from the
cache) on the first call that needs it. ``torch.utils.cpp_extension.load`` holds a file
lock in the build directory, so two processes compiling at once wait for each other.

The build directory is keyed by everything that changes the binary: the bytes of every
file in ``csrc/``, the compile and link flags, the compiler (``CXX``), the torch version
and installation (the include and library paths that torch puts on the command line, and
Python's headers), and this CPU's model and feature flags (the kernels are built with
``-march=native``). Two checkouts with different sources, or with their own virtual
environments, on one machine therefore keep two builds instead of rebuilding each
other's on every run (ninja rebuilds everything when the command line changes).
Checkouts with the same sources share one build: the sources are compiled from a copy
staged in the build directory (``<build>/src``), so the paths ninja records are the same
from every checkout (compiled from the checkouts' own paths, each checkout's first run
would rebuild the other's).

If compilation fails (no compiler, no ninja, a compile error), one warning is logged and
the portable PyTorch path in ``reference.py`` (the per-table loop) runs instead, unless a
failed build must be an error: with ``TETRAREC_KERNELS=compiled``, or in CI (``CI`` set
to ``true``/``1``, as CI services and ``.ci/run`` set it), where a broken kernel must
fail the run rather than turn the compiled-path tests into skips.

``TETRAREC_KERNELS`` (any case):

- ``auto`` (unset): the compiled kernels, else the per-table loop after a failed build;
- ``compiled``: the compiled kernels, a failed build is an error;
- ``reference``: the per-table loop (``reference.py``), nothing is compiled;
- ``batched``: the batched portable path (``reference_batched.py``), nothing is compiled:
  what a GPU runs, so CPU tests can exercise it (2-2.5x slower than the loop on a CPU).

Other devices always run the batched path; the mode chooses the CPU's kernel only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

__all__ = ["build_key", "build_strict", "compiled_cpu_kernels", "kernel_mode", "kernel_path"]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("tbe_cpu", "interaction_cpu", "bf16_cpu", "copy_cpu")
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)
_LOCK = threading.Lock()
_STATE: dict[str, ModuleType | None] = {}
_ERRORS: dict[str, str] = {}  # why a build failed, for the errors of later calls
_MODES = ("auto", "reference", "batched", "compiled")
_PORTABLE_MODES = ("reference", "batched")  # nothing is compiled


def kernel_mode() -> str:
    """The value of ``TETRAREC_KERNELS`` (``auto`` when unset).

    Raises:
        ValueError: for a value other than auto, reference, batched or compiled.
    """
    mode = os.environ.get("TETRAREC_KERNELS", "auto").lower()
    if mode not in _MODES:
        raise ValueError(f"TETRAREC_KERNELS={mode!r}; valid: {', '.join(_MODES)}")
    return mode


def build_strict() -> bool:
    """Whether a failed build is an error: ``TETRAREC_KERNELS=compiled``, or in CI.

    CI is detected by the ``CI`` environment variable (``true``/``1``/``yes``), which
    GitHub Actions, GitLab CI and ``.ci/run`` set.
    """
    in_ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
    return kernel_mode() == "compiled" or in_ci


def _cpu_facts() -> list[str]:
    """This CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return sorted(
                {ln.strip() for ln in f if ln.startswith(("model name", "flags", "Features"))}
            )
    except OSError:
        return [platform.processor()]


def build_key(csrc: Path = _CSRC) -> str:
    """A short hash of everything the compiled binary depends on (see the module doc).

    Args:
        csrc: the source directory (default: this checkout's).

    Returns:
        16 hex digits: the name of this build's cache directory.
    """
    import torch

    h = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    facts = [
        " ".join(_CFLAGS),
        " ".join(_LDFLAGS),
        os.environ.get("CXX", "c++"),
        torch.__version__,
        # The command line names torch's headers and libraries and Python's headers by
        # path: a checkout with its own venv would rebuild another's build on each run.
        str(Path(torch.__file__).resolve().parent),
        sysconfig.get_paths()["include"],
        platform.machine(),
        *_cpu_facts(),
    ]
    h.update("\n".join(facts).encode())
    return h.hexdigest()[:16]


def _build_dir(key: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = root / "tetrarec" / "torch_extensions" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def _staged_sources(build_dir: Path) -> Path:
    """``csrc``'s sources copied into ``build_dir/src`` (only files whose bytes differ).

    A file is rewritten only when its bytes changed (never for an identical copy, whose
    new mtime would make ninja rebuild), through a temporary name and a rename, so a
    reader never sees half a file.
    """
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for path in sorted(_CSRC.iterdir()):
        if path.suffix not in (".cpp", ".h"):
            continue
        data = path.read_bytes()
        staged = src / path.name
        if staged.is_file() and staged.read_bytes() == data:
            continue
        tmp = src / f".{path.name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, staged)
    return src


def _compile() -> ModuleType:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    key = build_key()
    build_dir = _build_dir(key)
    src = _staged_sources(build_dir)
    module = cpp_extension.load(
        # One module name per build: torch numbers the builds of a name within a process
        # and would rebuild another build directory's under a new number.
        name=f"tetrarec_cpu_{key}",
        sources=[str(src / f"{name}.cpp") for name in _SOURCES],
        extra_include_paths=[str(src)],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    logger.info("tetrarec CPU kernels ready in %.1f s", time.perf_counter() - start)
    assert isinstance(module, ModuleType)  # is_python_module=True (the default): a module
    return module


def compiled_cpu_kernels() -> ModuleType | None:
    """The compiled CPU kernel module, or ``None`` when the portable path must run.

    Builds at most once per process; a failure is remembered (and, where it is not an
    error, logged once).

    Raises:
        RuntimeError: if the build failed where that must be an error
            (``TETRAREC_KERNELS=compiled``, or in CI: see ``build_strict``); every call
            raises it again, naming the build's error.
    """
    mode = kernel_mode()
    if mode in _PORTABLE_MODES:
        return None
    with _LOCK:
        if "cpu" not in _STATE:
            try:
                _STATE["cpu"] = _compile()
            except Exception as exc:
                _STATE["cpu"] = None
                _ERRORS["cpu"] = f"{type(exc).__name__}: {exc}"
                if not build_strict():
                    logger.warning(
                        "building tetrarec CPU kernels failed (%s); using the portable "
                        "PyTorch path, which is several times slower",
                        exc,
                    )
        module = _STATE["cpu"]
    if module is None and build_strict():
        why = "TETRAREC_KERNELS=compiled" if mode == "compiled" else "CI is set"
        raise RuntimeError(
            f"building tetrarec CPU kernels failed ({why}, so this is an error, not a "
            f"fallback to the portable path): {_ERRORS.get('cpu', 'unknown error')}"
        )
    return module


def kernel_path() -> str:
    """Which table-batched kernel this process has run: for benchmark reports.

    Returns:
        ``"compiled"`` when the compiled CPU kernels are loaded in this process,
        ``"portable"`` when a portable PyTorch path runs instead (forced by
        ``TETRAREC_KERNELS=reference`` or ``batched``, or after a failed build),
        ``"none"`` when no CPU kernel has been asked for yet.
    """
    if kernel_mode() in _PORTABLE_MODES:
        return "portable"
    if "cpu" not in _STATE:
        return "none"
    return "compiled" if _STATE["cpu"] is not None else "portable"
