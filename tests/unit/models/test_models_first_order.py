"""The first-order term (``DLRMConfig.first_order``): its logit, its updates, its state."""

from __future__ import annotations

import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.config.tables import model_tables
from tetrarec.embedding import (
    EmbeddingBagCollection,
    SparseOptimizerSpec,
    TableConfig,
)
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.models import DLRM, FIRST_ORDER_SUFFIX, DLRMConfig, FirstOrder, build_model
from tetrarec.sparse import SparseFeatures
from tetrarec.train import build_parts

ROWS = (6, 4)  # rows of tables t0, t1
DIM = 4


def _tables() -> list[TableConfig]:
    return [TableConfig(name=f"t{i}", num_embeddings=r, dim=DIM) for i, r in enumerate(ROWS)]


def _model(first_order: bool, num_dense: int = 3, **kw: object) -> DLRM:
    config = DLRMConfig(
        num_dense=num_dense,
        bottom_mlp=(8, DIM),
        top_mlp=(8, 1),
        seed=5,
        first_order=first_order,
        **kw,  # type: ignore[arg-type]
    )
    emb = FusedEmbeddingBagCollection(_tables(), SparseOptimizerSpec(lr=0.05), seed=2)
    return build_model(config, emb)


# Three samples; t0 has a multi-hot bag with a repeated id and an empty bag.
BAGS = {"t0": [[1, 1, 4], [], [2]], "t1": [[3], [0], [3]]}


def _batch(num_dense: int = 3) -> tuple[torch.Tensor, SparseFeatures]:
    dense = torch.arange(3 * num_dense, dtype=torch.float32).reshape(3, num_dense) / 10
    return dense, SparseFeatures.from_lists(BAGS)


def _set_rows(model: DLRM, rows: dict[str, list[float]]) -> None:
    assert model.first_order is not None
    model.first_order.rows.load_state_dict(
        {f"weights.{t}{FIRST_ORDER_SUFFIX}": torch.tensor(v).unsqueeze(1) for t, v in rows.items()}
    )


def test_first_order_starts_at_zero_and_leaves_the_rest_of_the_model_as_it_was() -> None:
    # Catches a first-order term that draws from the RNGs (the dense layers would start
    # elsewhere) or starts from non-zero weights (the logits would move).
    dense, sparse = _batch()
    plain, with_fo = _model(False), _model(True)
    fo_state = with_fo.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(fo_state[key], value), key
    assert torch.equal(plain(dense, sparse), with_fo(dense, sparse))
    assert with_fo.first_order is not None
    assert all(not w.any() for w in with_fo.first_order.row_weights().values())


def test_first_order_adds_each_looked_up_row_weight_and_the_dense_weights() -> None:
    # Catches rows of the wrong table or id, a bag pooled other than by sum (the
    # repeated id counts twice), an empty bag that is not 0, or a missing dense term.
    dense, sparse = _batch()
    plain, model = _model(False), _model(True)
    _set_rows(model, {"t0": [0.0, 1.0, 10.0, 0.0, 100.0, 0.0], "t1": [0.5, 0.0, 0.0, 2.0]})
    assert model.first_order is not None
    assert model.first_order.dense is not None
    with torch.no_grad():
        model.first_order.dense.weight.copy_(torch.tensor([[1.0, -2.0, 3.0]]))
    sparse_part = torch.tensor([1.0 + 1.0 + 100.0 + 2.0, 0.5, 10.0 + 2.0])
    dense_part = dense @ torch.tensor([1.0, -2.0, 3.0])
    with torch.no_grad():
        got = model(dense, sparse) - plain(dense, sparse)
    torch.testing.assert_close(got, sparse_part + dense_part)


def test_first_order_rows_take_adagrad_with_their_own_lr_and_weight_decay() -> None:
    # Catches rows trained with another rule, lr or decay (the tables' own settings, for
    # example), untouched rows that move, or repeated ids whose gradients do not add up.
    lr, wd = 0.3, 0.1
    model = _model(True, first_order_lr=lr, first_order_weight_decay=wd)
    start = {"t0": [0.0, 0.5, -1.0, 0.25, 2.0, 0.0], "t1": [1.0, 0.0, -0.5, 0.75]}
    _set_rows(model, start)
    dense, sparse = _batch()
    coef = torch.tensor([1.0, -2.0, 0.5])  # d loss / d logit of each sample
    (model(dense, sparse) * coef).sum().backward()
    assert model.first_order is not None
    got = model.first_order.row_weights()
    for table, bags in BAGS.items():
        grad = [0.0] * len(start[table])
        for sample, bag in enumerate(bags):
            for row in bag:
                grad[row] += float(coef[sample])
        for row, w in enumerate(start[table]):
            touched = any(row in bag for bag in bags)
            g = grad[row] + wd * w
            expected = w - lr * g / (abs(g) + 1e-8) if touched else w
            assert got[table][row].item() == pytest.approx(expected, abs=1e-6), (table, row)


def test_first_order_dense_weights_are_dense_parameters_and_rows_are_not() -> None:
    # Catches row weights handed to the dense optimizer (updated twice) or dense weights
    # that no optimizer sees.
    model = _model(True)
    dense = list(model.dense_parameters())
    names = {n for n, p in model.named_parameters() if any(p is q for q in dense)}
    assert "first_order.dense.weight" in names
    assert not any(n.startswith("first_order.rows") for n, _ in model.named_parameters())
    assert "first_order.dense.weight" not in {n for n, _ in _model(False).named_parameters()}


def test_first_order_without_dense_features_has_row_weights_only() -> None:
    model = _model(True, num_dense=0)
    assert model.first_order is not None
    assert model.first_order.dense is None
    _set_rows(model, {"t0": [0.0, 1.0, 0.0, 0.0, 0.0, 0.0], "t1": [0.0] * 4})
    plain = _model(False, num_dense=0)
    dense, sparse = _batch(num_dense=0)
    with torch.no_grad():
        got = model(dense, sparse) - plain(dense, sparse)
    torch.testing.assert_close(got, torch.tensor([2.0, 0.0, 0.0]))


def test_first_order_state_dict_resumes_rows_and_their_adagrad_state_bitwise() -> None:
    # Catches a checkpoint without the rows' Adagrad sums: the resumed model's next
    # step would be a first step again (a larger update) and differ from the original's.
    dense, sparse = _batch()
    model = _model(True, first_order_lr=0.2)
    for _ in range(2):
        model(dense, sparse).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.startswith("first_order.optim.") for k in state)
    resumed = _model(True, first_order_lr=0.2)
    resumed.load_state_dict(state)
    for m in (model, resumed):
        m(dense, sparse).sum().backward()
    assert model.first_order is not None
    assert resumed.first_order is not None
    for table, w in model.first_order.row_weights().items():
        assert torch.equal(resumed.first_order.row_weights()[table], w), table
    missing = {k: v for k, v in state.items() if not k.startswith("first_order.optim.t1_")}
    with pytest.raises(RuntimeError, match=r"first_order\.optim\.t1_first_order\.sum"):
        _model(True).load_state_dict(missing)


def test_first_order_tables_are_described_on_meta_for_a_sharded_build() -> None:
    # A sharded run builds its model around a meta-device collection (build_parts with
    # describe_only) and shards it next. Catches a term that builds real rows there (a
    # private copy on every rank, which sharding never sees), that fails to move its
    # dense weights beside the meta rows, or whose tables differ from the run's tables
    # that the planner and the plan see (model_tables).
    config = RunConfig.from_dict(
        {
            "model": {
                "num_sparse": 2,
                "num_embeddings": 10,
                "dlrm": {"num_dense": 3, "bottom_mlp": [8, 4], "top_mlp": [4, 1]},
            }
        }
    ).with_overrides(["model.dlrm.first_order=true"])
    model = build_parts(config, num_dense=3, describe_only=True).model
    assert model.first_order is not None
    rows = model.first_order.rows
    assert isinstance(rows, FusedEmbeddingBagCollection)
    assert all(b.is_meta for b in rows.buffers())
    assert model.first_order.dense is not None
    assert not model.first_order.dense.weight.is_meta
    assert rows.tables == model_tables(config.model)[2:]
    assert [t.name for t in rows.tables] == ["C1_first_order", "C2_first_order"]
    assert {t.dim for t in rows.tables} == {1}
    unsharded = build_parts(config, num_dense=3).model.first_order
    assert unsharded is not None
    assert all(not w.any() for w in unsharded.row_weights().values())  # starts at 0


def test_first_order_needs_an_embedding_module_that_lists_its_tables() -> None:
    class Untabled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = EmbeddingBagCollection(_tables(), seed=0)
            self.feature_names = self.inner.feature_names
            self.feature_dims = self.inner.feature_dims

        def forward(self, features: SparseFeatures) -> object:
            return self.inner(features)

    config = DLRMConfig(num_dense=3, bottom_mlp=(8, DIM), top_mlp=(8, 1), first_order=True)
    with pytest.raises(TypeError, match="lists its tables"):
        build_model(config, Untabled())
    # The reference collection lists them: its model gets the term.
    assert build_model(config, EmbeddingBagCollection(_tables(), seed=0)).first_order is not None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"first_order_lr": -0.1}, "first_order_lr"),
        ({"first_order_weight_decay": -1}, "first_order_weight_decay"),
    ],
)
def test_first_order_config_rejects_negative_settings(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DLRMConfig(first_order=True, **kw)  # type: ignore[arg-type]


def test_first_order_module_needs_tables() -> None:
    with pytest.raises(ValueError, match="at least one table"):
        FirstOrder([], num_dense=0, lr=0.1, weight_decay=0.0)
