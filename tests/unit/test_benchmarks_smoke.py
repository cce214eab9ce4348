"""Every benchmark script runs end to end at tiny size (``--smoke``), so none rots.

Timings are never asserted; the JSON layout is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))
# Runs on the real Criteo sample in ../shared/data; its smoke run (through the CLI) lives
# in tests/integration/test_integration_train.py, which skips when the data is absent.
NEEDS_SHARED_DATA = {"bench_criteo_real.py"}


def test_every_benchmark_is_listed_in_readme() -> None:
    readme = (BENCH / "README.md").read_text()
    missing = [s for s in SCRIPTS if s not in readme]
    assert not missing, f"benchmarks/README.md does not list {missing}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - NEEDS_SHARED_DATA))
def test_benchmark_smoke(script: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(out.read_text())
    assert payload["results"], payload
    for row in payload["results"]:
        assert "impl" in row
