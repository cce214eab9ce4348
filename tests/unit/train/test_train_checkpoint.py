import json
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from tetrarec.config import RunConfig
from tetrarec.testing.checkpoint_crash import reseal
from tetrarec.train import build_parts
from tetrarec.train.checkpoint import (
    BEST_LINK,
    CHECKPOINT_FORMAT,
    CheckpointData,
    best_checkpoint,
    capture_rng_state,
    flatten_optimizer_state,
    latest_checkpoint,
    list_checkpoints,
    mark_best,
    prune_checkpoints,
    read_checkpoint,
    read_meta,
    restore_rng_state,
    unflatten_optimizer_state,
    write_checkpoint,
)
from tetrarec.train.checkpoint_tables import CheckpointTables
from tetrarec.train.optim import RowWiseAdagrad
from tetrarec.train.state import save_run_state


def _data(step: int) -> CheckpointData:
    return CheckpointData(
        step=step, tensors={"w": torch.full((2, 3), float(step))}, meta={"k": [1, 2]}
    )


def test_write_read_round_trip_and_no_pickle(tmp_path) -> None:
    path = write_checkpoint(tmp_path, _data(5))
    assert path.name == "step_00000005"
    names = sorted(p.name for p in path.iterdir())
    assert names == ["manifest.json", "meta.json", "tensors.safetensors"]
    back = read_checkpoint(path)
    assert back.step == 5
    assert torch.equal(back.tensors["w"], torch.full((2, 3), 5.0))
    assert back.meta["k"] == [1, 2]
    assert json.loads((path / "meta.json").read_text())["format"] == CHECKPOINT_FORMAT


def test_crash_before_rename_leaves_no_complete_looking_checkpoint(tmp_path, monkeypatch) -> None:
    write_checkpoint(tmp_path, _data(1))

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_checkpoint(tmp_path, _data(2))
    monkeypatch.undo()
    # the half-done write is a temporary directory that nothing picks up
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert any(p.name.startswith(".tmp-step_00000002") for p in tmp_path.iterdir())
    # the next save removes the leftover
    write_checkpoint(tmp_path, _data(3))
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    assert latest_checkpoint(tmp_path).name == "step_00000003"


def test_a_full_disk_is_an_os_error_naming_the_file_and_leaves_nothing(
    tmp_path, monkeypatch
) -> None:
    """Bug caught: safetensors reports a full disk as its own SafetensorError, which the
    command printed as a traceback (it reports OSError as one line, exit 1), and the
    partial temporary directory stayed until the next checkpoint."""
    from safetensors import SafetensorError

    import tetrarec.train.checkpoint as ck

    def full(tensors, path):
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(OSError, match=r"cannot write checkpoint file .*No space left on device"):
        write_checkpoint(tmp_path, _data(1))
    assert list(tmp_path.iterdir()) == []


def test_incomplete_directory_is_not_a_checkpoint(tmp_path) -> None:
    (tmp_path / "step_00000009").mkdir()
    (tmp_path / "step_00000009" / "tensors.safetensors").write_bytes(b"")
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        read_checkpoint(tmp_path / "step_00000009")


def test_rewrite_same_step_replaces_and_prune_keeps_newest(tmp_path) -> None:
    for s in (1, 2, 3, 3, 4):
        write_checkpoint(tmp_path, _data(s))
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step_00000001", "step_00000002"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path / "missing") is None


def test_best_link_protects_its_checkpoint_from_pruning(tmp_path) -> None:
    """Bugs caught: pruning the best checkpoint once it is no longer among the newest,
    keeping an old best after the link moved on, the link taken for the newest
    checkpoint by resume, and an absolute link that breaks when the directory moves."""
    for s in (1, 2, 3):
        write_checkpoint(tmp_path, _data(s))
    link = mark_best(tmp_path / "step_00000002")
    assert link == tmp_path / BEST_LINK
    assert os.readlink(link) == "step_00000002"  # relative
    for s in (4, 5):
        write_checkpoint(tmp_path, _data(s))
    prune_checkpoints(tmp_path, keep=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000002", "step_00000004", "step_00000005"]
    assert latest_checkpoint(tmp_path).name == "step_00000005"
    assert best_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert read_checkpoint(link).step == 2  # readers take <root>/best as a checkpoint
    assert read_meta(link)["step"] == 2
    moved = tmp_path.parent / "moved"
    tmp_path.rename(moved)
    assert read_checkpoint(moved / BEST_LINK).step == 2
    # a new best replaces the link; the old best is then pruned like any other
    mark_best(moved / "step_00000005")
    prune_checkpoints(moved, keep=2)
    assert [p.name for p in list_checkpoints(moved)] == ["step_00000004", "step_00000005"]
    assert best_checkpoint(moved) == moved / "step_00000005"
    assert sorted(p.name for p in moved.iterdir() if p.name.startswith(".tmp")) == []


def test_best_link_to_a_missing_checkpoint_is_no_best(tmp_path) -> None:
    write_checkpoint(tmp_path, _data(1))
    mark_best(tmp_path / "step_00000001")
    shutil.rmtree(tmp_path / "step_00000001")
    assert best_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path, _data(2))
    assert prune_checkpoints(tmp_path, keep=1) == []
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        mark_best(tmp_path / "step_00000009")


def _trained(opt_factory, sparse: bool) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(6, 3, sparse=sparse)
    opt = opt_factory([bag.weight])
    for ids in ([1, 2, 2], [0, 5, 1]):
        opt.zero_grad()
        bag(torch.tensor(ids), torch.tensor([0])).pow(2).sum().backward()
        opt.step()
    return bag.weight, opt


@pytest.mark.parametrize(
    ("factory", "sparse"),
    [
        (lambda ps: torch.optim.Adam(ps, lr=0.1, betas=(0.8, 0.9)), False),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), True),
        (lambda ps: torch.optim.SparseAdam(ps, lr=0.1), True),
        (lambda ps: RowWiseAdagrad(ps, lr=0.1), True),
    ],
)
def test_optimizer_state_flatten_round_trip_through_files(tmp_path, factory, sparse) -> None:
    w, opt = _trained(factory, sparse)
    tensors, extra = flatten_optimizer_state(opt.state_dict(), "opt")
    path = write_checkpoint(tmp_path, CheckpointData(step=1, tensors=tensors, meta={"opt": extra}))
    data = read_checkpoint(path)
    fresh_w = nn.Parameter(w.detach().clone())
    fresh = factory([fresh_w])
    fresh.load_state_dict(unflatten_optimizer_state(data.tensors, data.meta["opt"], "opt"))
    want, got = opt.state_dict(), fresh.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for idx, entry in want["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got["state"][idx][name], value), name
            else:
                assert got["state"][idx][name] == value, name


def test_rng_states_round_trip(tmp_path) -> None:
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    torch.randn(3), np.random.rand(), random.random(), np.random.randn()
    tensors, extra = capture_rng_state()
    path = write_checkpoint(tmp_path, CheckpointData(step=1, tensors=tensors, meta={"rng": extra}))
    want = (torch.randn(4), np.random.rand(3), np.random.randn(2), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    data = read_checkpoint(path)
    restore_rng_state(data.tensors, data.meta["rng"])
    got = (torch.randn(4), np.random.rand(3), np.random.randn(2), random.random())
    assert torch.equal(got[0], want[0])
    assert np.array_equal(got[1], want[1])
    assert np.array_equal(got[2], want[2])
    assert got[3] == want[3]


@pytest.mark.parametrize("damage", ["tensors_cut", "meta_not_json"])
def test_damaged_checkpoint_is_a_value_error_naming_the_file(tmp_path, damage) -> None:
    """A truncated tensors file raised safetensors' own error (a traceback from
    ``tetrarec eval``) and bad JSON a message without the file; both now name it."""
    path = write_checkpoint(tmp_path, _data(3))
    target = path / ("tensors.safetensors" if damage == "tensors_cut" else "meta.json")
    raw = target.read_bytes()
    target.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=re.escape(str(target)) + ": damaged checkpoint"):
        read_checkpoint(path)


def test_a_damaged_rank_file_is_a_value_error_naming_it(tmp_path) -> None:
    """Bug caught: a truncated ``rank_00001.safetensors`` gave rank 1 safetensors' own
    traceback on ``--resume``; it now names the file, as the one-file checkpoint does."""
    from safetensors.torch import save_file

    from tetrarec.train.checkpoint import rank_file, read_rank_tensors

    path = write_checkpoint(tmp_path, _data(3))
    target = path / rank_file(1)
    save_file({"w": torch.ones(100)}, str(target))
    reseal(path)  # the added file listed (an unlisted one is refused before reading)
    assert read_rank_tensors(path, 1)["w"].sum() == 100
    target.write_bytes(target.read_bytes()[:100])
    reseal(path)  # past the manifest's check, to the reader's own
    with pytest.raises(ValueError, match=re.escape(str(target)) + ": damaged checkpoint tensors"):
        read_rank_tensors(path, 1)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"step": None}, "no 'step'"),
        ({"step": "3"}, "'step' is not an integer: \"3\""),
        ({"step": True}, "'step' is not an integer: true"),
        ({"config": None}, "no 'config'"),
        ({"config": [1]}, "'config' is not a JSON object: [1]"),
    ],
)
def test_meta_without_a_key_it_needs_is_damaged_naming_the_key(tmp_path, change, problem) -> None:
    """A ``meta.json`` that is JSON but lacks ``step`` (every checkpoint's) or a key the
    caller requires (``config``, for evaluation), or holds one of another type. Bug
    caught: ``read_checkpoint`` and ``tetrarec eval`` failed with a bare ``KeyError``
    (or ``int("3")`` passed a string), a traceback instead of the one-line "damaged
    checkpoint metadata" error a non-JSON file gets."""
    data = CheckpointData(step=3, tensors={"w": torch.zeros(2)}, meta={"config": {}})
    path = write_checkpoint(tmp_path, data)
    meta = json.loads((path / "meta.json").read_text())
    for key, value in change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    (path / "meta.json").write_text(json.dumps(meta))
    reseal(path)  # the edit reaches the meta check, not the manifest's
    message = f"{path / 'meta.json'}: damaged checkpoint metadata ({problem})"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        read_checkpoint(path, require={"config": dict})
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        read_meta(path, require={"config": dict})


def test_a_runs_checkpoint_dir_given_as_a_checkpoint_names_its_best_and_newest(tmp_path) -> None:
    """``tetrarec eval --checkpoint <checkpoint_dir>`` (the run's directory, not one of
    its checkpoints). Bug caught: the error said only "is not a checkpoint", leaving the
    user to find out that ``<checkpoint_dir>/best`` or a ``step_*`` was meant."""
    for step in (3, 5):
        write_checkpoint(tmp_path, _data(step))
    newest = tmp_path / "step_00000005"
    no_files = "(no meta.json and tensors.safetensors)"
    with pytest.raises(FileNotFoundError) as e:
        read_checkpoint(tmp_path)
    assert str(e.value) == (
        f"{tmp_path} is not a checkpoint {no_files}; it holds a run's checkpoints: give "
        f"{newest} (its newest)"
    )
    mark_best(tmp_path / "step_00000003")
    with pytest.raises(FileNotFoundError) as e:
        read_meta(tmp_path)
    assert str(e.value) == (
        f"{tmp_path} is not a checkpoint (no meta.json); it holds a run's checkpoints: give "
        f"{tmp_path / 'best'} (its best) or {newest} (its newest)"
    )
    with pytest.raises(FileNotFoundError, match=r"is not a checkpoint \(no meta\.json\)$"):
        read_meta(newest / "nothing_here")


# -- found by tests/fuzz/test_fuzz_checkpoint.py -------------------------------------------


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"config": {"data": None}}, "data must be a table"),  # named no file
        ({"config": {}, "sharding": {"world_size": 2}}, "KeyError: 'plan'"),
        ({"config": {}, "sharding": {"plan": [], "world_size": 1}}, "sharding plan"),
    ],
)
def test_checkpoint_tables_of_damaged_meta_is_one_error_naming_it(tmp_path, meta, why) -> None:
    """What export and evaluation read (``CheckpointTables``): a saved config that does
    not load, or a sharded layout without its plan, raised a ValueError naming no file or
    a KeyError; now one ValueError naming meta.json."""
    path = write_checkpoint(
        tmp_path, CheckpointData(step=1, tensors={"w": torch.zeros(1)}, meta=meta)
    )
    with pytest.raises(ValueError, match=re.escape(f"{path / 'meta.json'}: damaged")) as info:
        CheckpointTables(path)
    assert why in str(info.value)


def test_a_meta_config_claiming_a_huge_table_is_refused_before_allocating(tmp_path) -> None:
    """A meta.json whose config gives a table 2**62 rows: reading the table allocated it
    first (torch.full: a multi-line TypeError here; a size that fits int64 would fill
    the memory) before comparing it with the stored rows; now one ValueError naming the
    stored block, nothing allocated."""
    cfg = RunConfig().with_overrides(
        ["model.num_sparse=2", "model.num_embeddings=[10, 7]", "model.dlrm.bottom_mlp=[8, 4]"]
    )
    path = save_run_state(tmp_path, build_parts(cfg, num_dense=13), step=1, config=cfg, keep=1)
    meta = json.loads((path / "meta.json").read_text())
    meta["config"]["model"]["num_embeddings"] = [2**62, 7]
    (path / "meta.json").write_text(json.dumps(meta))
    reseal(path)
    tables = CheckpointTables(path)
    with pytest.raises(ValueError, match=r"its layout says \(4611686018427387904, 4\)") as info:
        tables.read_table("C1")
    assert "\n" not in str(info.value)
    assert tables.read_table("C2").shape == (7, 4)
