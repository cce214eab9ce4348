"""Saving a run into a checkpoint and restoring it: ``tetrarec.train.state``, called directly.

The loop tests (``test_train_loop.py``, ``test_train_dense_transform.py``) resume whole
runs bitwise. These call the state functions on a tiny model for what a run rarely
hits: non-finite state, checkpoints that do not fit the run, a one-rank sharding
environment, sharded checkpoints opened in one process, and the saved dense transform.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tetrarec.config import RunConfig
from tetrarec.data import build_datasets
from tetrarec.sharding import ShardingEnv
from tetrarec.testing.checkpoint_crash import reseal
from tetrarec.train import build_parts, build_tables, read_checkpoint
from tetrarec.train.build import RunParts
from tetrarec.train.checkpoint import CheckpointData, list_checkpoints, write_checkpoint
from tetrarec.train.state import (
    NonFiniteStateError,
    load_dense_transform,
    load_model_state,
    load_run_state,
    restore_dense_transform,
    save_run_state,
)

TINY = [
    "data.source=synthetic",
    "data.synthetic.num_samples=64",
    "data.synthetic.eval_samples=32",
    "model.num_sparse=2",
    "model.num_embeddings=[10, 7]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.dense=adam",
]
# The tiny model's dense tensors, in the order of its state dict (and of the checkpoint).
DENSE = [
    "model.dense_arch.layers.0.weight",
    "model.dense_arch.layers.0.bias",
    "model.dense_arch.layers.1.weight",
    "model.dense_arch.layers.1.bias",
    "model.over_arch.layers.0.weight",
    "model.over_arch.layers.0.bias",
    "model.over_arch.layers.1.weight",
    "model.over_arch.layers.1.bias",
]


def config(*extra: str) -> RunConfig:
    return RunConfig().with_overrides([*TINY, *extra])


def parts_of(cfg: RunConfig) -> RunParts:
    return build_parts(cfg, num_dense=13)


def edit_meta(path: Path, **changes: object) -> None:
    """Change ``meta.json`` of checkpoint ``path`` (``None`` deletes a key), resealed
    (the manifest would refuse the edit before the reader under test saw it)."""
    meta_path = path / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    meta_path.write_text(json.dumps(meta))
    reseal(path)


# -- found by mutation testing (mutation/README.md) -----------------------------------------


def test_the_checkpoint_holds_the_step_position_and_extra_meta(tmp_path) -> None:
    """Bugs caught: the data position or the caller's extra meta values dropped, or the
    resumed step and position read from the wrong fields."""
    cfg = config()
    parts = parts_of(cfg)
    path = save_run_state(tmp_path, parts, step=4, config=cfg, keep=2, extra_meta={"note": 7})
    meta = read_checkpoint(path).meta
    assert (meta["data_position"], meta["note"], meta["config"]) == (4, 7, cfg.to_dict())
    assert load_run_state(path, parts_of(cfg)) == (4, 4)
    edit_meta(path, data_position=9)  # a run whose position is not its step
    assert load_run_state(path, parts_of(cfg)) == (4, 9)


def test_non_finite_state_is_refused_naming_five_tensors_and_keeps_the_old_ones(
    tmp_path,
) -> None:
    """A nan or inf weight is not checkpointed: the error names the step and the first
    five bad tensors, then " ..." when there are more; the earlier checkpoints stay.
    Bugs caught: a non-finite checkpoint written (or the good ones pruned first), finite
    tensors reported, another count of names or a wrong "..." (6 bad: "...", 5: none)."""
    cfg = config()
    parts = parts_of(cfg)
    first = save_run_state(tmp_path, parts, step=1, config=cfg, keep=1)
    saved = read_checkpoint(first).tensors
    params = dict(parts.model.named_parameters())
    with torch.no_grad():
        for i, name in enumerate(DENSE[:6]):
            params[name.removeprefix("model.")].view(-1)[0] = float("nan") if i % 2 else math.inf
    with pytest.raises(NonFiniteStateError) as info:
        save_run_state(tmp_path, parts, step=2, config=cfg, keep=1)
    assert str(info.value) == f"not checkpointing step 2: non-finite values in {DENSE[:5]} ..."
    with torch.no_grad():
        params[DENSE[5].removeprefix("model.")].zero_()
    with pytest.raises(NonFiniteStateError) as info:
        save_run_state(tmp_path, parts, step=3, config=cfg, keep=1)
    assert str(info.value) == f"not checkpointing step 3: non-finite values in {DENSE[:5]}"
    assert list_checkpoints(tmp_path) == [first]
    after = read_checkpoint(first).tensors
    assert all(torch.equal(after[k], v) for k, v in saved.items())


def test_a_one_rank_env_checkpoints_and_resumes_as_one_process(tmp_path) -> None:
    """A run given a sharding env of one rank (``ShardingEnv.single()``) is not sharded.
    Bugs caught: one rank taken for a sharded run (``world_size >= 1``), which writes
    the per-rank layout without a plan, or refuses to resume its own checkpoint."""
    cfg = config()
    parts = dataclasses.replace(parts_of(cfg), env=ShardingEnv.single())
    path = save_run_state(tmp_path, parts, step=2, config=cfg, keep=1)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["manifest.json", "meta.json", "tensors.safetensors"]
    assert "sharding" not in read_checkpoint(path).meta
    again = dataclasses.replace(parts_of(cfg), env=ShardingEnv.single())
    assert load_run_state(path, again) == (2, 2)


def test_a_sharded_checkpoint_in_one_process_is_a_clear_error(raises_exactly, tmp_path) -> None:
    """Bugs caught: a sharded checkpoint's dense file loaded as if it held the tables
    (which live in the ranks' files), or a message without the world size (or calling
    a one-rank env "1 ranks")."""
    cfg = config()
    path = save_run_state(tmp_path, parts_of(cfg), step=2, config=cfg, keep=1)
    edit_meta(path, sharding={"world_size": 2, "fingerprint": "0123abcd"})
    with raises_exactly(
        f"{path} holds tables sharded over 2 ranks; tetrarec eval cannot load a sharded "
        "checkpoint yet (in one process or under torchrun): its evaluations are the "
        "sharded run's own (train.eval_every; the summary's best and final metrics)"
    ):
        load_model_state(path, parts_of(cfg).model)
    refused = (
        f"{path} was written by 2 ranks, this run has one process: resuming on another "
        "world size or plan is not supported yet (resharding a checkpoint is a later feature)"
    )
    with raises_exactly(refused):
        load_run_state(path, parts_of(cfg))
    with raises_exactly(refused):  # a one-rank env is one process too, not "1 ranks"
        load_run_state(path, dataclasses.replace(parts_of(cfg), env=ShardingEnv.single()))


def _rewritten(path: Path, root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    data = read_checkpoint(path)
    return write_checkpoint(root, CheckpointData(step=data.step, tensors=tensors, meta=data.meta))


def test_a_checkpoint_that_does_not_fit_names_five_missing_and_the_unexpected(
    raises_exactly, tmp_path
) -> None:
    """Bugs caught: missing dense tensors or unexpected ones loaded without a word
    (either alone must fail), the embeddings' keys reported as missing from the dense
    part, or another number of names than five (of eight missing, of six unexpected)."""
    cfg = config()
    path = save_run_state(tmp_path / "a", parts_of(cfg), step=2, config=cfg, keep=1)
    tensors = read_checkpoint(path).tensors
    fewer = _rewritten(path, tmp_path / "b", {k: v for k, v in tensors.items() if k not in DENSE})
    missing = [k.removeprefix("model.") for k in DENSE[:5]]
    with raises_exactly(
        f"{fewer}: checkpoint does not fit the model: missing {missing}, unexpected []"
    ):
        load_model_state(fewer, parts_of(cfg).model)
    extra = {f"model.extra{i}.weight": torch.ones(2) for i in range(6)}
    more = _rewritten(path, tmp_path / "c", {**tensors, **extra})
    unexpected = [f"extra{i}.weight" for i in range(5)]
    with raises_exactly(
        f"{more}: checkpoint does not fit the model: missing [], unexpected {unexpected}"
    ):
        load_run_state(more, parts_of(cfg))


def test_tables_optimizer_state_of_another_kind_is_a_clear_error(tmp_path) -> None:
    """Bug caught: the fused optimizer's own error (or a KeyError) reaching the user
    without the checkpoint's path and what to check."""
    saved = config("model.embedding=fused", "optim.sparse.kind=adam")
    path = save_run_state(tmp_path, parts_of(saved), step=2, config=saved, keep=1)
    other = parts_of(config("model.embedding=fused", "optim.sparse.kind=rowwise_adagrad"))
    start = (
        f"{path}: the tables' optimizer state does not fit this run (was it written with "
        "another embedding module or optimizer?): "
    )
    with pytest.raises(ValueError, match=f"^{re.escape(start)}"):
        load_run_state(path, other)


def test_saved_dense_transform_is_loaded_restored_and_a_change_is_logged(tmp_path, caplog) -> None:
    """Bugs caught: the saved statistics not returned or not applied to both datasets,
    a checkpoint without statistics changing the datasets, no warning when the data
    now gives other statistics (or one when it does not), and a malformed saved
    transform reported without the checkpoint's path."""
    cfg = config("data.dense_transform=standardize")
    train, held_out = build_datasets(cfg.data, build_tables(cfg.model))
    parts = parts_of(cfg)
    path = save_run_state(tmp_path / "a", parts, step=1, config=cfg, keep=1, dense=train.transform)
    plain_cfg = config()
    plain, plain_held_out = build_datasets(plain_cfg.data, build_tables(plain_cfg.model))
    assert plain.transform != train.transform
    assert load_dense_transform(path) == train.transform

    caplog.set_level(logging.WARNING, logger="tetrarec.train.state")
    got = restore_dense_transform(path, plain, plain_held_out)
    assert [d.transform for d in got] == [train.transform, train.transform]
    assert [d.base for d in got] == [plain.base, plain_held_out.base]
    # The config changed (bug caught: this was reported as the data having changed).
    assert len(caplog.records) == 1
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(
            f"data.dense_transform or data.dense_clip differs from the run's in {path} (dense0 "
            "standardize, "
        )
    )
    caplog.clear()
    now = train.transform
    moved = train.with_transform(dataclasses.replace(now, mean=tuple(m + 1 for m in now.mean)))
    got = restore_dense_transform(path, moved, held_out)
    assert [d.transform for d in got] == [train.transform, train.transform]
    assert [r.getMessage() for r in caplog.records] == [
        f"the training data now gives other dense statistics than when {path} was written; "
        "resuming with the saved ones"
    ]
    caplog.clear()
    same = restore_dense_transform(path, train, held_out)
    assert [d.transform for d in same] == [train.transform, train.transform]
    assert caplog.records == []

    without = save_run_state(tmp_path / "b", parts, step=1, config=cfg, keep=1)
    assert load_dense_transform(without) is None
    assert restore_dense_transform(without, plain, plain_held_out) == (plain, plain_held_out)

    edit_meta(path, dense_transform={"version": 1})
    with pytest.raises(
        ValueError, match=f"^{re.escape(str(path))}: malformed saved dense transform"
    ):
        load_dense_transform(path)


# -- found by tests/fuzz/test_fuzz_checkpoint.py -------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("dense_optim", {"param_groups": []}),  # KeyError: 'scalars'
        ("sparse_optim", []),  # AttributeError: 'list' object has no attribute 'get'
        ("rng", {"numpy": [1, 2, 3], "python": [3, None]}),  # unpacking: a ValueError, no file
        ("data_position", None),  # deleted: KeyError
    ],
)
def test_damaged_meta_is_one_value_error_naming_the_file(tmp_path, key, value) -> None:
    """A meta.json whose optimizer, RNG or data-position part is missing or of another
    shape raised KeyError / AttributeError / TypeError (or a ValueError that named no
    file) from deep inside the restore; now one ValueError naming meta.json."""
    cfg = config()
    path = save_run_state(tmp_path, parts_of(cfg), step=2, config=cfg, keep=1)
    edit_meta(path, **{key: value})
    with pytest.raises(ValueError, match=re.escape(f"{path / 'meta.json'}: damaged checkpoint")):
        load_run_state(path, parts_of(cfg))


def test_tensors_the_model_lacks_are_named_on_one_line(tmp_path) -> None:
    """torch's load_state_dict message spans lines ("Error(s) in loading state_dict
    for ...:\\n\\tUnexpected key(s) ..."); the ValueError quoting it was printed so."""
    cfg = config()
    path = save_run_state(tmp_path, parts_of(cfg), step=2, config=cfg, keep=1)
    tensors = load_file(str(path / "tensors.safetensors"))
    tensors["embedding.sounding"] = torch.zeros(1)
    save_file(tensors, str(path / "tensors.safetensors"))
    reseal(path)
    with pytest.raises(ValueError, match="does not fit the model") as info:
        load_run_state(path, parts_of(cfg))
    assert "\n" not in str(info.value)
    assert "sounding" in str(info.value)
