"""A run asked to stop (SIGTERM in the CLI) checkpoints the step it is in, then stops."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from tetrarec.config import RunConfig
from tetrarec.train import TrainingStoppedError, latest_checkpoint, read_checkpoint, train

TINY = [
    "data.synthetic.num_samples=2048",
    "data.synthetic.eval_samples=256",
    "data.batch_size=64",
    "model.num_sparse=3",
    "model.num_embeddings=[30, 20, 10]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.dense=adam",
    "optim.sparse.kind=adam",
    "model.embedding=fused",
    "train.deterministic=true",
    "train.progress=false",
    "train.log_every=0",
    "train.steps=5",
]


def _cfg(tmp_path, name: str, *extra: str) -> RunConfig:
    return RunConfig().with_overrides([*TINY, f"train.checkpoint_dir={tmp_path / name}", *extra])


def test_a_stopped_run_checkpoints_its_step_and_resumes_as_if_never_stopped(tmp_path) -> None:
    """Bugs caught: the stop ignored, no checkpoint of the step it stopped after, a step
    half applied when it stopped (the resume would then differ from a straight run)."""
    straight = train(_cfg(tmp_path, "a"))
    stop = threading.Event()
    stop.set()
    with pytest.raises(TrainingStoppedError, match=r"^stopped after step 1; checkpoint .*1$"):
        train(_cfg(tmp_path, "b"), stop=stop)
    assert latest_checkpoint(tmp_path / "b").name.endswith("00000001")
    resumed = train(_cfg(tmp_path, "b"), resume=True)
    assert resumed.start_step == 1
    assert resumed.final == straight.final
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    for name, tensor in a.tensors.items():
        assert (tensor == b.tensors[name]).all(), name


def test_sigterm_to_tetrarec_train_writes_a_final_checkpoint_and_exits_143(tmp_path) -> None:
    """Bug caught: SIGTERM (a scheduler's preemption, `docker stop`) ended the run with
    nothing saved since the last periodic checkpoint."""
    sets = [*TINY[:-1], "train.steps=1000000", "data.synthetic.num_samples=100000000",
            f"train.checkpoint_dir={tmp_path / 'c'}", "train.log_every=1"]  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text("")  # every setting from --set
    cmd = [sys.executable, "-m", "tetrarec", "train", "--config", str(config)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # wait until it trains
        if " step " in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "tetrarec train: SIGTERM: stopped after step " in err
    saved = latest_checkpoint(tmp_path / "c")
    assert saved is not None
    assert int(saved.name.split("_")[-1]) >= 1
