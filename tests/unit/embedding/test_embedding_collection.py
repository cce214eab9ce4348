import pytest
import torch

from tetrarec.embedding import EmbeddingBagCollection, SparseOptimizerSpec, TableConfig
from tetrarec.sparse import SparseFeatures
from tetrarec.types import OptimizerKind, PoolingMode


def _tables() -> list[TableConfig]:
    return [
        TableConfig(name="t0", num_embeddings=10, dim=4),
        TableConfig(name="t1", num_embeddings=7, dim=3, feature_names=("f1", "f2"), pooling="mean"),
    ]


def _naive_pool(weight: torch.Tensor, bags: list[list[int]], mean: bool, w=None) -> torch.Tensor:
    rows = []
    for b, bag in enumerate(bags):
        acc = torch.zeros(weight.shape[1])
        for j, i in enumerate(bag):
            acc += weight[i] * (1.0 if w is None else w[b][j])
        if mean and bag:
            acc /= len(bag)
        rows.append(acc)
    return torch.stack(rows)


def test_forward_matches_naive_loops() -> None:
    ebc = EmbeddingBagCollection(_tables(), seed=3)
    assert ebc.feature_names == ("t0", "f1", "f2")
    assert ebc.feature_dims == (4, 3, 3)
    bags = {"t0": [[1, 2, 2], []], "f1": [[0], [6, 5]], "f2": [[], [3]]}
    # keys given in another order: the collection permutes them
    sf = SparseFeatures.from_lists({k: bags[k] for k in ("f2", "t0", "f1")})
    out = ebc(sf)
    w = ebc.table_weights()
    expected = torch.cat(
        [
            _naive_pool(w["t0"].detach(), bags["t0"], mean=False),
            _naive_pool(w["t1"].detach(), bags["f1"], mean=True),
            _naive_pool(w["t1"].detach(), bags["f2"], mean=True),
        ],
        dim=1,
    )
    torch.testing.assert_close(out.values, expected)


def test_weighted_forward_and_sparse_grad() -> None:
    ebc = EmbeddingBagCollection([TableConfig(name="t", num_embeddings=5, dim=2)], seed=0)
    sf = SparseFeatures.from_lists({"t": [[1, 1], [4]]}, weights={"t": [[0.5, 2.0], [3.0]]})
    out = ebc(sf).values
    w = ebc.table_weights()["t"]
    torch.testing.assert_close(
        out, _naive_pool(w.detach(), [[1, 1], [4]], False, [[0.5, 2.0], [3.0]])
    )
    out.sum().backward()
    assert w.grad is not None
    assert w.grad.is_sparse
    dense = w.grad.to_dense()
    torch.testing.assert_close(dense[1], torch.full((2,), 2.5))
    torch.testing.assert_close(dense[4], torch.full((2,), 3.0))
    assert dense[0].abs().sum() == 0


def test_out_of_range_id_names_feature_id_and_size() -> None:
    ebc = EmbeddingBagCollection(_tables(), seed=0)
    sf = SparseFeatures.from_lists({"t0": [[1], [2]], "f1": [[7], [0]], "f2": [[0], [0]]})
    with pytest.raises(ValueError, match=r"feature 'f1': id 7 is outside its table of 7 rows"):
        ebc(sf)
    neg = SparseFeatures.from_lists({"t0": [[-1], [2]], "f1": [[1], [0]], "f2": [[0], [0]]})
    with pytest.raises(ValueError, match="id -1"):
        ebc(neg)


def test_seeded_init_is_deterministic_and_bounded() -> None:
    a = EmbeddingBagCollection(_tables(), seed=1).table_weights()
    b = EmbeddingBagCollection(_tables(), seed=1).table_weights()
    c = EmbeddingBagCollection(_tables(), seed=2).table_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["t0"], c["t0"])
    assert a["t0"].abs().max() <= 1 / 10**0.5


def test_table_config_validation() -> None:
    t = TableConfig(name="x", num_embeddings=4, dim=2, pooling="mean")
    assert t.feature_names == ("x",)
    assert t.pooling is PoolingMode.MEAN
    with pytest.raises(ValueError, match="must be positive"):
        TableConfig(name="x", num_embeddings=0, dim=2)
    with pytest.raises(ValueError, match="more than one table"):
        EmbeddingBagCollection(
            [
                TableConfig(name="a", num_embeddings=2, dim=2, feature_names=("f",)),
                TableConfig(name="b", num_embeddings=2, dim=2, feature_names=("f",)),
            ]
        )
    assert SparseOptimizerSpec(kind="adam").kind is OptimizerKind.ADAM
    with pytest.raises(ValueError, match="bad sparse optimizer"):
        SparseOptimizerSpec(lr=-1.0)
