"""Bad model directories: each is refused, by ``load`` and by ``tetrarec predict``, with one
line naming the file and what is wrong with it; a pickle payload is never unpickled."""

import hashlib
import json
import pickle
import shutil

import pytest
import torch

from tetrarec.cli import main
from tetrarec.config import RunConfig
from tetrarec.inference import ModelFileError, load
from tetrarec.inference.export import export_checkpoint
from tetrarec.inference.format import FORMAT_VERSION, MANIFEST, TENSORS, Manifest
from tetrarec.train import train

TINY = [
    "data.source=synthetic",
    "data.batch_size=32",
    "data.prefetch=1",
    "data.synthetic.num_samples=128",
    "data.synthetic.eval_samples=64",
    "model.num_sparse=2",
    "model.num_embeddings=[30, 20]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[4, 1]",
    "train.steps=2",
    "train.eval_every=0",
    "train.progress=false",
    "train.checkpoint_every=2",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    result = train(RunConfig().with_overrides([*TINY, f"train.checkpoint_dir={tmp / 'ck'}"]))
    export_checkpoint(result.checkpoint, tmp / "model")
    return tmp / "model"


@pytest.fixture
def model_dir(exported, tmp_path):
    """A fresh copy of a good model directory, for a test to damage."""
    load(exported)  # the original loads: the damage below is what each test refuses
    return shutil.copytree(exported, tmp_path / "model")


def _manifest(model_dir) -> dict:
    return json.loads((model_dir / MANIFEST).read_text())


def _write_manifest(model_dir, values: dict, *, rehash: bool) -> None:
    """Write ``values`` as the manifest; with ``rehash``, with the tensor file's size and
    SHA-256 and a content hash that match (what a forger who knows the format writes)."""
    if rehash:
        data = (model_dir / TENSORS).read_bytes()
        values["files"][TENSORS] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        values["content_hash"] = Manifest.from_dict(values, "x").computed_hash()
    (model_dir / MANIFEST).write_text(json.dumps(values))


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes: safetensors alone would not notice
    path.write_bytes(bytes(data))


def _newer_version(model_dir) -> None:
    values = _manifest(model_dir)
    values["format_version"] = FORMAT_VERSION + 1
    _write_manifest(model_dir, values, rehash=False)


def _edited_manifest(model_dir) -> None:
    values = _manifest(model_dir)
    values["config"]["model"]["dlrm"]["top_mlp"] = [5, 1]
    _write_manifest(model_dir, values, rehash=False)


def _truncated(model_dir) -> None:
    data = (model_dir / TENSORS).read_bytes()
    (model_dir / TENSORS).write_bytes(data[: len(data) // 2])


# damage -> (the file named, what the line says)
DAMAGE = {
    "changed_tensor": (lambda d: _flip_a_byte(d / TENSORS), TENSORS, "SHA-256 differs"),
    "missing_tensors": (lambda d: (d / TENSORS).unlink(), TENSORS, "missing"),
    "missing_manifest": (lambda d: (d / MANIFEST).unlink(), MANIFEST, "missing"),
    "newer_version": (_newer_version, MANIFEST, f"version {FORMAT_VERSION + 1} is newer"),
    "edited_manifest": (_edited_manifest, MANIFEST, "content hash does not match"),
    "truncated": (_truncated, TENSORS, "(changed or truncated)"),
    "truncated_manifest": (
        lambda d: (d / MANIFEST).write_text((d / MANIFEST).read_text()[:100]),
        MANIFEST,
        "not readable JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_load_refuses_a_damaged_directory_naming_the_file(model_dir, case):
    """Each damage raises ``ModelFileError`` with one line naming the damaged file and the
    problem. Catches a check skipped (a changed tensor scored silently, an edited
    config built), or an error that names neither (a safetensors or JSON traceback)."""
    damage, file, problem = DAMAGE[case]
    damage(model_dir)
    with pytest.raises(ModelFileError) as info:
        load(model_dir)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(model_dir / file))
    assert problem in message


@pytest.mark.parametrize("case", ["changed_tensor", "missing_manifest", "newer_version"])
def test_predict_refuses_a_damaged_directory_with_exit_2(model_dir, tmp_path, capsys, case):
    """``tetrarec predict`` on a damaged model: exit 2, one line naming the file, no
    output written (a traceback, exit 1, or scores from a changed model fail)."""
    damage, file, problem = DAMAGE[case]
    damage(model_dir)
    out = tmp_path / "scores.parquet"
    argv = ["-q", "predict", "--model", str(model_dir), "--input", "rows.tsv"]
    assert main([*argv, "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"tetrarec predict: error: {model_dir / file}: ")
    assert problem in err
    assert not out.exists()


class _Payload:
    """Unpickling this creates ``path``: proof that the pickle ran."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_payload_as_the_tensor_file_is_never_unpickled(model_dir, tmp_path):
    """A tensor file replaced by a pickle (``torch.save`` of a payload that runs code),
    with a manifest re-hashed to match it, passes every hash check, and safetensors then
    refuses it as a file of another format: the payload never runs. A loader that fell
    back to ``torch.load`` or ``pickle`` would create the marker file."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    pickle.loads(payload)  # the payload is live: unpickled, it creates the marker
    assert marker.exists()
    marker.unlink()
    torch.save({"tables.C1.rows": _Payload(marker)}, model_dir / TENSORS)
    _write_manifest(model_dir, _manifest(model_dir), rehash=True)
    with pytest.raises(ModelFileError, match=r"tensors\.safetensors: not a readable safetensors"):
        load(model_dir)
    assert not marker.exists()


def test_loading_a_model_leaves_the_global_rng_as_it_was(exported) -> None:
    """Bug caught (found in review): loading reseeded torch's global RNG (the throwaway
    initial draw of the dense layers), so a user's random stream changed on load."""
    directory = exported
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    load(directory)
    assert torch.equal(torch.rand(4), want)
