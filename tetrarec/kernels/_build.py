"""Lazy just-in-time build of the compiled CPU kernels (``csrc/*.cpp``).

Nothing here runs at ``import tetrarec``: the extension is compiled (or loaded from the
cache) on the first call that needs it. ``torch.utils.cpp_extension.load`` holds a file
lock in the build directory, so two processes compiling at once wait for each other.

If compilation fails (no compiler, no ninja), one warning is logged and the portable
PyTorch path in ``reference.py`` runs instead. ``TETRAREC_KERNELS=reference`` forces the
portable path; ``TETRAREC_KERNELS=compiled`` makes a failed build an error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

__all__ = ["compiled_cpu_kernels", "kernel_mode"]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_LOCK = threading.Lock()
_STATE: dict[str, ModuleType | None] = {}
_MODES = ("auto", "reference", "compiled")


def kernel_mode() -> str:
    """The value of ``TETRAREC_KERNELS`` (``auto`` when unset).

    Raises:
        ValueError: for a value other than auto, reference or compiled.
    """
    mode = os.environ.get("TETRAREC_KERNELS", "auto").lower()
    if mode not in _MODES:
        raise ValueError(f"TETRAREC_KERNELS={mode!r}; valid: {', '.join(_MODES)}")
    return mode


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags.

    The kernels are built with ``-march=native``: a build cached on one CPU may use
    instructions another lacks, so each CPU kind gets its own build directory.
    """
    import hashlib
    import platform

    import torch

    facts = [platform.machine(), torch.__version__]
    try:
        with open("/proc/cpuinfo") as f:
            facts += sorted(
                {ln.strip() for ln in f if ln.startswith(("model name", "flags", "Features"))}
            )
    except OSError:
        facts.append(platform.processor())
    return hashlib.sha1("\n".join(facts).encode()).hexdigest()[:12]


def _build_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = root / "tetrarec" / "torch_extensions" / _cpu_tag()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compile() -> ModuleType:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    module = cpp_extension.load(
        name="tetrarec_tbe_cpu",
        sources=[str(_CSRC / f"{name}.cpp") for name in ("tbe_cpu", "interaction_cpu", "bf16_cpu")],
        extra_include_paths=[str(_CSRC)],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(_build_dir()),
        verbose=False,
    )
    logger.info("tetrarec CPU kernels ready in %.1f s", time.perf_counter() - start)
    assert isinstance(module, ModuleType)  # is_python_module=True (the default): a module
    return module


def compiled_cpu_kernels() -> ModuleType | None:
    """The compiled CPU kernel module, or ``None`` when the portable path must run.

    Builds at most once per process; a failure is logged once and remembered.

    Raises:
        RuntimeError: if ``TETRAREC_KERNELS=compiled`` and the build fails.
    """
    mode = kernel_mode()
    if mode == "reference":
        return None
    with _LOCK:
        if "cpu" not in _STATE:
            try:
                _STATE["cpu"] = _compile()
            except Exception as exc:
                if mode == "compiled":
                    raise RuntimeError(f"building tetrarec CPU kernels failed: {exc}") from exc
                logger.warning(
                    "building tetrarec CPU kernels failed (%s); using the portable PyTorch "
                    "path, which is several times slower",
                    exc,
                )
                _STATE["cpu"] = None
        return _STATE["cpu"]
