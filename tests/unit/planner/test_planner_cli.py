"""``tetrarec plan``: prints the report, writes a plan ``tetrarec train`` can read."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tetrarec.cli import main
from tetrarec.config import RunConfig
from tetrarec.config.tables import model_tables
from tetrarec.sharding.plan import ShardingPlan

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "criteo_kaggle_sample.toml"


def test_plan_prints_and_writes_a_plan_that_loads_and_validates(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Catches a CLI whose JSON is not a valid ``sharding.plan`` for the run's tables."""
    stats = tmp_path / "stats.json"
    stats.write_text(
        json.dumps(
            {
                "rows_sampled": 10,
                "batch_size": 4,
                "features": {
                    "C1": {
                        "table": "C1",
                        "num_embeddings": 10,
                        "mean_pooling": 4.0,
                        "hot_1pct": 0.5,
                        "hot_5pct": 0.7,
                        "distinct_rows": 5,
                    }
                },
            }
        )
    )
    out = tmp_path / "plan.json"
    code = main(
        [
            "-q",
            "plan",
            "--config",
            str(EXAMPLE),
            "--world-size",
            "4",
            "--stats",
            str(stats),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "imbalance" in printed
    assert "lookup ms" in printed
    assert "C1" in printed
    plan = ShardingPlan.load(out)
    assert (plan.world_size, plan.local_world_size) == (4, 4)  # torchrun on this machine
    plan.validate(model_tables(RunConfig.from_toml(EXAMPLE).model))
    side = json.loads(Path(f"{out}.report.json").read_text())
    assert [t["table"] for t in side["tables"]] == [t.table for t in plan.tables]


def test_plan_errors_are_one_line(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Catches a bad topology or a missing matplotlib surfacing as a traceback."""
    code = main(["-q", "plan", "--config", str(EXAMPLE), "--world-size", "2", "--topology", "nope"])
    assert code == 2
    assert "presets" in capsys.readouterr().err
    for bad in ("0", "-1"):  # once "world size 0 is not a multiple of 0 ranks per node"
        with pytest.raises(SystemExit) as e:
            main(["-q", "plan", "--config", str(EXAMPLE), "--world-size", bad])
        assert e.value.code == 2
        assert f"--world-size: must be at least 1, got {bad}" in capsys.readouterr().err
    if importlib.util.find_spec("matplotlib") is None:
        code = main(
            [
                "-q",
                "plan",
                "--config",
                str(EXAMPLE),
                "--world-size",
                "2",
                "--plot",
                str(tmp_path / "p.png"),
            ]
        )
        assert code == 2
        assert "matplotlib" in capsys.readouterr().err
    else:
        pytest.skip("matplotlib is installed")


def test_a_stats_file_missing_the_runs_features_is_said(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A stats file written for another config (none of its features in this run) was
    used silently: every table got the defaults, and the plan no skew at all."""
    import logging

    from tetrarec.config import RunConfig
    from tetrarec.planner import Topology, inputs_from_config

    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"rows_sampled": 1, "batch_size": 1, "features": {}}))
    caplog.set_level(logging.WARNING, logger="tetrarec.planner.inputs")
    config = RunConfig.from_toml(str(EXAMPLE))
    inputs_from_config(config, Topology.resolve("this-machine"), stats)
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("the stats file has no statistics for 26 of the run's 26")
    assert message.endswith("was it written for another config?")
