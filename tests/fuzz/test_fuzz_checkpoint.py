"""Damaged training checkpoints: resumed exactly, or refused with one line.

A checkpoint directory (``tetrarec.train.checkpoint``) holds ``meta.json`` (step, data
position, config, the optimizers' and RNGs' JSON parts) and ``tensors.safetensors``.
A real one is written once from a tiny run; each example damages a copy of it: its
``meta.json`` edited anywhere (``json_damage``) or replaced by any bytes, its tensor
file cut or with bytes flipped or inserted. Every reader a command uses on a checkpoint
(``read_meta``, ``read_checkpoint``, ``load_dense_transform``, ``CheckpointTables`` of
export and evaluation, ``load_run_state``) then
gives what it read, or a ``ValueError`` / ``FileNotFoundError`` on one line (the CLI's
exit status 2): never a ``KeyError``, ``TypeError``, ``IndexError``, a safetensors
panic or a torch ``RuntimeError``. A checkpoint left whole resumes at its step.
"""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from json_damage import damaged

from tetrarec.config import RunConfig
from tetrarec.testing.checkpoint_crash import reseal
from tetrarec.train import build_parts
from tetrarec.train.checkpoint import read_checkpoint, read_meta
from tetrarec.train.checkpoint_manifest import MANIFEST, file_entry, verify_checkpoint
from tetrarec.train.checkpoint_tables import CheckpointTables
from tetrarec.train.state import load_dense_transform, load_run_state, save_run_state

FUZZ = settings.get_profile("tetrarec-fuzz")
TINY = [
    "data.source=synthetic",
    "model.num_sparse=2",
    "model.num_embeddings=[10, 7]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.dense=adam",
    "optim.sparse.kind=adam",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(config, parts, checkpoint path)``: a tiny run's checkpoint after step 3."""
    cfg = RunConfig().with_overrides(TINY)
    parts = build_parts(cfg, num_dense=13)
    root = tmp_path_factory.mktemp("ck")
    path = save_run_state(root, parts, step=3, config=cfg, keep=1)
    return cfg, parts, path


def read_all(path, parts) -> object:
    """What each reader gives; the first error (one line) when one refuses.

    The damaged files are resealed first (their manifest rewritten), so that the
    damage reaches the readers behind the manifest's check, which would refuse it all.
    """
    reseal(path)
    try:
        read_meta(path, require={"config": dict})
        read_checkpoint(path)
        load_dense_transform(path)
        tables = CheckpointTables(path)  # what export and evaluation read
        for t in tables.tables:
            tables.read_table(t.name)
        return load_run_state(path, parts)
    except (ValueError, FileNotFoundError) as e:
        error = e
    assert "\n" not in str(error).strip(), str(error)
    assert str(path) in str(error)
    event(f"refused: {type(error).__name__}")
    return error


def copy_of(src, tmp_path):
    dst = tmp_path / "step_00000003"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def test_an_untouched_checkpoint_resumes_at_its_step(run, tmp_path) -> None:
    """The baseline the damage below departs from (a reader that refuses a good
    checkpoint would make every damaged one pass for the wrong reason)."""
    _, parts, path = run
    assert read_all(copy_of(path, tmp_path), parts) == (3, 3)


@FUZZ
@given(data=st.data())
def test_edited_meta_resumes_or_is_one_error(run, tmp_path, data) -> None:
    """``meta.json`` with values replaced, keys removed, numbers moved anywhere (the
    optimizers' state layout, the RNG states, the config, the step): read, or refused in
    one line naming the checkpoint."""
    _, parts, src = run
    path = copy_of(src, tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    edited = data.draw(damaged(meta, max_edits=2))
    (path / "meta.json").write_text(json.dumps(edited))
    got = read_all(path, parts)
    if not isinstance(got, Exception):
        step, position = got
        assert isinstance(step, int)
        assert isinstance(position, int)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_meta_of_any_bytes_is_one_error(run, tmp_path, raw) -> None:
    """``meta.json`` of any bytes (not UTF-8, not JSON, JSON of another shape)."""
    _, parts, src = run
    path = copy_of(src, tmp_path)
    (path / "meta.json").write_bytes(raw)
    assert isinstance(read_all(path, parts), ValueError | FileNotFoundError)


@FUZZ
@given(data=st.data(), how=st.sampled_from(["cut", "flip", "insert"]))
def test_damaged_tensor_file_resumes_or_is_one_error(run, tmp_path, data, how) -> None:
    """``tensors.safetensors`` cut short, bytes flipped or inserted (its header or the
    tensor data): a resume (flipped bits inside a float are still a float) or one
    ``ValueError``; never a safetensors panic or a torch error from a wrong shape."""
    _, parts, src = run
    path = copy_of(src, tmp_path)
    file = path / "tensors.safetensors"
    raw = bytearray(file.read_bytes())
    header = int.from_bytes(raw[:8], "little") + 8
    # Mostly the 8-byte length and the JSON header, where damage changes the layout.
    at = data.draw(st.integers(0, header + 16) | st.integers(0, len(raw) - 1))
    if how == "cut":
        raw = raw[:at]
    elif how == "flip":
        raw[at] ^= data.draw(st.integers(1, 255))
    else:
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    file.write_bytes(bytes(raw))
    read_all(path, parts)


def verify_all(path) -> object:
    """``verify_checkpoint`` of the whole checkpoint and of what ``read_checkpoint``
    reads: the entries it accepted, or its one-line error naming the checkpoint."""
    try:
        whole = verify_checkpoint(path)
        verify_checkpoint(path, hash_files=["meta.json", "tensors.safetensors"])
    except ValueError as e:
        error = e
    else:
        return whole
    assert "\n" not in str(error).strip(), str(error)
    assert str(path) in str(error)
    event("refused")
    return error


@FUZZ
@given(data=st.data())
def test_an_edited_manifest_is_refused_or_vouches_only_for_the_files_as_they_are(
    run, tmp_path, data
) -> None:
    """``manifest.json`` with values replaced, entries removed, sizes or the step moved:
    one error naming it or a file, or accepted only where every file of the checkpoint is
    listed with its real size and SHA-256 (an entry dropped from the manifest must not
    let its file be read unverified)."""
    _, _, src = run
    path = copy_of(src, tmp_path)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(data.draw(damaged(manifest, max_edits=2))))
    got = verify_all(path)
    if not isinstance(got, Exception):
        assert got is not None
        on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
        assert sorted(got) == on_disk
        for name in on_disk:
            assert got[name] == file_entry(path / name)


@FUZZ
@given(raw=st.binary(max_size=300))
def test_a_manifest_of_any_bytes_is_one_error(run, tmp_path, raw) -> None:
    """``manifest.json`` of any bytes (not UTF-8, not JSON, JSON of another shape)."""
    _, _, src = run
    path = copy_of(src, tmp_path)
    (path / MANIFEST).write_bytes(raw)
    assert isinstance(verify_all(path), ValueError)
