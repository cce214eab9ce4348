"""Checkpoint manifests, crash injection at each stage of a write, and ``--resume`` with
no complete checkpoint (issue 31 item 1; item 3's restart before the first checkpoint).

The sharded write's crashes run on gloo ranks in
``tests/distributed/test_checkpoint_crash.py``; these are the one-process writer's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import shutil

import pytest
import torch

import tetrarec.train.checkpoint as ck
import tetrarec.train.state as state_module
from tetrarec.config import RunConfig
from tetrarec.testing.checkpoint_crash import CrashAt, InjectedCrashError, reseal
from tetrarec.train import build_parts, train
from tetrarec.train.checkpoint import (
    CheckpointData,
    latest_checkpoint,
    list_checkpoints,
    rank_file,
    read_checkpoint,
    read_rank_tensors,
    write_checkpoint,
)
from tetrarec.train.checkpoint_manifest import (
    MANIFEST,
    WriteStage,
    file_entry,
    verify_checkpoint,
)
from tetrarec.train.state import load_run_state, save_run_state

TINY = [
    "data.source=synthetic",
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.prefetch=1",
    "data.synthetic.num_samples=128",
    "data.synthetic.eval_samples=64",
    "model.num_sparse=2",
    "model.num_embeddings=[10, 7]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "train.progress=false",
    "train.deterministic=true",
    "train.log_every=0",
    "train.eval_every=0",
]


def _data(step: int) -> CheckpointData:
    return CheckpointData(
        step=step,
        tensors={"w": torch.arange(64, dtype=torch.float32) + step},
        meta={"data_position": step},
    )


def _manifest(path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path) -> None:
    """Bugs caught: a file left out of the manifest (so never verified), a size or hash
    of the file before its last write, the step or data position not recorded."""
    path = write_checkpoint(tmp_path, _data(7))
    manifest = _manifest(path)
    assert manifest["step"] == 7
    assert manifest["data_position"] == 7
    assert (manifest["world_size"], manifest["plan_fingerprint"]) == (1, None)
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == on_disk == ["meta.json", "tensors.safetensors"]
    for name, entry in manifest["files"].items():
        raw = (path / name).read_bytes()
        assert entry == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def _flip_last_byte(file) -> None:
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0x40  # inside the last tensor's data: still a valid safetensors file
    file.write_bytes(bytes(raw))


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Make any tensor read in ``tetrarec.train.checkpoint`` fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read before the files were verified")

    monkeypatch.setattr(ck, "load_file", refuse)
    monkeypatch.setattr(ck, "safe_open", refuse)


def test_a_flipped_bit_in_tensor_data_is_refused_before_any_tensor_is_read(
    tmp_path, no_tensor_reads
) -> None:
    """Bug caught (without the manifest): a bit flipped inside a tensor's bytes loads
    without complaint (safetensors checks the header, not the data) and the run
    resumes from silently wrong weights."""
    path = write_checkpoint(tmp_path, _data(3))
    _flip_last_byte(path / "tensors.safetensors")
    message = f"{path / 'tensors.safetensors'}: damaged checkpoint file (its SHA-256 differs"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        read_checkpoint(path)


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "reader"])
def test_a_file_the_manifest_leaves_out_is_refused_not_read_unverified(
    tmp_path, no_tensor_reads, whole
) -> None:
    """Bug caught by the manifest fuzz test: a manifest whose tensor-file entry was
    dropped vouched for the rest, and the dropped file was then read without its hash
    checked (a damaged manifest made the damage it should catch invisible)."""
    path = write_checkpoint(tmp_path, _data(3))
    manifest = _manifest(path)
    del manifest["files"]["tensors.safetensors"]
    (path / MANIFEST).write_text(json.dumps(manifest))
    message = f"{path / 'tensors.safetensors'}: not listed in {MANIFEST}"
    read = verify_checkpoint if whole else read_checkpoint
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        read(path)


@pytest.mark.parametrize(
    ("damage", "named", "why"),
    [
        ("cut", "tensors.safetensors", "bytes, manifest.json says"),
        ("delete_rank", rank_file(1), "missing from the checkpoint (manifest.json lists it)"),
        ("meta_edit", "meta.json", "its SHA-256 differs"),
        ("manifest_not_json", MANIFEST, "damaged checkpoint manifest"),
        ("manifest_bad_entry", MANIFEST, "bad entry for '../meta.json'"),
        ("manifest_other_step", MANIFEST, "'step' 4 in step_00000003"),
    ],
)
def test_a_missing_or_damaged_file_is_one_value_error_naming_it(
    tmp_path, damage, named, why
) -> None:
    """Bugs caught: a missing rank file found only when that rank reads it (or never,
    by the other ranks), a cut file reaching safetensors, an edited meta.json read as
    if intact, a manifest of another checkpoint (copied in) or with a path outside
    the directory taken as valid, and errors of several lines or naming no file."""
    path = write_checkpoint(tmp_path, _data(3))
    (path / rank_file(1)).write_bytes(b"rank one")
    reseal(path)  # now a checkpoint whose manifest lists a rank file
    manifest = _manifest(path)
    if damage == "cut":
        raw = (path / "tensors.safetensors").read_bytes()
        (path / "tensors.safetensors").write_bytes(raw[:-8])
    elif damage == "delete_rank":
        (path / rank_file(1)).unlink()
    elif damage == "meta_edit":
        text = (path / "meta.json").read_text()
        (path / "meta.json").write_text(text.replace('"data_position": 3', '"data_position": 4'))
    elif damage == "manifest_not_json":
        (path / MANIFEST).write_text("{")
    elif damage == "manifest_bad_entry":
        manifest["files"]["../meta.json"] = manifest["files"].pop("meta.json")
        (path / MANIFEST).write_text(json.dumps(manifest))
    else:
        (path / MANIFEST).write_text(json.dumps({**manifest, "step": 4}))
    with pytest.raises(ValueError, match="^" + re.escape(f"{path / named}: ")) as info:
        read_checkpoint(path)
    assert why in str(info.value)
    assert "\n" not in str(info.value)


def test_a_damaged_rank_file_is_refused_by_its_reader(tmp_path) -> None:
    """Bug caught: the rank file (each rank reads only its own) not checked against the
    manifest, its flipped bits loaded as weights."""
    from safetensors.torch import save_file

    path = write_checkpoint(tmp_path, _data(3))
    save_file({"rows": torch.ones(16)}, str(path / rank_file(1)))
    reseal(path)
    assert read_rank_tensors(path, 1)["rows"].sum() == 16
    _flip_last_byte(path / rank_file(1))
    with pytest.raises(ValueError, match=re.escape(f"{path / rank_file(1)}: damaged checkpoint")):
        read_rank_tensors(path, 1)


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(tmp_path, caplog) -> None:
    """Checkpoints written before manifests (format 2 without ``manifest.json``) still
    resume and evaluate. Bugs caught: such a checkpoint refused, or dropped from
    ``list_checkpoints`` (a resume would restart a long run from step 0), or loaded
    without saying that it was not verified."""
    path = write_checkpoint(tmp_path, _data(3))
    (path / MANIFEST).unlink()
    assert latest_checkpoint(tmp_path) == path
    with caplog.at_level(logging.WARNING):
        data = read_checkpoint(path)
    assert torch.equal(data.tensors["w"], _data(3).tensors["w"])
    assert f"{path} has no manifest.json (written by an older tetrarec)" in caplog.text


def test_hashing_streams_the_file(tmp_path, monkeypatch) -> None:
    """Bug caught: a file read whole to hash it (``read_bytes``), which doubles the
    memory a checkpoint of GBs needs. The hash must equal hashlib's of the bytes."""
    file = tmp_path / "big"
    file.write_bytes(bytes(range(256)) * 4096)  # 1 MiB

    def whole(*args, **kwargs):
        raise AssertionError("read whole")

    monkeypatch.setattr(type(file), "read_bytes", whole)
    entry = file_entry(file)
    monkeypatch.undo()
    assert entry.sha256 == hashlib.sha256(file.read_bytes()).hexdigest()
    assert entry.bytes == 1 << 20


# -- crash injection: one process ----------------------------------------------------------

STAGES = list(WriteStage)


@pytest.mark.parametrize("stage", STAGES, ids=[s.value for s in STAGES])
def test_a_crash_at_each_stage_leaves_the_previous_checkpoint_loadable(tmp_path, stage) -> None:
    """A write of step 2 crashes at ``stage``; ``image`` is the directory as the crash
    left it (a killed process runs no cleanup). Bugs caught: a checkpoint renamed into
    place before its files or manifest are complete (taken as the newest, then refused
    or loaded half-written), the previous checkpoint removed or pruned before the new
    one is complete, a crashed write's temporary directory never removed (a disk
    filled by crashes), or one taken for a checkpoint."""
    root, image = tmp_path / "run", tmp_path / "image"
    first = write_checkpoint(root, _data(1))
    with pytest.raises(InjectedCrashError):
        write_checkpoint(root, _data(2), on_stage=CrashAt(stage, image=image))
    renamed = stage == WriteStage.RENAME_AFTER
    for where in (root, image):
        newest = latest_checkpoint(where)
        assert newest is not None
        assert newest.name == ("step_00000002" if renamed else "step_00000001")
        assert read_checkpoint(newest).step == (2 if renamed else 1)  # verified, whole
        assert torch.equal(read_checkpoint(where / first.name).tensors["w"], _data(1).tensors["w"])
    # the writer that raised removed its temporary directory; a killed one left it
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    left = sorted(p.name for p in image.iterdir() if p.name.startswith(".tmp"))
    assert left == ([] if renamed else [".tmp-step_00000002"])
    # the next writer removes what the crash left
    write_checkpoint(image, _data(3))
    assert not [p for p in image.iterdir() if p.name.startswith(".tmp")]
    assert [p.name for p in list_checkpoints(image)] == [
        "step_00000001",
        *(["step_00000002"] if renamed else []),
        "step_00000003",
    ]


def _tiny(root, *extra: str) -> RunConfig:
    return RunConfig().with_overrides([*TINY, f"train.checkpoint_dir={root}", *extra])


@pytest.mark.parametrize("stage", STAGES, ids=[s.value for s in STAGES])
def test_pruning_waits_for_the_newer_checkpoint_to_be_complete(
    tmp_path, monkeypatch, stage
) -> None:
    """``keep_checkpoints=1``: the only checkpoint may be deleted only once the next is
    in place. Bug caught: pruning before (or while) the new checkpoint is written
    leaves a crash with no checkpoint at all."""
    cfg = _tiny(tmp_path)
    parts = build_parts(cfg, num_dense=13)
    first = save_run_state(tmp_path, parts, step=1, config=cfg, keep=1)
    crashing = functools.partial(ck.write_checkpoint, on_stage=CrashAt(stage))
    monkeypatch.setattr(state_module, "write_checkpoint", crashing)
    with pytest.raises(InjectedCrashError):
        save_run_state(tmp_path, parts, step=2, config=cfg, keep=1)
    monkeypatch.undo()
    names = [p.name for p in list_checkpoints(tmp_path)]
    renamed = stage == WriteStage.RENAME_AFTER
    assert names == [first.name, *(["step_00000002"] if renamed else [])]
    assert load_run_state(first, build_parts(cfg, num_dense=13)) == (1, 1)
    save_run_state(tmp_path, parts, step=3, config=cfg, keep=1)  # prunes once complete
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003"]


# -- --resume with no complete checkpoint ----------------------------------------------------


@pytest.mark.parametrize("partial", [False, True], ids=["empty", "only_a_crashed_write"])
def test_resume_without_a_complete_checkpoint_starts_from_step_0(tmp_path, caplog, partial):
    """A run that died before (or while writing) its first checkpoint is restarted with
    ``--resume`` (as an elastic launcher does). Bugs caught: the resume refused ("no
    checkpoint", the old behaviour), a crashed write's temporary directory taken for a
    checkpoint, or left behind after the run's own checkpoint."""
    root = tmp_path / "run"
    if partial:  # what a crash before the manifest leaves
        written = write_checkpoint(tmp_path / "other", _data(1))
        shutil.copytree(written, root / ".tmp-step_00000001")
        (root / ".tmp-step_00000001" / MANIFEST).unlink()
    with caplog.at_level(logging.INFO, logger="tetrarec.train.loop"):
        result = train(_tiny(root, "train.steps=2"), resume=True)
    assert (result.start_step, result.steps) == (0, 2)
    lines = [r.getMessage() for r in caplog.records if "no complete checkpoint" in r.getMessage()]
    assert lines == [f"resume: no complete checkpoint in {root} yet; starting from step 0"]
    assert [p.name for p in root.iterdir()] == ["step_00000002"]


def test_resume_after_a_crashed_write_continues_from_the_previous_checkpoint(tmp_path) -> None:
    """A run checkpointed at step 2 and crashed while writing step 3 (temporary
    directory complete but for the manifest) resumes from step 2, bitwise as a run
    never interrupted. Bug caught: the partial step 3 taken as the newest checkpoint."""
    straight = train(_tiny(tmp_path / "a", "train.steps=4"))
    root = tmp_path / "b"
    train(_tiny(root, "train.steps=2"))
    shutil.copytree(root / "step_00000002", root / ".tmp-step_00000003")
    (root / ".tmp-step_00000003" / MANIFEST).unlink()
    resumed = train(_tiny(root, "train.steps=4"), resume=True)
    assert resumed.start_step == 2
    assert resumed.final == straight.final
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]


def test_resume_from_a_damaged_checkpoint_names_the_file(tmp_path) -> None:
    """Bug caught: a resume that loads silently corrupted weights (a flipped bit in the
    tensor data passes safetensors' header checks)."""
    root = tmp_path / "run"
    train(_tiny(root, "train.steps=1"))
    target = root / "step_00000001" / "tensors.safetensors"
    _flip_last_byte(target)
    with pytest.raises(ValueError, match="^" + re.escape(f"{target}: damaged checkpoint file")):
        train(_tiny(root, "train.steps=2"), resume=True)


def test_resume_without_a_checkpoint_dir_is_refused(tmp_path) -> None:
    """Bug caught: ``--resume`` with no ``train.checkpoint_dir`` quietly training from
    scratch (there is no directory that could hold a checkpoint: a config slip)."""
    cfg = RunConfig().with_overrides([*TINY, "train.steps=1"])
    with pytest.raises(ValueError, match=r"resume: train\.checkpoint_dir is not set"):
        train(cfg, resume=True)
