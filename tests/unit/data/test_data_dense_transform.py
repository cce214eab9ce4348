"""Dense transforms: fitted on the training rows only, applied identically everywhere."""

import json
import logging
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.data import (
    DataConfig,
    DataError,
    DenseKind,
    DenseSpec,
    DenseTransform,
    SyntheticConfig,
    SyntheticDataset,
    TransformedDataset,
    build_datasets,
    dense_transform,
    open_binary,
    preprocess_criteo,
)
from tetrarec.data.datasets import ColumnsDataset
from tetrarec.embedding import TableConfig

CRITEO_TABLES = [TableConfig(name=f"C{i}", num_embeddings=50, dim=4) for i in range(1, 27)]
PQ_TABLES = [TableConfig(name="c", num_embeddings=20, dim=4)]


def criteo_lines(raw_dense: np.ndarray) -> list[str]:
    """One Criteo line per row of ``raw_dense`` (n, 13) int; 0 is written as missing."""
    lines = []
    for i, row in enumerate(raw_dense):
        dense = ["" if v == 0 else str(int(v)) for v in row]
        lines.append("\t".join([str(i % 2), *dense, *[f"{i * 7 + c:08x}" for c in range(26)]]))
    return lines


def criteo_file(path: Path, raw_dense: np.ndarray) -> Path:
    path.write_text("\n".join(criteo_lines(raw_dense)) + "\n")
    return path


def raw_dense_rows(n: int, seed: int = 0) -> np.ndarray:
    """Counts of very different scales, negatives and missing values, all < 2**24."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(0, 7, size=13)
    raw = np.floor(rng.exponential(scale, size=(n, 13))).astype(np.int64)
    raw[:, 1] -= 3  # Criteo's I2 goes negative
    raw[rng.random((n, 13)) < 0.2] = 0  # missing
    raw[0, :4] = [2**24 - 1, -(2**20), 1, 0]
    return raw


def parquet_file(path: Path, age, year, labels=None) -> Path:
    n = len(age)
    labels = [i % 2 for i in range(n)] if labels is None else labels
    table = {"y": labels, "age": age, "year": year, "c": list(range(n))}
    pq.write_table(pa.table(table), path)
    return path


def pq_config(path: Path, **kw) -> DataConfig:
    return DataConfig(
        source="parquet",
        train_path=(str(path),),
        dense_columns=("age", "year"),
        sparse_columns=("c",),
        label_column="y",
        **kw,
    )


def dense_of(ds, rows=None) -> np.ndarray:
    idx = np.arange(ds.num_samples) if rows is None else np.asarray(rows)
    return ds.read(idx).dense.numpy()


# --- log1p: Criteo's default, the values the reader used to produce ---------------------


def test_criteo_and_binary_default_is_exactly_the_old_log1p_values(tmp_path) -> None:
    """Bugs caught: log1p dropped from the default, applied twice, or computed with other
    numerics than the reader's old parse-time ``dense_transform``."""
    raw = raw_dense_rows(300)
    path = criteo_file(tmp_path / "a.tsv", raw)
    old = dense_transform(raw)  # what CriteoBlock.dense held before
    cfg = DataConfig(source="criteo", train_path=(str(path),), train_rows=(0, 200))
    train, held = build_datasets(cfg, CRITEO_TABLES)
    assert train.transform.kinds == (DenseKind.LOG1P,) * 13
    assert train.transform.columns == tuple(f"I{i}" for i in range(1, 14))
    np.testing.assert_array_equal(dense_of(train), old[:200])
    np.testing.assert_array_equal(dense_of(held, [99, 0, 5]), old[[299, 200, 205]])
    preprocess_criteo([path], tmp_path / "bin", progress=False)
    bcfg = DataConfig(source="binary", train_path=(str(tmp_path / "bin"),), train_rows=(0, 200))
    btrain, _ = build_datasets(bcfg, CRITEO_TABLES)
    np.testing.assert_array_equal(dense_of(btrain), old[:200])


def old_format_copy(tmp_path: Path, raw: np.ndarray) -> tuple[Path, Path]:
    """A v2 directory and the same data as tetrarec's version 1 wrote it (log1p'd)."""
    path = criteo_file(tmp_path / "a.tsv", raw)
    new, old = tmp_path / "v2", tmp_path / "v1"
    preprocess_criteo([path], new, progress=False)
    preprocess_criteo([path], old, progress=False)
    np.save(old / "dense.npy", dense_transform(raw))
    meta = json.loads((old / "meta.json").read_text())
    meta.update(version=1, dense="float32 log(1 + max(x, 0)), missing -> 0")
    (old / "meta.json").write_text(json.dumps(meta))
    return new, old


def test_old_format_binary_directory_reads_correctly(tmp_path) -> None:
    """Bugs caught: v1 directories refused, their stored log1p values log1p'd again, or
    standardized as if raw (statistics of log values, silently wrong)."""
    raw = raw_dense_rows(60)
    new, old = old_format_copy(tmp_path, raw)
    assert open_binary(old).dense_applied == DenseKind.LOG1P
    assert open_binary(new).dense_applied == DenseKind.NONE
    for clip in (None, (0.5, 3.0)):
        cfg = {"source": "binary", "train_rows": (0, 40), "dense_clip": clip}
        a = build_datasets(DataConfig(train_path=(str(new),), **cfg), CRITEO_TABLES)
        b = build_datasets(DataConfig(train_path=(str(old),), **cfg), CRITEO_TABLES)
        assert a[0].transform == b[0].transform
        for x, y in zip(a, b):
            np.testing.assert_array_equal(dense_of(x), dense_of(y))
    assert dense_of(b[0]).min() == 0.5  # clipping still applies to the stored values
    with pytest.raises(DataError, match=r"v1 stores .* column I1 .*re-run `tetrarec preprocess"):
        build_datasets(
            DataConfig(source="binary", train_path=(str(old),), dense_transform="standardize"),
            CRITEO_TABLES,
        )
    # A v2 checkpoint transform applied to v1 data: same refusal, naming the data.
    t = DenseTransform.without_statistics(
        DenseSpec(columns=("I1",) * 13, kinds=(DenseKind.NONE,) * 13)
    )
    with pytest.raises(DataError, match=r"v1 dir.*already transformed by log1p"):
        TransformedDataset(ColumnsDataset(**_cols(old)), t, where="v1 dir")


def _cols(path: Path) -> dict:
    c = open_binary(path)
    return {
        "labels": c.labels,
        "dense": c.dense,
        "sparse": c.sparse,
        "tables": CRITEO_TABLES,
        "dense_applied": c.dense_applied,
    }


# --- standardize: statistics of the training rows only ----------------------------------


def test_standardize_uses_training_rows_only(tmp_path) -> None:
    """Bugs caught: statistics fitted over the whole file or the eval split (evaluation rows
    leaking into training inputs), eval rows transformed with their own statistics."""
    rng = np.random.default_rng(1)
    age = rng.integers(18, 90, 100).astype(float)
    year = rng.integers(1950, 2020, 100).astype(float)
    cfg = pq_config(tmp_path / "a.parquet", train_rows=(0, 70), dense_transform="standardize")
    parquet_file(tmp_path / "a.parquet", age, year)
    train, held = build_datasets(cfg, PQ_TABLES)
    raw = np.stack([age, year], 1).astype(np.float32).astype(np.float64)
    mean, std = raw[:70].mean(0), raw[:70].std(0)
    np.testing.assert_allclose(train.transform.mean, mean, rtol=1e-12)
    np.testing.assert_allclose(train.transform.std, std, rtol=1e-12)
    np.testing.assert_allclose(dense_of(held), (raw[70:] - mean) / std, rtol=1e-6)
    # Change only the evaluation rows: the statistics and training inputs stay bitwise.
    age2, year2 = age.copy(), year.copy()
    age2[70:] *= 100
    year2[70:] -= 1000
    parquet_file(tmp_path / "a.parquet", age2, year2)
    train2, held2 = build_datasets(cfg, PQ_TABLES)
    assert train2.transform == train.transform
    np.testing.assert_array_equal(dense_of(train2), dense_of(train))
    raw2 = np.stack([age2, year2], 1)[70:]
    np.testing.assert_allclose(dense_of(held2), (raw2 - mean) / std, rtol=1e-6)


def test_standardize_with_an_eval_file_fits_on_the_train_file(tmp_path) -> None:
    """Bug caught: statistics taken from eval_path's rows."""
    a = parquet_file(tmp_path / "a.parquet", [1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 4.0, 4.0])
    b = parquet_file(tmp_path / "b.parquet", [100.0, 300.0], [7.0, 9.0])
    cfg = pq_config(a, eval_path=(str(b),), dense_transform="standardize")
    train, held = build_datasets(cfg, PQ_TABLES)
    assert train.transform.mean == (3.0, 2.0)
    assert train.transform.std == (math.sqrt(3.5), 2.0)
    np.testing.assert_allclose(
        dense_of(held), [[97 / math.sqrt(3.5), 2.5], [297 / math.sqrt(3.5), 3.5]], rtol=1e-6
    )


def test_streaming_fit_is_exact_for_large_offsets_and_any_chunking(tmp_path) -> None:
    """Bugs caught: a naive float64 sum of squares (cancellation at a large mean), float32
    accumulation, chunks merged with the wrong weights."""
    rng = np.random.default_rng(2)
    big = 16_000_000 + rng.integers(0, 10, 1000)  # exact in float32, variance ~8
    ds = ColumnsDataset(
        labels=np.zeros(1000, np.float32),
        dense=np.stack([big, rng.normal(5, 2, 1000)], 1).astype(np.float32),
        sparse=np.zeros((1000, 1), np.uint32),
        tables=PQ_TABLES,
    )
    spec = DenseSpec(columns=("big", "n"), kinds=(DenseKind.STANDARDIZE,) * 2)
    x = ds.dense.astype(np.float64)
    for chunk in (7, 64, 1000, 5000):
        t = DenseTransform.fit(ds, spec, chunk_rows=chunk)
        np.testing.assert_allclose(t.mean, x.mean(0), rtol=1e-14)
        np.testing.assert_allclose(t.std, x.std(0), rtol=1e-10)


def test_constant_column_is_only_centred_with_a_warning(tmp_path, caplog) -> None:
    """Bug caught: division by a zero standard deviation (nan or inf inputs)."""
    p = parquet_file(tmp_path / "a.parquet", [1.0, 2.0, 3.0], [2020.0] * 3)
    with caplog.at_level(logging.WARNING, logger="tetrarec.data.dense"):
        train, _ = build_datasets(
            pq_config(p, train_rows=(0, 2), dense_transform="standardize"), PQ_TABLES
        )
    assert train.transform.std[1] == 1.0
    assert "dense column year is constant" in caplog.text
    assert dense_of(train)[:, 1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["log1p_standardize", "standardize"])
@pytest.mark.parametrize("value", [7.0, 2.0, 0.1, 1960.0, 123456.789])
def test_a_constant_whose_mean_rounds_is_still_constant(kind: str, value: float) -> None:
    """Bug caught: a column tested constant by std > 0; log1p(7) over 800 rows has a float64
    mean off by an ulp, so its std came out 4e-16 instead of 0: no warning, and an eval
    value of 8 became 3e14 (log loss 1e12)."""
    n = 2400  # rows in several chunks, merged as the fit merges them
    ds = ColumnsDataset(
        labels=np.zeros(n, np.float32),
        dense=np.full((n, 1), value, np.float32),
        sparse=np.zeros((n, 1), np.uint32),
        tables=PQ_TABLES,
    )
    t = DenseTransform.fit(ds, DenseSpec(columns=("d",), kinds=(DenseKind(kind),)), chunk_rows=700)
    assert t.std == (1.0,)
    assert t.apply(np.array([[value]], np.float32)).tolist() == [[0.0]]
    assert abs(t.apply(np.array([[value + 1.0]], np.float32))[0, 0]) <= 1.0 + value


def test_non_finite_training_value_names_column_and_row(tmp_path) -> None:
    """The Parquet reader refuses a NaN first (naming the file); the fit's own check
    stands for rows that reach it another way (a binary file written elsewhere)."""
    p = parquet_file(tmp_path / "a.parquet", [1.0, 2.0, 3.0], [1.0, float("nan"), 3.0])
    with pytest.raises(DataError, match=r"a\.parquet, field year: dense value is not a finite"):
        build_datasets(pq_config(p, dense_transform=["none", "standardize"]), PQ_TABLES)
    ds = ColumnsDataset(
        labels=np.zeros(3, np.float32),
        dense=np.array([[1.0, 1.0], [2.0, np.nan], [3.0, 3.0]], np.float32),
        sparse=np.zeros((3, 1), np.uint32),
        tables=PQ_TABLES,
    )
    spec = DenseSpec(columns=("age", "year"), kinds=(DenseKind.NONE, DenseKind.STANDARDIZE))
    with pytest.raises(DataError, match=r"dense column year holds nan at training row 1"):
        DenseTransform.fit(ds, spec, chunk_rows=2)


def test_log1p_standardize_uses_the_statistics_of_the_logged_training_rows(tmp_path) -> None:
    """Bugs caught: statistics of the raw values (not of their logs), the log skipped at
    apply time, or negative counts logged without the ``max(x, 0)``."""
    age = [0.0, 9.0, 99.0, 999.0, -5.0, 3.0]
    year = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    p = parquet_file(tmp_path / "a.parquet", age, year)
    cfg = pq_config(p, train_rows=(0, 4), dense_transform=["log1p_standardize", "none"])
    train, held = build_datasets(cfg, PQ_TABLES)
    logs = np.log1p(np.maximum(np.array(age), 0.0))
    mean, std = logs[:4].mean(), logs[:4].std()
    assert train.transform.mean[0] == pytest.approx(mean, rel=1e-12)
    assert train.transform.std[0] == pytest.approx(std, rel=1e-12)
    got = np.concatenate([dense_of(train), dense_of(held)])
    np.testing.assert_allclose(got[:, 0], (logs - mean) / std, rtol=1e-6)
    np.testing.assert_array_equal(got[:, 1], year)


# --- per-column lists and clipping --------------------------------------------------------


def test_per_column_kinds_and_clipping(tmp_path) -> None:
    """Bugs caught: kinds applied to the wrong columns, clipping before the transform or
    with the bounds of another column."""
    p = parquet_file(tmp_path / "a.parquet", [0.0, 3.0, 100.0, -5.0], [1990.0, 2000.0, 2010.0, 0])
    cfg = pq_config(
        p,
        train_rows=(0, 3),
        dense_transform=["log1p", "standardize"],
        dense_clip=[[-math.inf, 4.0], [-2.0, 2.0]],
    )
    train, held = build_datasets(cfg, PQ_TABLES)
    std = math.sqrt(200 / 3)
    expected = [[0.0, -10 / std], [math.log(4), 0.0], [4.0, 10 / std], [0.0, -2.0]]
    np.testing.assert_allclose(np.concatenate([dense_of(train), dense_of(held)]), expected, 1e-6)
    one_clip = pq_config(p, train_rows=(0, 3), dense_transform="log1p", dense_clip=[1, 2])
    t, _ = build_datasets(one_clip, PQ_TABLES)
    assert t.transform.clip == ((1.0, 2.0), (1.0, 2.0))
    assert dense_of(t)[:, 0].tolist() == [1.0, pytest.approx(math.log(4)), 2.0]


def test_list_length_must_match_the_dense_columns(tmp_path) -> None:
    raw = raw_dense_rows(10)
    path = criteo_file(tmp_path / "a.tsv", raw)
    cfg = DataConfig(source="criteo", train_path=(str(path),), dense_transform=["log1p"] * 12)
    with pytest.raises(ValueError, match=r"dense_transform lists 12 entries.*13 dense columns"):
        build_datasets(cfg, CRITEO_TABLES)
    cfg = DataConfig(source="criteo", train_path=(str(path),), dense_clip=[[0, 1], [0, 2]])
    with pytest.raises(ValueError, match=r"dense_clip lists 2 entries.*13 dense columns \(I1,"):
        build_datasets(cfg, CRITEO_TABLES)


def test_config_fields_validate_parse_and_round_trip() -> None:
    """Bugs caught: a typo silently accepted, an override list parsed as one name, the
    config not surviving a checkpoint's to_dict/from_dict."""
    with pytest.raises(ValueError, match=r"'auto'.*'none', 'log1p', 'standardize'.*'zscore'"):
        DataConfig(dense_transform="zscore")
    with pytest.raises(ValueError, match=r"dense_transform must be one of.*'log'"):
        DataConfig(dense_transform=["log1p", "log"])
    for bad in ([1, 1], [2, 1], [[0, 1], [3]], "0,1", [0, float("nan")]):
        with pytest.raises(ValueError, match=r"dense_clip must be \[lo, hi\]"):
            DataConfig(dense_clip=bad)
    assert DataConfig().dense_transform == "auto"
    run = RunConfig().with_overrides(
        ["data.dense_transform=standardize,log1p", "data.dense_clip=[-inf, 3]"]
    )
    assert run.data.dense_transform == (DenseKind.STANDARDIZE, DenseKind.LOG1P)
    assert run.data.dense_clip == (-math.inf, 3.0)
    run2 = RunConfig().with_overrides(
        ['data.dense_transform=["none", "log1p"]', "data.dense_clip=[[0, 1], [2, 3]]"]
    )
    assert run2.data.dense_transform == (DenseKind.NONE, DenseKind.LOG1P)
    assert run2.data.dense_clip == ((0.0, 1.0), (2.0, 3.0))
    # "none" is the identity, not the "auto" default (the override parser maps none to None
    # for optional fields; this one is not optional).
    assert RunConfig().with_overrides(["data.dense_transform=none"]).data.dense_transform == "none"
    for cfg in (run, run2):
        assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_an_infinite_clip_bound_is_written_as_text_json_can_hold(tmp_path) -> None:
    """Bug caught: ``to_dict`` kept the float -inf, which ``json.dumps`` writes as the
    bare token ``-Infinity`` (not JSON: strict parsers refuse the checkpoint's meta.json
    and the --json summary). It is the string "-inf" now, which the loader reads back,
    from TOML, --set and a dict alike; older files' float infinities still load."""
    run = RunConfig().with_overrides(["data.dense_clip=[-inf, 3]"])
    text = json.dumps(run.to_dict(), allow_nan=False)  # ValueError with a float inf
    assert json.loads(text)["data"]["dense_clip"] == ["-inf", 3.0]
    assert RunConfig.from_dict(json.loads(text)) == run
    old = json.dumps({"data": {"dense_clip": [-math.inf, 3]}})  # "-Infinity"
    assert RunConfig.from_dict(json.loads(old)) == run
    toml = tmp_path / "run.toml"
    toml.write_text('[data]\ndense_clip = [["-inf", 0], [1, "INF"]]\n')
    both = ((-math.inf, 0.0), (1.0, math.inf))
    assert RunConfig.from_toml(toml).data.dense_clip == both
    over = RunConfig().with_overrides(['data.dense_clip=["-inf", "+inf"]'])
    assert over.data.dense_clip == (-math.inf, math.inf)
    assert DataConfig(dense_clip=[["-inf", 0], [1, "inf"]]).dense_clip == both
    for bad in (["nan", 3], ["-inf", "-inf"], ["0", 1]):
        with pytest.raises(ValueError, match=r"dense_clip must be \[lo, hi\]"):
            DataConfig(dense_clip=bad)
    t = DenseTransform(columns=("a",), kinds=("none",), mean=(0.0,), std=(1.0,), clip=both[:1])
    saved = json.dumps(t.to_dict(), allow_nan=False)
    assert DenseTransform.from_dict(json.loads(saved)) == t


# --- the fitted object ----------------------------------------------------------------


def test_transform_round_trips_through_json_and_applies_the_same_on_tensors() -> None:
    """Bugs caught: statistics rounded when saved, a tensor path with other numerics, the
    caller's float64 array transformed in place."""
    t = DenseTransform(
        columns=("a", "b", "c"),
        kinds=("log1p", "standardize", "none"),
        mean=(0.0, 1 / 3, 0.0),
        std=(1.0, math.pi, 1.0),
        clip=((-math.inf, 2.5), (-1.0, 1.0), (0.0, math.inf)),
    )
    back = DenseTransform.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    x = np.random.default_rng(3).normal(0, 5, (64, 3)).astype(np.float32)
    ref = t.apply(x)
    assert ref.dtype == np.float32
    x64 = x.astype(np.float64)
    np.testing.assert_array_equal(t.apply(x64), ref)
    np.testing.assert_array_equal(x64, x)  # the input is never changed in place
    assert torch.equal(t.apply(torch.from_numpy(x)), torch.from_numpy(ref))
    # the path a tensor on another device takes (torch ops in float64)
    torch.testing.assert_close(t._apply_torch(torch.from_numpy(x)), torch.from_numpy(ref))
    with pytest.raises(ValueError, match=r"\(B, 3\)"):
        t.apply(x[:, :2])
    with pytest.raises(ValueError, match="version"):
        DenseTransform.from_dict({"columns": ["a"]})
    with pytest.raises(ValueError, match="std > 0"):
        DenseTransform(columns=("a",), kinds=("standardize",), mean=(0.0,), std=(0.0,))


def test_synthetic_default_is_the_identity() -> None:
    """Bug caught: synthetic runs (every existing test's data) fed other dense inputs."""
    tables = [TableConfig(name="t", num_embeddings=30, dim=4)]
    syn = SyntheticConfig(num_samples=64, eval_samples=16)
    train, _ = build_datasets(DataConfig(synthetic=syn), tables)
    assert train.transform.is_identity
    raw = SyntheticDataset(syn, tables, num_samples=64)
    assert torch.equal(train.read(np.arange(64)).dense, raw.read(np.arange(64)).dense)
    std, _ = build_datasets(DataConfig(synthetic=syn, dense_transform="standardize"), tables)
    x = raw.read(np.arange(64)).dense.numpy().astype(np.float64)
    np.testing.assert_allclose(std.transform.mean, x.mean(0), rtol=1e-12)


def test_overflow_to_inf_after_the_transform_is_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bug caught: an evaluation value far outside the training rows' spread (3.4e38 where
    the training std is 0.3) became inf in float32 after standardize without a word; the
    model's logits went nan and the run's metrics with them."""
    ds = ColumnsDataset(
        labels=np.zeros(4, np.float32),
        dense=np.array([[0.5, 1.0], [3.4e38, 2.0], [0.1, 3.0], [-3.4e38, 4.0]], np.float32),
        sparse=np.zeros((4, 1), np.uint32),
        tables=PQ_TABLES,
    )
    t = DenseTransform(
        columns=("d1", "d2"), kinds=("standardize", "none"), mean=(0.5, 0.0), std=(0.3, 1.0)
    )
    data = TransformedDataset(ds, t, where="eval.csv")
    with caplog.at_level(logging.WARNING):
        data.read(np.array([0, 2]))
        assert not caplog.records  # finite: no word
        got = data.read(np.array([2, 3, 1])).dense
        data.read(np.array([1]))
    assert torch.isinf(got[1:, 0]).all()
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "dense column d1" in msg
    assert "row 3 of eval.csv" in msg
    assert "dense_clip" in msg
