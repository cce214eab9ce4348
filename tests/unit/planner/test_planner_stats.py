"""``feature_stats`` and ``tetrarec stats``: pooling and skew counted by hand.

The dataset below holds explicit bags (no hashing), so every expected figure is
counted by hand from the bags written in the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tetrarec.cli import main
from tetrarec.embedding import TableConfig
from tetrarec.planner import FeatureStat, FeatureStats, feature_stats
from tetrarec.sparse import Batch, SparseFeatures

REPO = Path(__file__).parents[3]
SYNTHETIC = REPO / "examples" / "dlrm_dcnv2_small.toml"


class BagsDataset:
    """Rows whose bags are given per feature: ``bags[key][row]`` is a list of ids."""

    def __init__(self, bags: dict[str, list[list[int]]]) -> None:
        self.keys = tuple(bags)
        self.bags = bags
        self.num_samples = len(next(iter(bags.values())))
        self.num_dense = 0

    def read(self, indices: np.ndarray) -> Batch:
        idx = [int(i) for i in indices]
        values = [i for k in self.keys for r in idx for i in self.bags[k][r]]
        lengths = [len(self.bags[k][r]) for k in self.keys for r in idx]
        sparse = SparseFeatures(
            self.keys,
            torch.tensor(values, dtype=torch.int64),
            torch.tensor(lengths, dtype=torch.int64),
            len(idx),
        )
        return Batch(dense=torch.zeros(len(idx), 0), sparse=sparse, labels=torch.zeros(len(idx)))


# Feature "b" (table of 250 rows): row 0 five times, row 1 four, row 2 three, row 3 twice,
# rows 4..19 once each: 30 lookups over 20 rows, spread over 4 samples.
_B_IDS = [0] * 5 + [1] * 4 + [2] * 3 + [3] * 2 + list(range(4, 20))
_B_BAGS = [_B_IDS[0:10], _B_IDS[10:12], _B_IDS[12:25], _B_IDS[25:30]]


def _two_tables() -> tuple[BagsDataset, list[TableConfig]]:
    tables = [
        TableConfig(name="ta", num_embeddings=100, dim=4, feature_names=("a",)),
        TableConfig(name="tb", num_embeddings=250, dim=4, feature_names=("b",)),
    ]
    data = BagsDataset({"a": [[3, 3, 7], [], [3, 9], [5]], "b": _B_BAGS})
    return data, tables


def test_pooling_and_hot_shares_match_a_hand_count() -> None:
    """Fails if repeats in a bag are not counted, empty bags leave the pooling's
    denominator, the hot row count is floored or rounded instead of ceil'd (250 rows:
    1% is 3 rows, 5% is 13), or shares are taken over rows instead of lookups."""
    data, tables = _two_tables()
    stats = feature_stats(data, tables, batch_size=8)
    assert stats.rows_sampled == 4
    assert stats.batch_size == 8
    # a: 6 lookups over 4 bags; row 3 takes 3 of them; 4 rows touched
    assert stats.features["a"] == FeatureStat(
        table="ta", num_embeddings=100, mean_pooling=1.5, hot_1pct=0.5, hot_5pct=1.0,
        distinct_rows=4,
    )  # fmt: skip
    b = stats.features["b"]
    assert b.mean_pooling == 30 / 4
    assert b.hot_1pct == pytest.approx((5 + 4 + 3) / 30)  # the 3 hottest rows
    assert b.hot_5pct == pytest.approx((5 + 4 + 3 + 2 + 9) / 30)  # the 13 hottest
    assert b.distinct_rows == 20
    assert list(stats.features) == ["a", "b"]


def test_features_sharing_a_table_are_counted_apart() -> None:
    """Fails if two features of one table are merged into one count (u's single hot
    row would then hold half the lookups, not all) or keyed by the table's name."""
    tables = [TableConfig(name="shared", num_embeddings=100, dim=4, feature_names=("u", "v"))]
    data = BagsDataset({"u": [[1], [1], [1], [1]], "v": [[10], [11], [12], [13]]})
    stats = feature_stats(data, tables, batch_size=4)
    u, v = stats.features["u"], stats.features["v"]
    assert (u.table, v.table) == ("shared", "shared")
    assert (u.hot_1pct, u.distinct_rows) == (1.0, 1)
    assert (v.hot_1pct, v.hot_5pct, v.distinct_rows) == (0.25, 1.0, 4)


def test_rows_limit_and_chunks() -> None:
    """Fails if ``rows`` is ignored, if asking for more rows than exist fails, or if
    a chunk boundary shifts the ids between features (chunk_rows=1 reads row by row)."""
    data, tables = _two_tables()
    first2 = feature_stats(data, tables, rows=2, batch_size=8)
    assert first2.rows_sampled == 2
    # a: [3, 3, 7], []: 3 lookups over 2 bags, row 3 holds 2 of them
    assert first2.features["a"].mean_pooling == 1.5
    assert first2.features["a"].hot_1pct == pytest.approx(2 / 3)
    assert first2.features["b"].mean_pooling == 6.0
    whole = feature_stats(data, tables, rows=10**6, batch_size=8)
    assert whole == feature_stats(data, tables, rows=None, batch_size=8, chunk_rows=1)
    assert whole.rows_sampled == 4


def test_json_round_trip_and_schema() -> None:
    """Fails if a field is lost or renamed on the way through JSON, or if a missing
    key is accepted silently."""
    data, tables = _two_tables()
    stats = feature_stats(data, tables, batch_size=8)
    payload = json.loads(json.dumps(stats.to_json()))
    assert set(payload) == {"rows_sampled", "batch_size", "features"}
    assert set(payload["features"]["b"]) == {
        "table", "num_embeddings", "mean_pooling", "hot_1pct", "hot_5pct", "distinct_rows",
    }  # fmt: skip
    assert FeatureStats.from_json(payload) == stats
    del payload["features"]["a"]["hot_5pct"]
    with pytest.raises(ValueError, match=r"'a'.*hot_5pct"):
        FeatureStats.from_json(payload)


def test_bad_inputs_are_named() -> None:
    """Fails if data whose features differ from the tables', an id outside its table
    or a non-positive row count is measured instead of refused."""
    data, tables = _two_tables()
    with pytest.raises(ValueError, match="features"):
        feature_stats(data, tables[:1], batch_size=8)
    small = [tables[0], TableConfig(name="tb", num_embeddings=10, dim=4, feature_names=("b",))]
    with pytest.raises(ValueError, match=r"'b'.*max 19"):
        feature_stats(data, small, batch_size=8)
    with pytest.raises(ValueError, match="rows must be positive"):
        feature_stats(data, tables, rows=0, batch_size=8)
    with pytest.raises(ValueError, match="hot_1pct"):
        FeatureStat(
            table="t", num_embeddings=10, mean_pooling=1.0, hot_1pct=0.9, hot_5pct=0.5,
            distinct_rows=3,
        )  # fmt: skip


_TINY = [
    "data.source=synthetic",
    "data.batch_size=64",
    "data.synthetic.num_samples=300",
    "model.num_sparse=3",
    "model.num_embeddings=40",
]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def test_cli_prints_the_table_it_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fails if ``--rows`` or ``--set`` is not applied, if a printed figure differs from
    the JSON, or if the JSON is not what ``FeatureStats.from_json`` reads."""
    out = tmp_path / "stats.json"
    argv = ["stats", "--config", str(SYNTHETIC), "--rows", "200", "--json", str(out)]
    assert main([*argv, *_sets(_TINY)]) == 0
    printed = capsys.readouterr().out
    stats = FeatureStats.from_json(json.loads(out.read_text()))
    assert stats.rows_sampled == 200
    assert stats.batch_size == 64
    assert list(stats.features) == ["C1", "C2", "C3"]
    assert printed.startswith("200 training rows read (batch size 64)")
    rows = {ln.split()[0]: ln.split() for ln in printed.splitlines()[2:]}
    for name, s in stats.features.items():
        assert rows[name][:6] == [
            name, s.table, "40", f"{s.mean_pooling:.2f}", f"{s.hot_1pct:.1%}", f"{s.hot_5pct:.1%}",
        ]  # fmt: skip
        assert rows[name][6] == str(s.distinct_rows)
        assert 0 < s.distinct_rows <= 40


def test_cli_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fails if a bad ``--rows`` gives a traceback or another exit status than 2."""
    argv = ["stats", "--config", str(SYNTHETIC), "--rows", "0", *_sets(_TINY)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tetrarec stats: error: rows must be positive")
    assert "\n" not in err


def test_cli_on_the_criteo_sample_matches_an_independent_count(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails if, on real one-hot data read through the run's pipeline (hashing into 20,000
    rows), a feature's counts are mixed with another's (a key-major offset error) or
    differ from a plain per-row count of the same rows."""
    from tetrarec.config import RunConfig
    from tetrarec.config.tables import build_tables
    from tetrarec.data import build_datasets

    monkeypatch.chdir(REPO)  # the recipe's data path is relative to the checkout
    recipe = REPO / "examples" / "criteo_kaggle_sample.toml"
    out = tmp_path / "stats.json"
    assert main(["stats", "--config", str(recipe), "--rows", "3000", "--json", str(out)]) == 0
    stats = FeatureStats.from_json(json.loads(out.read_text()))
    config = RunConfig.from_toml(recipe)
    tables = build_tables(config.model)
    train, _ = build_datasets(config.data, tables)
    sparse = train.read(np.arange(3000)).sparse
    ids = sparse.values.view(len(sparse.keys), 3000).numpy()  # one id per bag: (F, B)
    assert stats.rows_sampled == 3000
    for key, row_ids in zip(sparse.keys, ids):
        counts = sorted(np.unique(row_ids, return_counts=True)[1].tolist(), reverse=True)
        s = stats.features[key]
        assert s.mean_pooling == 1.0
        assert s.distinct_rows == len(counts)
        assert s.hot_1pct == pytest.approx(sum(counts[:200]) / 3000)  # ceil(1% of 20,000)
        assert s.hot_5pct == pytest.approx(sum(counts[:1000]) / 3000)
