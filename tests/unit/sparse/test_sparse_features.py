import pytest
import torch

from tetrarec.sparse import (
    Batch,
    PooledEmbeddings,
    SparseFeatures,
    permute_keys,
    slice_batch,
    split_batch,
    validate_features,
)


def _example() -> SparseFeatures:
    return SparseFeatures.from_lists(
        {"user": [[10, 11], [], [12]], "item": [[20], [21, 22], [23]]},
        weights={"user": [[1.0, 2.0], [], [3.0]], "item": [[4.0], [5.0, 6.0], [7.0]]},
    )


def test_layout_matches_docstring() -> None:
    sf = _example()
    assert sf.keys == ("user", "item")
    assert sf.values.tolist() == [10, 11, 12, 20, 21, 22, 23]
    assert sf.lengths.tolist() == [2, 0, 1, 1, 2, 1]
    assert sf.offsets().tolist() == [0, 2, 2, 3, 4, 6, 7]
    assert sf.batch_size == 3
    assert sf.value_counts == (3, 4)
    d = sf.to_dict()
    assert d["item"][0].tolist() == [20, 21, 22, 23]
    assert d["item"][1].tolist() == [1, 2, 1]


def test_constructor_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        SparseFeatures(
            ("a", "b"), torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64), 2
        )
    with pytest.raises(ValueError, match="int32/int64"):
        SparseFeatures(("a",), torch.zeros(3), torch.ones(1, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="duplicate"):
        SparseFeatures(
            ("a", "a"), torch.zeros(0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1
        )
    with pytest.raises(ValueError, match="weights"):
        SparseFeatures(
            ("a",), torch.zeros(2, dtype=torch.int64), torch.tensor([2]), 1, torch.zeros(3)
        )


def test_from_lengths_infers_batch_size() -> None:
    sf = SparseFeatures.from_lengths(["a", "b"], torch.arange(5), torch.tensor([1, 2, 0, 2]))
    assert sf.batch_size == 2
    assert sf.value_counts_host() == (3, 2)
    with pytest.raises(ValueError, match="do not split"):
        SparseFeatures.from_lengths(["a", "b"], torch.arange(5), torch.tensor([1, 2, 2]))


def test_permute_keys_moves_values_and_weights() -> None:
    sf = _example()
    out = permute_keys(sf, ["item", "user"])
    assert out.keys == ("item", "user")
    assert out.values.tolist() == [20, 21, 22, 23, 10, 11, 12]
    assert out.lengths.tolist() == [1, 2, 1, 2, 0, 1]
    assert out.weights is not None
    assert out.weights.tolist() == [4.0, 5.0, 6.0, 7.0, 1.0, 2.0, 3.0]
    sub = permute_keys(sf, ["item"])
    assert sub.values.tolist() == [20, 21, 22, 23]
    with pytest.raises(ValueError, match="not in features"):
        permute_keys(sf, ["nope"])


def test_split_batch_concatenates_back_to_global() -> None:
    sf = SparseFeatures.from_lists({"a": [[1], [2, 3], [], [4]], "b": [[5, 6], [7], [8], []]})
    batch = Batch(torch.arange(8.0).view(4, 2), sf, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    parts = split_batch(batch, 2)
    assert [p.batch_size for p in parts] == [2, 2]
    assert parts[0].sparse.values.tolist() == [1, 2, 3, 5, 6, 7]
    assert parts[1].sparse.values.tolist() == [4, 8]
    assert parts[1].sparse.lengths.tolist() == [0, 1, 1, 0]
    assert torch.equal(torch.cat([p.dense for p in parts]), batch.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), batch.labels)
    with pytest.raises(ValueError, match="does not split"):
        split_batch(batch, 3)
    one = slice_batch(batch, 1, 2)
    assert one.sparse.to_dict()["a"][0].tolist() == [2, 3]


def test_batch_checks_shapes_and_moves() -> None:
    sf = SparseFeatures.from_lists({"a": [[1], [2]]})
    with pytest.raises(ValueError, match="labels"):
        Batch(torch.zeros(2, 3), sf, torch.zeros(3))
    with pytest.raises(ValueError, match="dense"):
        Batch(torch.zeros(3, 3), sf, torch.zeros(2))
    b = Batch(torch.zeros(2, 3), sf, torch.zeros(2)).to("cpu")
    assert b.batch_size == 2


def test_pytree_round_trip() -> None:
    import torch.utils._pytree as pytree

    sf = _example()
    leaves, spec = pytree.tree_flatten(sf)
    assert any(isinstance(x, torch.Tensor) for x in leaves)
    back = pytree.tree_unflatten(leaves, spec)
    assert back == sf


def test_pooled_embeddings_views() -> None:
    v = torch.arange(10.0).view(2, 5)
    pe = PooledEmbeddings(("a", "b"), (2, 3), v)
    assert pe.to_dict()["b"].tolist() == [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]
    with pytest.raises(ValueError, match="equal dims"):
        pe.stacked()
    assert PooledEmbeddings(("a", "b"), (2, 2), v[:, :4]).stacked().shape == (2, 2, 2)
    with pytest.raises(ValueError, match="values must be"):
        PooledEmbeddings(("a",), (3,), v)


def test_validate_features_names_feature_and_id() -> None:
    sf = SparseFeatures.from_lists({"a": [[1], [2]], "b": [[9], [0]]})
    validate_features(sf, {"a": 3, "b": 10})
    with pytest.raises(ValueError, match=r"feature 'b': id 9 is outside its table of 5 rows"):
        validate_features(sf, {"a": 3, "b": 5})
    bad = SparseFeatures(("a",), torch.tensor([1, 2, 3]), torch.tensor([1, 1]), 2)
    with pytest.raises(ValueError, match="lengths sum to 2"):
        validate_features(bad)
