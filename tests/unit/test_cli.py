import json
from pathlib import Path

import pytest

from tetrarec.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))

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
    "optim.warmup_steps=1",
    "optim.decay_start=1",
    "optim.decay_steps=1",
    "train.steps=2",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
]


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def test_demo_at_tiny_size_prints_auc_ne_and_rate(capsys, tmp_path) -> None:
    out = tmp_path / "demo.json"
    code = main(["-q", "demo", "--json", str(out), *_sets(*TINY)])
    assert code == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("AUC ")
    assert " NE " in line
    assert "samples/s" in line
    assert json.loads(out.read_text())["steps"] == 2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_train_every_example_at_tiny_size_then_eval_and_resume(capsys, tmp_path, example) -> None:
    out = tmp_path / "run.json"
    sets = _sets(*TINY, f"train.checkpoint_dir={tmp_path / 'ck'}")
    assert main(["-q", "train", "--config", str(example), *sets, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 2
    assert set(summary["final"]) >= {"auc", "ne", "log_loss"}
    assert "samples/s" in capsys.readouterr().out
    ckpt = summary["checkpoint"]
    assert Path(ckpt).name == "step_00000002"

    ev = tmp_path / "eval.json"
    assert main(["-q", "eval", "--checkpoint", ckpt, "--json", str(ev)]) == 0
    assert "AUC" in capsys.readouterr().out
    assert json.loads(ev.read_text())["auc"] == summary["final"]["auc"]

    more = _sets(*TINY, f"train.checkpoint_dir={tmp_path / 'ck'}", "train.steps=3")
    assert main(["-q", "train", "--config", str(example), *more, "--resume"]) == 0


def test_unknown_key_lists_valid_keys(capsys, tmp_path) -> None:
    code = main(["-q", "train", "--config", str(EXAMPLES[0]), "--set", "train.stepz=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown config key train.stepz" in err
    assert "valid keys of train: steps" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nnum_tables = 3\n")
    assert main(["-q", "train", "--config", str(bad)]) == 2
    assert "valid keys of model: num_sparse" in capsys.readouterr().err


def test_preprocess_criteo(capsys, tmp_path) -> None:
    dense = "\t".join(str(i) for i in range(13))
    cats = "\t".join(f"{i:08x}" for i in range(26))
    raw = tmp_path / "day.tsv"
    raw.write_text(f"1\t{dense}\t{cats}\n0\t{dense}\t{cats}\n")
    out = tmp_path / "bin"
    assert (
        main(
            [
                "-q",
                "preprocess",
                "criteo",
                "--input",
                str(raw),
                "--output",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert out.is_dir()
    assert capsys.readouterr().out.strip()


def test_bench_unknown_name_is_a_clear_error(capsys) -> None:
    assert main(["-q", "bench", "no_such_thing"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'no_such_thing'" in err
    assert "available:" in err
    assert "criteo_real" in err


def test_bench_runs_the_script_with_its_args() -> None:
    assert main(["-q", "bench", "criteo_real", "--help"]) == 0
