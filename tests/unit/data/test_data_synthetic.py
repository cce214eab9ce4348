import numpy as np
import pytest
import torch

from tetrarec.data import SyntheticConfig, SyntheticDataset
from tetrarec.data.synthetic import zipf_ranks
from tetrarec.embedding import TableConfig


def tables(rows=(1000, 5000, 20000)):
    return [TableConfig(name=f"t{i}", num_embeddings=n, dim=8) for i, n in enumerate(rows)]


def make(**kw):
    n = kw.pop("num_samples", 10_000)
    return SyntheticDataset(SyntheticConfig(**kw), tables(), num_samples=n)


def same(a, b):
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse.values, b.sparse.values)
        and torch.equal(a.sparse.lengths, b.sparse.lengths)
    )


def test_deterministic_by_seed_and_order_free():
    a, b = make(seed=3, pooling=3), make(seed=3, pooling=3)
    idx = np.array([5, 900, 17, 5])
    assert same(a.read(idx), b.read(idx))
    assert not same(a.read(idx), make(seed=4, pooling=3).read(idx))
    # A row does not depend on the other rows read with it.
    whole = a.read(np.array([17]))
    part = a.read(idx)
    assert torch.equal(whole.dense[0], part.dense[2])
    assert whole.labels[0] == part.labels[2]
    d_one, d_all = whole.sparse.to_dict(), part.sparse.to_dict()
    for k in a.keys:
        lens = d_all[k][1].tolist()
        start = lens[0] + lens[1]
        assert d_one[k][0].tolist() == d_all[k][0][start : start + lens[2]].tolist()


def test_shapes_ranges_and_pooling():
    ds = make(pooling=4, pooling_per_feature=(1, 4, 10))
    b = ds.read(np.arange(4000))
    assert b.dense.shape == (4000, 13)
    assert b.dense.dtype == torch.float32
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert b.sparse.keys == ("t0", "t1", "t2")
    d = b.sparse.to_dict()
    for (k, (vals, lens)), n, p in zip(d.items(), (1000, 5000, 20000), (1, 4, 10)):
        assert vals.min() >= 0, k
        assert vals.max() < n, k
        assert lens.min() >= 1
        assert lens.max() <= 2 * p - 1
        assert abs(lens.float().mean().item() - p) < 0.1 * p
    assert b.sparse.value_counts == tuple(len(v) for v, _ in d.values())
    with pytest.raises(ValueError, match=r"\[0, 10000\)"):
        ds.read(np.array([10_000]))


def test_ids_follow_a_power_law():
    ds = make(zipf=1.1)
    ids = ds.read(np.arange(10_000)).sparse.to_dict()["t2"][0].numpy()
    counts = np.sort(np.bincount(ids, minlength=20000))[::-1]
    assert counts[0] > 0.05 * 10_000  # the hottest id is very hot
    assert (counts > 0).sum() > 1000  # and there is a long tail
    r = zipf_ranks(np.linspace(0, 1, 100_001)[:-1], 1000, 1.1)
    freq = np.bincount(r, minlength=1000)
    assert freq[0] > freq[9] > freq[99] > 0
    assert abs(np.log(freq[0] / freq[9]) / np.log(10) - 1.1) < 0.2


def auc(y, s):
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    pos = y == 1
    n1, n0 = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)


def test_teacher_is_learnable_and_calibrated():
    rows = (10_000, 20_000, 50_000, 100_000) * 6 + (30_000, 80_000)
    ds = SyntheticDataset(SyntheticConfig(), tables(rows), num_samples=20_000)
    idx = np.arange(20_000)
    b = ds.read(idx)
    y = b.labels.numpy()
    p = ds.click_probability(idx)
    assert abs(y.mean() - 0.25) < 0.02
    assert 0.78 < auc(y, p) < 0.86  # the Bayes AUC
    assert auc(y, b.dense.numpy() @ ds._w) < 0.68  # the dense part alone is not enough


def test_eval_split_is_disjoint_rows_of_the_same_stream():
    cfg = SyntheticConfig(num_samples=100, eval_samples=50)
    train = SyntheticDataset(cfg, tables(), num_samples=100)
    held = SyntheticDataset(cfg, tables(), num_samples=50, row_offset=100)
    longer = SyntheticDataset(cfg, tables(), num_samples=150)
    assert same(held.read(np.arange(50)), longer.read(np.arange(100, 150)))
    assert not torch.equal(train.read(np.arange(50)).dense, held.read(np.arange(50)).dense)
