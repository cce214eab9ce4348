"""Fixtures shared by the kernel tests: which implementation path runs."""

import pytest

from tetrarec.kernels._build import compiled_cpu_kernels


@pytest.fixture(params=["compiled", "reference"])
def kernel_path(request, monkeypatch, portable_mode):
    """Run the test once on the compiled CPU kernel and once on the portable path (the
    per-table loop; the batched path in a run under ``TETRAREC_KERNELS=batched``)."""
    if request.param == "compiled":
        monkeypatch.setenv("TETRAREC_KERNELS", "auto")
        if compiled_cpu_kernels() is None:
            pytest.skip("the compiled CPU kernel did not build on this machine")
    else:
        monkeypatch.setenv("TETRAREC_KERNELS", portable_mode)
    return request.param


def pytest_collection_modifyitems(items):
    """The first compiled-path test may build the extension (about a minute, once)."""
    for item in items:
        if "compiled" in item.name or "compiled" in item.nodeid:
            item.add_marker(pytest.mark.timeout(600))
