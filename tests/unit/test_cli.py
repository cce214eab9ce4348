"""The ``tetrarec`` command: what it prints and writes, and its one-line errors.

Every figure the command prints is checked against the JSON it wrote, and every file it
writes is read back; errors are one line on stderr with the documented exit status,
never a traceback.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tetrarec.cli import main
from tetrarec.data import open_binary
from tetrarec.testing.checkpoint_crash import reseal
from tetrarec.train import evaluate_checkpoint, read_checkpoint
from tetrarec.train.checkpoint import CheckpointData, write_checkpoint

REPO = Path(__file__).parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))
# A synthetic-data example: the error tests below run it (its tiny size warns of nothing).
SYNTHETIC = REPO / "examples" / "dlrm_dcnv2_small.toml"

TINY = [
    "data.source=synthetic",
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.synthetic.num_samples=128",
    "data.synthetic.eval_samples=64",
    "model.num_sparse=3",
    "model.num_embeddings=40",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "model.dlrm.dcn_low_rank=4",
    "model.dlrm.num_dense=13",
    "optim.warmup_steps=1",
    "optim.decay_start=1",
    "optim.decay_steps=1",
    "train.epochs=none",
    "train.steps=2",
    "train.eval_every=0",
    "train.keep_best=none",
    "train.early_stop_patience=0",
    "train.checkpoint_every=0",
    "train.progress=false",
]

# "AUC 0.5123  NE 1.0012 ..." -> {"AUC": "0.5123", "NE": "1.0012", ...}
_FIGURE = re.compile(r"(AUC|NE|log loss|calibration|accuracy|samples/s|steps) ([-\d.,naif]+)")
_METRIC_KEYS = {"AUC": "auc", "NE": "ne", "log loss": "log_loss", "calibration": "calibration"}


def _wait_for(
    proc: subprocess.Popen, where: Path, pattern: str, limit_s: float, never: str
) -> None:
    """Wait until ``where`` holds a match of ``pattern`` while ``proc`` runs (it must not
    exit first), at most ``limit_s`` seconds; fail with ``never`` if none appeared."""
    deadline = time.monotonic() + limit_s
    while not list(where.glob(pattern)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    assert list(where.glob(pattern)), never


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _figures(line: str) -> dict[str, float]:
    return {k: float(v.replace(",", "")) for k, v in _FIGURE.findall(line)}


def _assert_printed_metrics_are(line: str, metrics: dict) -> None:
    """Each printed metric is the JSON's value, to the 4 decimals printed."""
    printed = _figures(line)
    assert set(printed) >= set(_METRIC_KEYS), line
    for label, key in _METRIC_KEYS.items():
        assert printed[label] == pytest.approx(metrics[key], abs=0.5e-4, nan_ok=True), label


def _one_line(err: str) -> str:
    """The single non-empty stderr line of a failed command (never a traceback)."""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_demo_prints_the_figures_it_writes(capsys, tmp_path) -> None:
    """A demo that printed other figures than its JSON (a stale eval, another rate)
    fails here, as does a JSON that is not written."""
    out = tmp_path / "demo.json"
    assert main(["-q", "demo", "--json", str(out), *_sets(*TINY)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(out.read_text())
    printed = _figures(line)
    assert printed["AUC"] == pytest.approx(summary["final"]["auc"], abs=0.5e-4)
    assert printed["NE"] == pytest.approx(summary["final"]["ne"], abs=0.5e-4)
    assert printed["samples/s"] == pytest.approx(summary["samples_per_s"], abs=0.5)
    assert summary["samples_per_s"] > 0
    assert summary["steps"] == 2
    assert re.search(r"\(2 steps\)", line)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_train_eval_resume_print_what_they_write(capsys, tmp_path, example) -> None:
    """train: the printed metrics, rate and checkpoint are the JSON's, and the
    checkpoint loads and scores those metrics; eval: prints and writes the same metrics
    (those of the run); resume: continues from step 2 and writes step 3. A command that
    printed one thing and wrote another, or wrote an unreadable checkpoint, fails."""
    ck = tmp_path / "ck"
    out = tmp_path / "run.json"
    # TINY's 3 tables: an example's list of one sharding type per table no longer fits
    sets = _sets(*TINY, f"train.checkpoint_dir={ck}", "sharding.type=none")
    assert main(["-q", "train", "--config", str(example), *sets, "--json", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out.read_text())
    assert summary["steps"] == 2
    assert summary["start_step"] == 0
    _assert_printed_metrics_are(printed[0], summary["final"])
    rate = _figures(printed[1])
    assert rate["samples/s"] == pytest.approx(summary["samples_per_s"], abs=0.5)
    assert rate["steps"] == 2
    assert printed[2] == f"checkpoint {summary['checkpoint']}"
    ckpt = Path(summary["checkpoint"])
    assert ckpt.parent == ck
    assert ckpt.name == "step_00000002"
    data = read_checkpoint(ckpt)
    assert data.step == 2
    assert all(bool(t.isfinite().all()) for t in data.tensors.values() if t.is_floating_point())
    assert evaluate_checkpoint(ckpt).to_dict() == summary["final"]

    ev = tmp_path / "eval.json"
    assert main(["-q", "eval", "--checkpoint", str(ckpt), "--json", str(ev)]) == 0
    captured = capsys.readouterr()
    ev_line = captured.out.strip()
    # Long evaluations show their progress (bug caught: eval showed none, however long).
    assert re.search(r"/\d+(\.\d+)?k? .*sample/s", captured.err), captured.err[-300:]
    assert main(["-q", "eval", "--checkpoint", str(ckpt), "--no-progress"]) == 0
    assert "sample/s" not in capsys.readouterr().err
    ev_json = json.loads(ev.read_text())
    assert ev_json.pop("checkpoint") == str(ckpt)
    assert ev_json == summary["final"]
    _assert_printed_metrics_are(ev_line, ev_json)

    more = _sets(*TINY, f"train.checkpoint_dir={ck}", "train.steps=3", "sharding.type=none")
    out3 = tmp_path / "run3.json"
    assert (
        main(["-q", "train", "--config", str(example), *more, "--resume", "--json", str(out3)]) == 0
    )
    assert _figures(capsys.readouterr().out)["steps"] == 3
    resumed = json.loads(out3.read_text())
    assert (resumed["start_step"], resumed["steps"]) == (2, 3)
    assert Path(resumed["checkpoint"]).name == "step_00000003"
    assert read_checkpoint(resumed["checkpoint"]).step == 3


def test_unknown_key_lists_valid_keys(capsys, tmp_path) -> None:
    code = main(["-q", "train", "--config", str(EXAMPLES[0]), "--set", "train.stepz=3"])
    assert code == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("tetrarec train: error: ")
    assert "unknown config key train.stepz" in err
    assert "valid keys of train: steps" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nnum_tables = 3\n")
    assert main(["-q", "train", "--config", str(bad)]) == 2
    assert "valid keys of model: num_sparse" in _one_line(capsys.readouterr().err)


def _criteo_line(label: int, dense: list[int], cats: list[int]) -> str:
    return "\t".join([str(label), *map(str, dense), *(f"{c:08x}" for c in cats)])


def test_preprocess_csv_with_a_config_that_maps_no_columns(capsys, tmp_path) -> None:
    """Bug caught: ``preprocess csv`` with a Criteo recipe's config failed on
    "ColumnMapping.sparse_columns must name at least one column", a class the user
    never wrote; the error names the config, its source and the keys to set."""
    raw = tmp_path / "a.csv"
    raw.write_text("y,s\n1,a\n")
    config = REPO / "examples" / "criteo_kaggle_sample.toml"
    argv = ["-q", "preprocess", "csv", "--config", str(config), "--input", str(raw)]
    assert main([*argv, "--output", str(tmp_path / "out.parquet"), "--no-progress"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "(its data.source is 'criteo') maps none: set data.sparse_columns" in err
    assert "ColumnMapping" not in err


def test_preprocess_criteo_writes_the_rows_it_reports(capsys, tmp_path) -> None:
    """The printed row counts are those written, and the columns hold the lines' values
    (a preprocess that reported rows it did not write, or wrote them wrong, fails)."""
    raw = tmp_path / "day.tsv"
    dense = [list(range(13)), [5] * 13]
    cats = [list(range(26)), [0xFFFFFFFF] * 26]
    raw.write_text(
        _criteo_line(1, dense[0], cats[0]) + "\n" + _criteo_line(0, dense[1], cats[1]) + "\n"
    )
    out = tmp_path / "bin"
    argv = ["-q", "preprocess", "criteo", "--input", str(raw), "--output", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.match(
        rf"wrote 2 rows \(1 positive\) from 1 file\(s\) to {re.escape(str(out))} ", line
    )
    assert "no bad lines" in line
    cols = open_binary(out)
    assert cols.labels.tolist() == [1.0, 0.0]
    assert cols.dense.tolist() == dense  # raw values (format version 2)
    assert cols.sparse.tolist() == cats


def test_bench_unknown_name_is_a_clear_error(capsys) -> None:
    assert main(["-q", "bench", "no_such_thing"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "no benchmark 'no_such_thing'" in err
    assert "available:" in err
    assert "quality" in err


def test_bench_without_a_name_lists_the_benchmarks(capsys) -> None:
    """Bug caught: ``tetrarec bench`` alone said "the following arguments are required:
    name, args", naming no benchmark and an ``args`` that is optional."""
    assert main(["-q", "bench"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "name a benchmark" in err
    assert "available:" in err
    assert "quality" in err
    assert "args" not in err


def test_bench_runs_the_script_with_its_args(capfd) -> None:
    """The script runs and gets the arguments (its own --help usage is printed)."""
    assert main(["-q", "bench", "quality", "--help"]) == 0
    assert "usage: bench_quality.py" in capfd.readouterr().out


def test_bench_runs_in_the_callers_directory(tmp_path, monkeypatch, capfd) -> None:
    """A relative ``--json out.json`` lands where the user is, not in the repository
    (the bug: the script ran with the repository root as its working directory)."""
    import tetrarec.cli as cli

    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "bench_where.py").write_text(
        "import sys, pathlib\npathlib.Path(sys.argv[2]).write_text(str(pathlib.Path.cwd()))\n"
    )
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setattr(cli, "_REPO_ROOT", tree)
    monkeypatch.chdir(user)
    assert main(["-q", "bench", "where", "--json", "out.json"]) == 0
    assert (user / "out.json").read_text() == str(user)
    assert not (tree / "out.json").exists()


def test_eval_on_files_says_how_many_bad_lines_it_skipped(tmp_path, caplog) -> None:
    """``tetrarec eval --data`` under ``on_bad_line = "skip"``: the skipped lines are
    logged, as when training reads them (the bug: they were dropped without a word)."""
    rows = [_criteo_line(i % 2, list(range(13)), list(range(26))) for i in range(40)]
    raw = tmp_path / "day.tsv"
    raw.write_text("\n".join(rows) + "\n")
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join([*rows[:10], rows[10].replace("0", "2", 1), *rows[11:]]) + "\n")
    sets = [
        *TINY,
        "data.source=criteo",
        f"data.train_path={raw}",
        "data.on_bad_line=skip",
        "model.num_sparse=26",
        f"train.checkpoint_dir={tmp_path / 'ck'}",
    ]
    assert main(["-q", "train", "--config", str(SYNTHETIC), *_sets(*sets)]) == 0
    ckpt = next((tmp_path / "ck").glob("step_*"))
    with caplog.at_level(logging.WARNING, logger="tetrarec.data.build"):
        assert evaluate_checkpoint(ckpt, data=[str(bad)]).num_samples == 39
    assert f"{bad}: read 39 rows, skipped 1 bad lines (1 label is not 0 or 1)" in caplog.text


def test_train_reports_the_skipped_lines_at_the_end_and_in_its_json(capsys, tmp_path) -> None:
    """The README says skipped lines are "summarized at the end of the run", but they
    were only logged while loading, and ``train --json`` had no bad-line field (the
    bug). The summary counts the training and the eval_path files' lines (a one-input
    split's once), printed and in the JSON in the shape ``preprocess --json`` uses."""
    rows = [_criteo_line(i % 2, list(range(13)), list(range(26))) for i in range(40)]
    train_file, eval_file = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    train_file.write_text("\n".join([*rows[:5], "2" + rows[5][1:], *rows[6:]]) + "\n")
    eval_file.write_text("\n".join([*rows[:20], "x\t1", "7" + rows[0][1:]]) + "\n")
    sets = [
        *TINY,
        "data.source=criteo",
        f"data.train_path={train_file}",
        "data.on_bad_line=skip",
        "model.num_sparse=26",
        "train.checkpoint_dir=none",
    ]
    out = tmp_path / "run.json"
    args = ["-q", "train", "--config", str(SYNTHETIC), "--json", str(out)]
    assert main([*args, *_sets(*sets, f"data.eval_path={eval_file}")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    expected = (
        "read 59 rows, skipped 3 bad lines (1 wrong number of fields, 2 label is not 0 or 1);"
        f" first: {train_file}, line 6, field label: label is not 0 or 1"
    )
    assert printed.startswith(f"input files: {expected}")
    bad = json.loads(out.read_text())["bad_lines"]
    assert {k: bad[k] for k in ("rows_read", "skipped", "counts")} == {
        "rows_read": 59,
        "skipped": 3,
        "counts": {"wrong number of fields": 1, "label is not 0 or 1": 2},
    }
    assert [e.split(": ")[0] for e in bad["examples"]] == [
        f"{train_file}, line 6, field label",
        f"{eval_file}, line 21, field fields",
        f"{eval_file}, line 22, field label",
    ]
    assert main([*args, *_sets(*sets)]) == 0  # eval rows are the tail of train_path
    assert "input files: read 39 rows, skipped 1 bad lines" in capsys.readouterr().out
    assert json.loads(out.read_text())["bad_lines"]["skipped"] == 1
    assert main([*args, *_sets(*TINY, "train.checkpoint_dir=none")]) == 0  # synthetic
    assert json.loads(out.read_text())["bad_lines"] is None


# -- tetrarec's own errors: one line on stderr, the documented exit status -----------------


def test_log_lines_of_a_torchrun_launch_name_their_rank() -> None:
    """Bug caught: every rank of a sharded run wrote the same warning about the data
    that they all read, in lines that did not say which rank wrote them."""
    import logging

    from tetrarec.cli import _log_format
    from tetrarec.comm import LaunchInfo

    record = logging.LogRecord("tetrarec.data", logging.WARNING, "", 0, "odd rows", None, None)

    def line(launch: LaunchInfo) -> str:
        return logging.Formatter(_log_format(launch)).format(record).split(" ", 2)[2]

    assert line(LaunchInfo()) == "WARNING tetrarec.data: odd rows"
    assert line(LaunchInfo(rank=1, world_size=2)) == "rank 1 WARNING tetrarec.data: odd rows"


def test_a_rank_that_cannot_join_is_one_line_naming_rank_and_timeout(capsys, monkeypatch) -> None:
    """A rank missing or late at the rendezvous: exit 1 with one line naming the rank
    and ``sharding.timeout_s``, not torch's ``DistStoreError`` traceback through tetrarec."""
    import torch.distributed as dist

    def late(*args, **kwargs):
        raise dist.DistStoreError("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/1")

    monkeypatch.setattr(dist, "init_process_group", late)
    launch = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for key, value in launch.items():  # rank 0 of a 2-rank torchrun launch
        monkeypatch.setenv(key, value)
    sets = _sets(*TINY, "sharding.type=row_wise", "sharding.timeout_s=3")
    assert main(["-q", "train", "--config", str(SYNTHETIC), *sets]) == 1
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(
        "tetrarec train: error: rank 0: joining the gloo process group of 2 ranks failed "
        "within sharding.timeout_s = 3 s"
    )
    assert "DistStoreError: wait timeout" in err


def test_bad_data_line_is_one_line_naming_file_line_and_field(capsys, tmp_path) -> None:
    """A bad Criteo line stops preprocess and train with exit 2 and the reader's message."""
    raw = tmp_path / "day.tsv"
    good = _criteo_line(1, list(range(13)), list(range(26)))
    raw.write_text(good + "\n" + good.replace("\t5\t", "\t5.5\t", 1) + "\n")
    out = tmp_path / "bin"
    argv = ["-q", "preprocess", "criteo", "--input", str(raw), "--output", str(out)]
    assert main([*argv, "--no-progress"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"tetrarec preprocess: error: {raw}, line 2, field I6: ")
    assert not out.exists()
    sets = _sets(*TINY, "data.source=criteo", f"data.train_path={raw}", "model.num_sparse=26")
    assert main(["-q", "train", "--config", str(SYNTHETIC), *sets]) == 2
    assert f"{raw}, line 2, field I6" in _one_line(capsys.readouterr().err)


def test_missing_data_and_config_are_one_line(capsys, tmp_path) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["-q", "train", "--config", str(missing)]) == 2
    assert str(missing) in _one_line(capsys.readouterr().err)
    sets = _sets(*TINY, "data.source=binary", f"data.train_path={tmp_path / 'criteo'}")
    assert main(["-q", "train", "--config", str(SYNTHETIC), *sets]) == 2
    assert str(tmp_path / "criteo") in _one_line(capsys.readouterr().err)


def test_non_finite_loss_is_one_line_and_exit_1(capsys, tmp_path) -> None:
    sets = _sets(
        *TINY,
        "optim.dense=sgd",
        "optim.dense_lr=1e30",
        "optim.warmup_steps=0",
        "optim.decay=none",
        "train.steps=10",
        f"train.checkpoint_dir={tmp_path}",
    )
    assert main(["-q", "train", "--config", str(SYNTHETIC), *sets]) == 1
    err = _one_line(capsys.readouterr().err)
    assert re.match(r"tetrarec train: error: non-finite loss \(\S+\) at step \d+", err)


def test_os_error_is_one_line_and_exit_1(capsys, tmp_path) -> None:
    """A checkpoint directory inside a file: the OSError is reported, not a traceback.
    (A checkpoint directory that is itself a file is a setting refused before
    training, by its key, with exit 2.)"""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    sets = _sets(*TINY, f"train.checkpoint_dir={blocker / 'ck'}", "train.checkpoint_every=1")
    assert main(["-q", "train", "--config", str(SYNTHETIC), *sets]) == 1
    assert str(blocker) in _one_line(capsys.readouterr().err)
    sets = _sets(*TINY, f"train.checkpoint_dir={blocker}", "train.checkpoint_every=1")
    assert main(["-q", "train", "--config", str(SYNTHETIC), *sets]) == 2
    assert f"train.checkpoint_dir='{blocker}' is a file" in _one_line(capsys.readouterr().err)


def test_damaged_checkpoint_is_one_line_and_exit_2(capsys, tmp_path) -> None:
    """``tetrarec eval`` of a checkpoint whose tensors file is cut short: it ended in
    safetensors' own traceback."""
    ckpt = write_checkpoint(
        tmp_path, CheckpointData(step=1, tensors={"w": torch.zeros(64)}, meta={"config": {}})
    )
    tensors = ckpt / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:40])
    assert main(["-q", "eval", "--checkpoint", str(ckpt)]) == 2
    # the manifest's size check finds it first (before safetensors reads the file)
    assert f"{tensors}: damaged checkpoint file" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("key", ["step", "config"])
def test_eval_of_a_checkpoint_whose_meta_lacks_a_key_is_one_line_and_exit_2(
    capsys, tmp_path, key
) -> None:
    """``tetrarec eval`` of a checkpoint whose ``meta.json`` is valid JSON without
    ``step`` or ``config``. Bug caught: a ``KeyError`` traceback and exit 1."""
    ckpt = write_checkpoint(
        tmp_path, CheckpointData(step=1, tensors={"w": torch.zeros(4)}, meta={"config": {}})
    )
    meta_path = ckpt / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta[key]
    meta_path.write_text(json.dumps(meta))
    reseal(ckpt)  # an edit on purpose: past the manifest's check, to the meta's
    assert main(["-q", "eval", "--checkpoint", str(ckpt)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.endswith(f"{meta_path}: damaged checkpoint metadata (no {key!r})")


def test_a_json_path_that_cannot_be_written_is_refused_before_the_work(
    capsys, monkeypatch, tmp_path
) -> None:
    """``--json`` naming a directory, or a path under a file. Bug caught: ``tetrarec
    eval`` evaluated first and then failed to write, "[Errno 21] Is a directory", with
    exit 1 (``train`` refused the same path up front, exit 2)."""
    import tetrarec.train

    def evaluated(*args, **kwargs):
        raise AssertionError("evaluated before refusing --json")

    monkeypatch.setattr(tetrarec.train, "evaluate_checkpoint", evaluated)
    (tmp_path / "afile").write_text("")
    for path, problem in (
        (tmp_path, "is a directory; give a file path"),
        (tmp_path / "afile" / "m.json", f"{str(tmp_path / 'afile')!r} is a file, not a directory"),
    ):
        for argv in (["eval", "--checkpoint", str(tmp_path)], ["demo", *_sets(*TINY)]):
            assert main(["-q", *argv, "--json", str(path)]) == 2, argv
            err = _one_line(capsys.readouterr().err)
            assert err.startswith(f"tetrarec {argv[0]}: error: --json {str(path)!r}"), err
            assert err.endswith(problem), err


def test_bad_kernels_setting_is_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setenv("TETRAREC_KERNELS", "fastest")
    assert main(["-q", "demo", *_sets(*TINY)]) == 2
    assert "TETRAREC_KERNELS='fastest'" in _one_line(capsys.readouterr().err)


def test_kernel_build_failure_under_compiled_is_one_line_and_exit_1(tmp_path) -> None:
    """With TETRAREC_KERNELS=compiled and a compiler that fails on the sources (a fresh
    build cache), ``tetrarec demo`` exits 1 with one line naming the compiler's error,
    before any training: it used to end in a RuntimeError traceback holding the whole
    compiler output."""
    real = shutil.which("c++")
    if real is None:
        pytest.skip("no c++ to answer the compiler checks that precede a build")
    fake = tmp_path / "c++"
    fake.write_text(
        "#!/bin/sh\n"  # version queries go to the real compiler; every compile fails
        'for a in "$@"; do case "$a" in --version|-v|-dumpversion|-dumpfullversion|-E)\n'
        f'  exec {real} "$@";; esac; done\n'
        "echo \"tbe_cpu.cpp:12:3: error: 'simulated' was not declared\" >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    env = dict(os.environ)
    env.update(TETRAREC_KERNELS="compiled", CXX=str(fake), XDG_CACHE_HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tetrarec", "-q", "demo", *_sets(*TINY)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    err = _one_line(proc.stderr)
    assert err.startswith("tetrarec demo: error: building tetrarec CPU kernels failed")
    assert "error: 'simulated' was not declared" in err
    assert "TETRAREC_KERNELS=compiled" in err
    assert proc.stdout == ""  # no training ran


# -- the README's second Criteo example: the shared sample as it is -----------------------


@pytest.mark.parametrize(
    ("config", "source", "eval_rows"),
    [
        ("examples/criteo_kaggle_sample.toml", "criteo", 12_584 - 8_000),
        ("examples/criteo_kaggle_sample_dcn.toml", "criteo", 12_584 - 8_000),
        ("examples/criteo_1tb_sample.toml", "criteo", 1_000 - 600),
        ("examples/criteo_1tb_sample_dcn.toml", "criteo", 1_000 - 600),
        ("examples/avazu_sample.toml", "csv", 8_999 - 7_199),
        ("examples/avazu_sample_dcn.toml", "csv", 8_999 - 7_199),
    ],
)
def test_real_data_recipes_train_as_written(
    capsys, monkeypatch, tmp_path, shared_data, config, source, eval_rows
):
    """README: ``tetrarec train --config examples/<recipe>.toml``, run from the repository
    root, reads ../shared/data's raw sample (no preprocessing). Here 2 steps with the
    recipe's own data settings; a wrong path, source, column or row range fails."""
    del shared_data  # skips when ../shared/data is absent
    monkeypatch.chdir(REPO)
    out = tmp_path / "run.json"
    sets = _sets(
        "train.epochs=none",
        "train.steps=2",
        "train.eval_every=0",
        "train.early_stop_patience=0",
        "train.progress=false",
        f"train.checkpoint_dir={tmp_path / 'ck'}",
    )
    assert main(["-q", "train", "--config", config, *sets, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 2
    assert summary["final"]["num_samples"] == eval_rows  # the held-out rows
    assert summary["config"]["data"]["source"] == source
    _assert_printed_metrics_are(capsys.readouterr().out.splitlines()[0], summary["final"])
    assert torch.isfinite(torch.tensor(summary["final"]["log_loss"]))


def test_train_parquet_paths_and_quoted_dir_from_set_then_eval_the_best(
    capsys, tmp_path, monkeypatch
) -> None:
    """The two reported ``--set`` bugs and the best checkpoint, end to end: a Parquet
    config whose paths come only from ``--set`` trains (it failed with "train_path is
    needed"); ``train.checkpoint_dir="out/ck"`` writes under ``out/ck`` (it wrote
    under a directory literally named ``"out``); the printed best line is the JSON's
    best, and ``eval --checkpoint out/ck/best`` scores exactly those metrics."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(0)
    n = 160
    pq.write_table(
        pa.table(
            {
                "y": rng.integers(0, 2, n),
                "x": rng.random(n),
                "C1": rng.integers(0, 20, n),
                "C2": rng.integers(0, 20, n),
            }
        ),
        tmp_path / "rows.parquet",
    )
    config = tmp_path / "run.toml"
    config.write_text(
        '[data]\nsource = "parquet"\ndense_columns = ["x"]\nsparse_columns = ["C1", "C2"]\n'
        'label_column = "y"\nbatch_size = 32\neval_batch_size = 64\n'
        "train_rows = [0, 128]\neval_rows = [128, 160]\n"
        "[model]\nnum_sparse = 2\nnum_embeddings = 20\n"
        "[model.dlrm]\nnum_dense = 1\nbottom_mlp = [8, 4]\ntop_mlp = [8, 1]\n"
        "[train]\nsteps = 4\nprogress = false\nthreads = 1\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run.json"
    sets = _sets(
        'data.train_path=["rows.parquet"]',
        'train.checkpoint_dir="out/ck"',
        "train.keep_best=log_loss",
        "train.eval_every=1",
    )
    assert main(["-q", "train", "--config", str(config), *sets, "--json", str(out)]) == 0
    assert (tmp_path / "out" / "ck" / "best").is_dir()
    assert not [p.name for p in tmp_path.iterdir() if '"' in p.name]
    printed = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out.read_text())
    best = summary["best"]
    assert summary["best_checkpoint"] == f"out/ck/step_{best['step']:08d}"
    line = next(ln for ln in printed if ln.startswith("best "))
    assert line.startswith(f"best log_loss at step {best['step']}: ")
    assert line.endswith(f"checkpoint {summary['best_checkpoint']}")
    _assert_printed_metrics_are(line, best)

    ev = tmp_path / "eval.json"
    assert main(["-q", "eval", "--checkpoint", "out/ck/best", "--json", str(ev)]) == 0
    scored = json.loads(ev.read_text())
    assert scored.pop("checkpoint") == "out/ck/best"
    assert scored == {k: v for k, v in best.items() if k not in ("metric", "step")}


def test_sigterm_exits_143_and_deletes_the_ssd_scratch_files(tmp_path) -> None:
    """SIGTERM (what torchrun sends the other ranks when one fails, and schedulers send
    at a time limit) killed the process at once: no message, and an ``ssd`` table's
    scratch directory left behind on the disk. It now unwinds like Ctrl-C, after
    checkpointing the step it was in (one line says which)."""
    ssd = tmp_path / "ssd"
    cmd = [
        sys.executable, "-m", "tetrarec", "-q", "train", "--config", str(SYNTHETIC),
        *_sets(*TINY, "train.steps=1000000", "model.placement=ssd", "model.precision=int8",
               "model.cache.fraction=0.1", f"model.cache.dir={ssd}",
               f"train.checkpoint_dir={tmp_path / 'ckpt'}"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(proc, ssd, "tetrarec-ssd-*", 240, "the run never made its SSD files")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert re.fullmatch(
        r"tetrarec train: SIGTERM: stopped after step \d+; checkpoint .*ckpt/step_\d{8}",
        _one_line(err),
    ), err
    assert list(ssd.glob("tetrarec-ssd-*")) == []


_SLOW_BENCH = """
import pathlib, sys, tempfile, time
sys.path.insert(0, {bench!r})
from _harness import unwind_on_signals

with (
    unwind_on_signals("bench_slow"),
    tempfile.TemporaryDirectory(prefix="tetrarec-quality-", dir=sys.argv[1]) as scratch,
):
    try:
        (pathlib.Path(scratch) / "ready").write_text("")
        time.sleep(120)
    finally:
        time.sleep(1.0)  # a cleanup that takes a while (many checkpoints to delete)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("stop", "status", "said"),
    [("ctrl-c", 130, "interrupted"), ("sigterm", 143, "terminated (SIGTERM)")],
)
def test_a_stopped_bench_deletes_its_scratch_before_exiting(tmp_path, stop, status, said) -> None:
    """Bug caught: ``tetrarec bench`` ran the script with ``subprocess.call``, which
    SIGKILLs the child on Ctrl-C before its cleanup runs, and on SIGTERM never told the
    child at all: ``bench quality``'s ``tetrarec-quality-*`` scratch (15+ MB) was left
    in TMPDIR. Now the child unwinds (SIGTERM forwarded) and is waited for.

    Real processes: ``tetrarec bench slow`` -> a bench script on the real harness whose
    cleanup takes a second. Ctrl-C is SIGINT to the whole process group, as a terminal
    sends it; SIGTERM goes to the ``tetrarec`` process alone, as a scheduler sends it.
    """
    tree, scratch = tmp_path / "tree", tmp_path / "scratch"
    (tree / "benchmarks").mkdir(parents=True)
    scratch.mkdir()
    script = _SLOW_BENCH.format(bench=str(REPO / "benchmarks"))
    (tree / "benchmarks" / "bench_slow.py").write_text(script)
    # The tetrarec command with its benchmarks folder pointed at the tree above.
    run = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import tetrarec.cli as cli, pathlib; cli._REPO_ROOT = pathlib.Path(sys.argv[1]); "
        "sys.exit(cli.main(sys.argv[2:]))"
    )
    cmd = [sys.executable, "-c", run, str(tree), "-q", "bench", "slow", str(scratch)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(proc, scratch, "tetrarec-quality-*/ready", 120, "the bench never started")
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, err
    assert err.strip().splitlines()[-1] == f"tetrarec bench: {said}"
    assert list(scratch.iterdir()) == []
