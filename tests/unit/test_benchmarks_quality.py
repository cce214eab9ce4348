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


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_the_runs_checkpoints_are_removed_when_it_stops(monkeypatch, tmp_path, stop) -> None:
    """The recipes' runs checkpoint into a scratch directory, removed however the
    benchmark ends (here Ctrl-C or an error in a run; a complete run leaves it the same
    way). Bug caught: ``tempfile.mkdtemp`` without cleanup left every run's
    checkpoints in ``/tmp/tetrarec-quality-*`` (62 MB for one smoke recipe)."""
    bench = _bench_quality()
    data = tmp_path / "sample.csv"
    data.write_text("")
    monkeypatch.setattr(bench, "RECIPES", (bench.Recipe("r", str(data), "a.toml", "b.toml"),))
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))  # where leftovers go
    used: list[Path] = []

    def run_recipe(path: str, smoke: bool, checkpoints: Path, seed_offset: int = 0) -> Any:
        used.append(checkpoints)
        (checkpoints / "step_00000001").mkdir()
        raise stop

    monkeypatch.setattr(bench, "run_recipe", run_recipe)
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", "--smoke"])
    with pytest.raises(stop):
        bench.main()
    assert len(used) == 1
    assert used[0].parent == tmp_path
    assert used[0].name.startswith("tetrarec-quality-")
    assert not used[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample.csv"]
