"""``bench quality``'s command line and its scratch space, without training a recipe.

Its smoke run on the real samples is ``tests/integration/test_integration_train.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench_quality() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return __import__("bench_quality")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("seeds", ["0", "-2"])
def test_seeds_under_one_is_a_usage_error(monkeypatch, capsys, seeds) -> None:
    """Bug caught: ``--seeds 0`` (or negative) trained nothing and then failed with an
    ``IndexError`` traceback reading the first seed's run."""
    bench = _bench_quality()
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", "--seeds", seeds])
    with pytest.raises(SystemExit) as e:
        bench.parse_args()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: --seeds {seeds}: give 1 or more (1: the recipe's own seed only)")
