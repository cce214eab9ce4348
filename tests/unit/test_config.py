from pathlib import Path

import pytest

from tetrarec.cache import CachePolicy
from tetrarec.config import (
    DEFAULT_STEPS,
    BestMetric,
    DecayKind,
    EmbeddingKind,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from tetrarec.data import BadLinePolicy, DataSource, DenseKind
from tetrarec.types import OptimizerKind, Placement, ShardingType

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
        # an ``enum | tuple[enum, ...]`` field: one bad name, and a bad item of a list
        ("model.placement=foo", r"^model\.placement: 'foo' is not one of [a-z, ]*$"),
        ("model.placement=[host, foo]", r"^model\.placement\[1\]: 'foo' is not one of"),
        ("model.dlrm.bottom_mlp=[64, x]", r"^model\.dlrm\.bottom_mlp\[1\]: expected int, got 'x'$"),
        ('data.eval_path=["a.tsv", ""]', r"eval_path has an empty entry"),
        # bug caught: a list of another length was found only under torchrun, at launch
        ("sharding.type=[row_wise, table_wise]", r"sharding\.type must be one .* or 26 .* got 2"),
        ("data.dense_columns=a,,b", r"dense_columns has an empty entry"),
    ],
)
def test_override_errors(override: str, match: str) -> None:
    """Bugs caught (the last three): a bad enum name for a field that also takes a list
    added "expected a list, got 'foo'" to the message, and a list with one bad item
    was named as a whole ("'[host, foo]' is not one of ...") instead of by its item."""
    with pytest.raises(ValueError, match=match):
        RunConfig().with_overrides([override])


def test_model_config_table_rows() -> None:
    assert ModelConfig(num_sparse=3, num_embeddings=7).table_rows == (7, 7, 7)


# One row per kind of field: (overrides applied in order, the field's dotted path, the
# value it must hold). TOML syntax is read first for every type; plain text second.
FIELD_KINDS = [
    (["train.steps=10"], "train.steps", 10),  # int (optional: int | None)
    (["optim.dense_lr=1e-3"], "optim.dense_lr", 1e-3),  # float
    (["optim.dense_lr=2"], "optim.dense_lr", 2.0),  # an int for a float field
    (["train.deterministic=true"], "train.deterministic", True),  # bool
    (['data.label_column="click"'], "data.label_column", "click"),  # str, TOML string
    (["data.label_column='a\\b'"], "data.label_column", "a\\b"),  # TOML literal string
    (["data.label_column=click"], "data.label_column", "click"),  # str, bare
    (["data.label_column=123"], "data.label_column", "123"),  # str that reads as an int
    (['train.checkpoint_dir="out/ck"'], "train.checkpoint_dir", "out/ck"),  # optional str
    (["train.checkpoint_dir=out/ck"], "train.checkpoint_dir", "out/ck"),
    (['train.checkpoint_dir="none"'], "train.checkpoint_dir", "none"),  # quoted: the text
    (["train.checkpoint_dir=x", "train.checkpoint_dir=none"], "train.checkpoint_dir", None),
    (["model.dlrm.seed=3", "model.dlrm.seed=null"], "model.dlrm.seed", None),  # optional int
    (["optim.sparse.kind=adam"], "optim.sparse.kind", OptimizerKind.ADAM),  # enum, bare
    (['optim.sparse.kind="ADAM"'], "optim.sparse.kind", OptimizerKind.ADAM),  # enum, TOML
    (["train.keep_best=log_loss"], "train.keep_best", BestMetric.LOG_LOSS),  # optional enum
    (["train.keep_best=auc", "train.keep_best=none"], "train.keep_best", None),
    (["data.train_rows=[0, 10]"], "data.train_rows", (0, 10)),  # fixed tuple of ints
    (["model.dlrm.top_mlp=32,1"], "model.dlrm.top_mlp", (32, 1)),  # tuple of ints, commas
    (['data.eval_path=["a b.tsv", "c.tsv"]'], "data.eval_path", ("a b.tsv", "c.tsv")),
    (["data.eval_path=a.tsv,b.tsv"], "data.eval_path", ("a.tsv", "b.tsv")),  # tuple of str
    (['data.eval_path="x y.tsv"'], "data.eval_path", ("x y.tsv",)),  # one quoted path
    (["data.eval_path=/d/day_0.tsv.gz"], "data.eval_path", ("/d/day_0.tsv.gz",)),  # bare
    (
        ["model.num_sparse=2", 'sharding.type=["row_wise", "table_wise"]'],  # tuple of enums
        "sharding.type",
        (ShardingType.ROW_WISE, ShardingType.TABLE_WISE),
    ),
    (
        ["model.num_sparse=2", "sharding.type=[row_wise, data_parallel]"],  # bare items
        "sharding.type",
        (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL),
    ),
    (["sharding.type=row_wise"], "sharding.type", ShardingType.ROW_WISE),  # the enum arm
    # bugs caught: ".5" refused for a float, "none" and "" read as a path or column named
    # so, and the data section's choices refused in capitals that the others took
    (["optim.dense_lr=.5"], "optim.dense_lr", 0.5),
    (["optim.dense_lr=5."], "optim.dense_lr", 5.0),
    (["data.eval_path=a.tsv", "data.eval_path=none"], "data.eval_path", ()),
    (["data.eval_path=a.tsv", "data.eval_path="], "data.eval_path", ()),
    (["data.on_bad_line=Skip"], "data.on_bad_line", BadLinePolicy.SKIP),
    (["data.dense_transform=LOG1P"], "data.dense_transform", DenseKind.LOG1P),
    (
        [
            "data.source=CSV",
            "data.train_path=a.csv",
            "data.sparse_columns=C1",
            "model.num_sparse=1",
        ],
        "data.source",
        DataSource.CSV,
    ),
    (["model.num_embeddings=1000"], "model.num_embeddings", 1000),  # int | tuple: int
    (
        ["model.num_sparse=2", "model.num_embeddings=[5, 6]"],  # int | tuple: tuple
        "model.num_embeddings",
        (5, 6),
    ),
    (["model.num_sparse=2", "model.num_embeddings=5,6"], "model.num_embeddings", (5, 6)),
    (["model.dlrm.bottom_mlp=[64, 16]"], "model.dlrm.bottom_mlp", (64, 16)),  # nested key
    (["model.dlrm.dropout=0.25"], "model.dlrm.dropout", 0.25),
    (["train.epochs=0.5"], "train.epochs", 0.5),  # optional float
]


@pytest.mark.parametrize(("overrides", "key", "want"), FIELD_KINDS, ids=lambda v: str(v))
def test_override_of_each_kind_of_field(overrides: list[str], key: str, want: object) -> None:
    """Bugs caught: a quoted string keeping its quotes (``train.checkpoint_dir="out/ck"``
    wrote under a directory named ``"out``), a bare string that reads as a number
    refused, ``none`` not clearing an optional field, a bare enum for an
    ``enum | tuple`` field read as a one-item tuple, and list fields that take only one
    of the documented spellings."""
    c = RunConfig().with_overrides(overrides)
    value: object = c
    for part in key.split("."):
        value = getattr(value, part)
    assert value == want
    assert type(value) is type(want)


def test_from_toml_validates_the_file_merged_with_the_overrides(tmp_path: Path) -> None:
    """The reported bug: a Parquet run whose paths come only from ``--set`` failed with
    "train_path is needed", because the file was validated alone before the overrides
    applied. The merged config is validated; errors still name the file."""
    f = tmp_path / "run.toml"
    f.write_text(
        '[data]\nsource = "parquet"\nsparse_columns = ["C1", "C2"]\n'
        "[model]\nnum_sparse = 2\n[train]\nsteps = 5\n"
    )
    with pytest.raises(ValueError, match="train_path is needed") as e:
        RunConfig.from_toml(f)
    assert str(f) in str(e.value)
    c = RunConfig.from_toml(f, ['data.train_path=["a.parquet", "b.parquet"]', "train.steps=7"])
    assert c.data.train_path == ("a.parquet", "b.parquet")
    assert c.train.steps == 7
    assert c.data.sparse_columns == ("C1", "C2")  # the file's values stay
    with pytest.raises(ValueError, match=r"train\.stepz") as e:
        RunConfig.from_toml(f, ["data.train_path=a.parquet", "train.stepz=1"])
    assert f"{f} with the --set overrides" in str(e.value)
    with pytest.raises(ValueError, match=r"train\.steps: expected int, got 1\.5") as e:
        RunConfig.from_toml(f, ["data.train_path=a.parquet", "train.steps=1.5"])
    assert str(f) in str(e.value)


def test_train_steps_or_epochs() -> None:
    """Bugs caught: both accepted (which one wins?), a default that is not 1000 for
    existing configs, and epochs rounded against the loader (whose epoch drops the last
    partial batch) or through binary floating point (0.1 * 30 = 3.0000000000000004)."""
    assert TrainConfig().resolve_steps(10**6, 10) == DEFAULT_STEPS == 1000
    assert TrainConfig(steps=7).resolve_steps(10**6, 10) == 7
    assert TrainConfig(epochs=2).resolve_steps(128, 32) == 8
    assert TrainConfig(epochs=1).resolve_steps(130, 32) == 4  # 4 full batches per epoch
    assert TrainConfig(epochs=0.1).resolve_steps(3000, 100) == 3
    assert TrainConfig(epochs=1.5).resolve_steps(130, 32) == 6
    assert TrainConfig(epochs=0.3).resolve_steps(130, 32) == 2  # 1.2 steps: rounded up
    assert TrainConfig(epochs=1e-6).resolve_steps(130, 32) == 1  # at least one step
    with pytest.raises(ValueError, match="no full batch"):
        TrainConfig(epochs=1).resolve_steps(20, 32)
    with pytest.raises(ValueError, match=r"train\.steps \(5\) or train\.epochs \(2\.0\)"):
        RunConfig().with_overrides(["train.steps=5", "train.epochs=2"])
    c = RunConfig().with_overrides(["train.steps=5", "train.steps=none", "train.epochs=2"])
    assert (c.train.steps, c.train.epochs) == (None, 2.0)
    for bad in ("train.epochs=0", "train.epochs=-1", "train.epochs=inf"):
        with pytest.raises(ValueError, match="epochs"):
            RunConfig().with_overrides([bad])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["train.early_stop_patience=2"], r"needs train\.keep_best .*got none"),
        (
            ["train.early_stop_patience=2", "train.keep_best=auc"],
            r"train\.eval_every > 0 \(got 0\)",
        ),
        (["train.keep_best=accuracy"], r"'accuracy' is not one of auc, log_loss"),
        (["train.early_stop_patience=-1"], r"early_stop_patience"),
        (["model.dlrm.dropout=1.0"], r"dropout must be in \[0, 1\), got 1\.0"),
        # numpy's seeding would refuse these later, in a message naming no setting
        (["train.seed=-1"], r"bad train settings \{'seed': -1\}"),
        (["train.seed=4294967296"], r"bad train settings \{'seed': 4294967296\}"),
        # each bad optim setting with its own rule (every one said "decay needs
        # decay_steps > 0")
        (["optim.warmup_steps=-1"], r"\{'warmup_steps': -1\} \(warmup_steps >= 0\)$"),
        (["optim.min_lr_scale=1.5"], r"\(min_lr_scale in \[0, 1\]\)$"),
        (["optim.decay=cosine"], r"\(decay = cosine needs decay_steps > 0\)$"),
        # the bad key by name, not the whole SparseOptimizerSpec(...) printed
        (["optim.sparse.eps=0"], r"optim\.sparse: bad sparse optimizer settings \{'eps': 0\.0\}"),
        # Adam's betas outside [0, 1) and an infinite lr were accepted (NaN rows later)
        (
            ["optim.sparse.beta1=1.5"],
            r"bad sparse optimizer settings \{'betas': \(1\.5, 0\.999\)\}",
        ),
        (["optim.sparse.lr=inf"], r"bad sparse optimizer settings \{'lr': inf\}"),
        # nan passed the "< 0" checks and inf was no error: a run failed later on a
        # non-finite loss, or in torch's "Invalid learning rate: nan" naming no key
        (["optim.dense_lr=inf"], r"bad optim settings \{'dense_lr': inf\}"),
        (["optim.dense_lr=nan"], r"bad optim settings \{'dense_lr': nan\}"),
        (["optim.dense_eps=nan"], r"\{'dense_eps': nan\} \(dense_eps > 0 and finite\)$"),
        (["optim.dense_weight_decay=inf"], r"\{'dense_weight_decay': inf\}"),
        (["sharding.timeout_s=nan"], r"timeout_s=nan"),
        (["sharding.timeout_s=inf"], r"timeout_s=inf"),
        (["model.dlrm.first_order_lr=nan"], r"first_order_lr and .* finite, got nan"),
        # torch failed to start the threads (a segmentation fault) or overflowed
        (["train.threads=100000"], r"bad train settings \{'threads': 100000\}"),
        # a Precision member the row kernels refuse: refused here, naming the key
        (["model.precision=fp8"], r"model\.precision 'fp8' is not a row precision; valid: fp32,"),
    ],
)
def test_train_quality_settings_are_checked(overrides: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig().with_overrides(overrides)
    ok = RunConfig().with_overrides(
        ["train.keep_best=auc", "train.eval_every=5", "train.early_stop_patience=2"]
    )
    assert ok.train.early_stop_patience == 2


def test_model_cache_section_and_per_table_placement(tmp_path: Path) -> None:
    """``[model.cache]`` and ``model.placement`` load, round-trip and build the spec.

    Catches: a per-table placement list not read, or ``dir`` not reaching the spec.
    """
    path = tmp_path / "run.toml"
    path.write_text(
        "[model]\nnum_sparse = 3\nnum_embeddings = 10\nprecision = 'int8'\n"
        "placement = ['cached', 'host', 'ssd']\n"
        "[model.cache]\npolicy = 'lfu'\nbytes = 4096\ndir = 'ssd-files'\n"
    )
    c = RunConfig.from_toml(path)
    assert c.model.table_placements == (Placement.CACHED, Placement.HOST, Placement.SSD)
    assert c.model.cached
    spec = c.model.cache.spec()
    assert (spec.policy, spec.bytes, spec.directory) == (CachePolicy.LFU, 4096, "ssd-files")
    assert RunConfig.from_dict(c.to_dict()) == c
    assert not RunConfig().model.cached  # default: host, no cache section needed


def test_static_cache_policy_loads_with_its_sample_size(tmp_path: Path) -> None:
    """``policy = 'static'`` with ``static_sample_batches`` loads and round-trips (the
    trainer counts the sample). Catches: the old refusal of ``static`` in a run config,
    the sample size not read or not kept by ``to_dict``, and a default that is not 100."""
    path = tmp_path / "run.toml"
    path.write_text(
        "[model]\nnum_sparse = 2\nnum_embeddings = 10\nplacement = 'cached'\n"
        "[model.cache]\npolicy = 'static'\nfraction = 0.2\nstatic_sample_batches = 7\n"
    )
    c = RunConfig.from_toml(path)
    assert c.model.cache.spec().policy is CachePolicy.STATIC
    assert c.model.cache.static_sample_batches == 7
    assert RunConfig.from_dict(c.to_dict()) == c
    assert RunConfig().model.cache.static_sample_batches == 100


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model.placement=cached"], "model.cache: give exactly one of fraction"),
        (
            ["model.placement=cached", "model.cache.fraction=0.1", "model.cache.bytes=10"],
            "model.cache: give exactly one of fraction",
        ),
        (["model.placement=cached", "model.cache.fraction=2"], r"model.cache.fraction .*\[0, 1\]"),
        (["model.placement=device"], "'device' is not a run placement.*valid: host, cached, ssd"),
        (["model.placement=disk"], "'disk' is not one of device, host, cached, ssd"),
        (
            ["model.num_sparse=2", "model.num_embeddings=5", "model.placement=[host]"],
            "model.placement must be one placement or 2",
        ),
        (
            ["model.placement=cached", "model.cache.fraction=0.1", "model.embedding=reference"],
            "need model.embedding = 'fused'",
        ),
        (
            ["model.cache.policy=static", "model.cache.static_sample_batches=0"],
            r"model.cache.static_sample_batches must be >= 1 .*got 0",
        ),
        (["model.cache.policy=mru"], "'mru' is not one of lru, lfu, static"),
    ],
)
def test_model_cache_errors_name_the_field(overrides: list[str], match: str) -> None:
    """Catches: a cached placement without a cache size, or errors that do not say which
    key is wrong and what is valid."""
    with pytest.raises(ValueError, match=match):
        RunConfig().with_overrides(overrides)


def test_a_directory_for_the_config_is_bad_input(tmp_path) -> None:
    """Bug caught: `tetrarec train --config /tmp` failed as "[Errno 21] Is a directory",
    an OSError, with the exit status of a failed run (1) instead of bad input (2)."""
    with pytest.raises(ValueError, match=r"is a directory; give the run's TOML file"):
        RunConfig.from_toml(tmp_path)


def test_every_path_field_expands_a_leading_tilde(tmp_path: Path, monkeypatch) -> None:
    """Bug caught: no shell expands ``~`` inside a TOML file or after ``--set key=``, so
    ``checkpoint_dir = "~/ck"`` wrote to a directory named ``~`` in the working
    directory (and so did every other path field). A ``~`` inside a path stays."""
    monkeypatch.setenv("HOME", str(tmp_path))
    f = tmp_path / "run.toml"
    f.write_text(
        '[data]\nsource = "parquet"\ntrain_path = ["~/a.parquet", "x/~b.parquet"]\n'
        'sparse_columns = ["C1", "C2"]\n'
        'eval_path = ["~/e.parquet"]\n[model]\nnum_sparse = 2\n'
        '[model.cache]\ndir = "~/ssd"\n'
        '[train]\ncheckpoint_dir = "~/ck"\njson = "~/s.json"\ntensorboard_dir = "~/tb"\n'
        '[sharding]\nplan = "~/plan.json"\nstats = "~/stats.json"\n'
    )
    c = RunConfig.from_toml(f)
    assert c.data.train_path == (f"{tmp_path}/a.parquet", "x/~b.parquet")
    assert c.data.eval_path == (f"{tmp_path}/e.parquet",)
    assert c.model.cache.dir == f"{tmp_path}/ssd"
    assert (c.train.checkpoint_dir, c.train.json, c.train.tensorboard_dir) == (
        f"{tmp_path}/ck",
        f"{tmp_path}/s.json",
        f"{tmp_path}/tb",
    )
    assert (c.sharding.plan, c.sharding.stats) == (
        f"{tmp_path}/plan.json",
        f"{tmp_path}/stats.json",
    )
    o = RunConfig().with_overrides(["train.checkpoint_dir=~/other", "model.cache.dir=none"])
    assert o.train.checkpoint_dir == f"{tmp_path}/other"
    assert o.model.cache.dir is None


def test_num_sparse_beyond_any_model_is_refused_before_filling_memory() -> None:
    """``model.num_sparse = 2**62`` (found by tests/fuzz/test_fuzz_config.py) built
    per-table lists of that length while validating: the process was killed for its
    memory instead of refusing the value (10**8 took 14 s)."""
    with pytest.raises(
        ValueError, match=rf"^model\.num_sparse must be at most 65536, got {2**62}$"
    ):
        RunConfig.from_dict({"model": {"num_sparse": 2**62}})
