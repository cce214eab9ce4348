from pathlib import Path

import pytest

from tetrarec.config import DecayKind, EmbeddingKind, ModelConfig, RunConfig
from tetrarec.types import OptimizerKind

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))


def test_defaults_round_trip_through_dict() -> None:
    c = RunConfig()
    assert RunConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_and_round_trips(path: Path) -> None:
    c = RunConfig.from_toml(path)
    assert RunConfig.from_dict(c.to_dict()) == c
    assert len(c.model.table_rows) == c.model.num_sparse


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"criteo_kaggle.toml", "dlrm_dcnv2_small.toml"}


def test_from_toml_converts_types(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text(
        '[model]\nnum_sparse = 2\nnum_embeddings = [10, 20]\nembedding = "fused"\n'
        "[model.dlrm]\nbottom_mlp = [8, 4]\ntop_mlp = [4, 1]\n"
        '[optim]\ndecay = "cosine"\ndecay_steps = 5\ndense_lr = 1\n'
        '[optim.sparse]\nkind = "ADAM"\n'
        "[data]\ntrain_rows = [0, 100]\n"
    )
    c = RunConfig.from_toml(f)
    assert c.model.table_rows == (10, 20)
    assert c.model.embedding is EmbeddingKind.FUSED
    assert c.model.embedding_dim == 4
    assert c.optim.decay is DecayKind.COSINE
    assert c.optim.dense_lr == 1.0
    assert isinstance(c.optim.dense_lr, float)
    assert c.optim.sparse.kind is OptimizerKind.ADAM
    assert c.data.train_rows == (0, 100)


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ("[train]\nstepz = 3\n", r"unknown config key train\.stepz; valid keys of train: steps, "),
        (
            "[tarin]\n",
            r"unknown config key tarin; valid keys of the top level: data, model, optim, train",
        ),
        (
            "[model.dlrm]\nbottom = [1]\n",
            r"model\.dlrm\.bottom; valid keys of model\.dlrm: num_dense",
        ),
        ("[optim.sparse]\nlearning_rate = 1.0\n", r"valid keys of optim\.sparse: kind, lr"),
        ("[data.synthetic]\nrows = 1\n", r"valid keys of data\.synthetic: num_samples"),
        ("[train]\nsteps = 1.5\n", r"train\.steps: expected int, got 1\.5"),
        ("[train]\ndeterministic = 1\n", r"train\.deterministic: expected bool, got 1"),
        ('[optim]\ndecay = "step"\n', r"optim\.decay: 'step' is not one of none, linear, cosine"),
        ("[model]\nnum_sparse = 3\nnum_embeddings = [1, 2]\n", r"3 positive ints"),
        ("[train]\nsteps = -1\n", r"steps.*-1"),
    ],
)
def test_strictness(tmp_path: Path, toml: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with pytest.raises(ValueError, match=match) as e:
        RunConfig.from_toml(f)
    assert str(f) in str(e.value)


def test_overrides_parse_with_field_types() -> None:
    c = RunConfig().with_overrides(
        [
            "train.steps=10",
            "train.checkpoint_dir=123",  # a str field keeps the text
            "model.dlrm.bottom_mlp=[64, 16]",
            "model.dlrm.top_mlp=32,1",
            "model.num_sparse=2",
            "model.num_embeddings=[5, 6]",
            "optim.sparse.kind=adam",
            "optim.dense_lr=1e-3",
            "train.deterministic=true",
            "data.train_rows=[0, 10]",
            "data.train_path=/data/day_0.tsv.gz",  # a bare path for a list field
            "data.eval_path=a.tsv,b.tsv",
        ]
    )
    assert c.train.steps == 10
    assert c.train.checkpoint_dir == "123"
    assert c.model.dlrm.bottom_mlp == (64, 16)
    assert c.model.dlrm.top_mlp == (32, 1)
    assert c.model.table_rows == (5, 6)
    assert c.optim.sparse.kind is OptimizerKind.ADAM
    assert c.optim.dense_lr == 1e-3
    assert c.train.deterministic is True
    assert c.data.train_rows == (0, 10)
    assert c.data.train_path == ("/data/day_0.tsv.gz",)
    assert c.data.eval_path == ("a.tsv", "b.tsv")
    assert c.with_overrides(["train.checkpoint_dir=none"]).train.checkpoint_dir is None


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.stepz=1", r"unknown config key train\.stepz; valid keys of train: steps"),
        ("trian.steps=1", r"unknown config key trian; valid keys of the top level"),
        ("model.dlrm=3", r"model\.dlrm is a section"),
        ("train.steps.x=3", r"train\.steps is a value"),
        ("train.steps", r"not of the form section\.key=value"),
        ("train.steps=ten", r"train\.steps: expected int, got 'ten'"),
        ("model.embedding=gpu", r"'gpu' is not one of reference, fused"),
    ],
)
def test_override_errors(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig().with_overrides([override])


def test_model_config_table_rows() -> None:
    assert ModelConfig(num_sparse=3, num_embeddings=7).table_rows == (7, 7, 7)
