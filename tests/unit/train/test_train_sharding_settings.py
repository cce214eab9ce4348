"""A [sharding] setting that cannot work is refused in one process too, before training.

One process trains unsharded, so these settings used to be ignored there and found broken
only under torchrun (issue 31 item 6).
"""

from __future__ import annotations

import json

import pytest

from tetrarec.config import RunConfig
from tetrarec.train import train

TINY = [
    "data.synthetic.num_samples=512",
    "data.synthetic.eval_samples=256",
    "data.batch_size=64",
    "train.steps=2",
    "train.progress=false",
    "train.log_every=0",
]


def _config(tmp_path, *extra: str) -> RunConfig:
    return RunConfig.from_toml("examples/sharded_mixed.toml").with_overrides(
        [*TINY, f"train.checkpoint_dir={tmp_path / 'ckpt'}", *extra]
    )


def test_a_missing_plan_file_is_refused_naming_the_key(tmp_path) -> None:
    """Bug caught: a one-process run with a plan file that does not exist trained on."""
    missing = tmp_path / "nope.json"
    cfg = _config(tmp_path, "sharding.type=none", f"sharding.plan={missing}")
    with pytest.raises(ValueError, match=r"^sharding\.plan: no such file: .*nope\.json$"):
        train(cfg)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_plan_file_that_is_not_a_plan_is_refused(tmp_path) -> None:
    """Bug caught: a damaged plan file was read only by torchrun's ranks."""
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"tables": "not a list"}))
    cfg = _config(tmp_path, "sharding.type=none", f"sharding.plan={bad}")
    with pytest.raises(ValueError, match=r"^sharding\.plan: "):
        train(cfg)


def test_a_column_block_that_divides_no_dim_is_refused_naming_the_key(tmp_path) -> None:
    """Bug caught: sharding.column_block = 5 with column-wise dim-16 tables trained on in
    one process (torchrun refused it in every rank)."""
    cfg = _config(tmp_path, "sharding.type=column_wise", "sharding.column_block=5")
    with pytest.raises(ValueError, match=r"^sharding\.column_block = 5 does not divide"):
        train(cfg)


def test_a_column_block_that_divides_every_split_table_trains(tmp_path) -> None:
    """The check must not refuse a block that works (4 divides every dim-16 table; the
    first-order tables are placed whole, not split)."""
    cfg = _config(
        tmp_path, "sharding.type=column_wise", "sharding.column_block=4",
        "model.dlrm.first_order=true",
    )  # fmt: skip
    assert train(cfg).steps == 2
