"""``FusedEmbeddingBagCollection`` as a user's own training loop meets it: the
``nn.Module`` and ``torch.optim`` surfaces around the kernels (copies, casts, state
dicts, hyperparameters) and the batch checks the kernels make before reading.

Each test names the bug it was written for (found by using the module as a user would).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tetrarec.embedding import EmbeddingBagCollection, SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.sparse import SparseFeatures


def _collection(*tables: TableConfig, kind: str = "adagrad") -> FusedEmbeddingBagCollection:
    return FusedEmbeddingBagCollection(tables, SparseOptimizerSpec(kind=kind, lr=0.1), seed=0)


def _step(ebc: FusedEmbeddingBagCollection, sf: SparseFeatures) -> None:
    ebc(sf).values.sum().backward()


def test_a_negative_bag_length_is_refused_before_any_read(kernel_path) -> None:
    """Lengths ``[4, -1]`` add up to the 3 ids of ``values``, so the "lengths add up to N"
    check passed; the compiled forward then pooled 4 ids for the first bag, reading a
    row past the end of ``values`` (an id not in the batch, silently), while the
    portable path failed inside ``repeat_interleave``. Both now refuse it by position.
    """
    ebc = _collection(TableConfig(name="a", num_embeddings=10, dim=2))
    buf = torch.tensor([1, 2, 3, 7, 7, 7])
    sf = SparseFeatures(("a",), buf[:3], torch.tensor([4, -1]), batch_size=2)
    with pytest.raises(RuntimeError, match=r"bag length 1 is -1 \(lengths must be >= 0\)"):
        ebc(sf)


def test_lengths_that_add_up_to_fewer_ids_than_values_holds_are_refused(kernel_path) -> None:
    """Lengths adding up to fewer ids than ``values`` holds were accepted and the ids
    past their sum ignored: a batch built with a lost bag trained on part of itself."""
    ebc = _collection(TableConfig(name="a", num_embeddings=10, dim=2))
    sf = SparseFeatures(("a",), torch.tensor([1, 2, 3]), torch.tensor([1, 1]), batch_size=2)
    with pytest.raises(RuntimeError, match="the lengths add up to 2 ids, values holds 3"):
        ebc(sf)


def test_strided_ids_lengths_and_weights_pool_as_contiguous_ones(kernel_path) -> None:
    """A strided ``values`` (every other id of a buffer), ``lengths`` or ``weights`` was
    refused by the compiled kernel ("must be contiguous") though the portable path and
    the reference collection took it: ``SparseFeatures`` now stores them contiguous."""
    table = TableConfig(name="a", num_embeddings=10, dim=3)
    ebc = _collection(table)
    ref = EmbeddingBagCollection([table], seed=0)
    values = torch.tensor([1, 0, 5, 0, 9, 0])[::2]
    lengths = torch.tensor([[2, 0], [1, 0]])[:, 0]
    weights = torch.tensor([0.5, 0.0, 2.0, 0.0, -1.0, 0.0])[::2]
    assert not values.is_contiguous()
    assert not lengths.is_contiguous()
    assert not weights.is_contiguous()
    sf = SparseFeatures(("a",), values, lengths, batch_size=2, weights=weights)
    assert sf.values.is_contiguous()
    assert sf.lengths.is_contiguous()
    assert sf.weights is not None
    assert sf.weights.is_contiguous()
    torch.testing.assert_close(ebc(sf).values, ref(sf).values, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        (
            TableConfig(name="t", num_embeddings=6, dim=4),
            TableConfig(name="t", num_embeddings=4, dim=6),
        ),
        (
            TableConfig(name="t", num_embeddings=6, dim=2, precision="int8"),
            TableConfig(name="t", num_embeddings=4, dim=7, precision="int8"),
        ),
    ],
)
def test_rows_of_another_shape_are_refused_by_load_state_dict(
    saved: TableConfig, loaded: TableConfig
) -> None:
    """Rows were checked by element count only, then reshaped: a 6 x 4 table loaded into
    a 4 x 6 one with "All keys matched successfully" and scrambled rows. Now a size
    mismatch, as ``nn.Module`` gives, and the rows are left as they were."""
    src, dst = _collection(saved), _collection(loaded)
    before = dst.state_dict()["weights.t"].clone()
    with pytest.raises(RuntimeError, match=r"weights\.t: expected \(4, \d+\) torch\.\w+, got \(6,"):
        dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.state_dict()["weights.t"], before)


def test_a_deep_copy_or_pickle_keeps_its_optimizer_whole() -> None:
    """``torch.optim.Optimizer`` pickles only defaults, state and param_groups, so a
    ``copy.deepcopy`` of the module (a "best model" copy) or ``torch.save`` of it lost
    the optimizer's kind and owner: its ``state_dict()`` then raised AttributeError.
    The copy must also be its own: its steps leave the original alone."""
    ebc = _collection(TableConfig(name="a", num_embeddings=6, dim=4))
    sf = SparseFeatures.from_lists({"a": [[1, 2], [3]]})
    _step(ebc, sf)
    original = copy.deepcopy(ebc.state_dict()), copy.deepcopy(ebc.fused_optimizer.state_dict())
    clone = copy.deepcopy(ebc)
    copied_sum = clone.fused_optimizer.state_dict()["state"]["a"]["sum"]
    assert torch.equal(copied_sum, original[1]["state"]["a"]["sum"])
    _step(clone, sf)
    assert torch.equal(ebc.state_dict()["weights.a"], original[0]["weights.a"])
    assert not torch.equal(clone.state_dict()["weights.a"], original[0]["weights.a"])
    assert clone.fused_optimizer._owner is clone
    buf = io.BytesIO()
    torch.save(ebc, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.fused_optimizer.load_state_dict(ebc.fused_optimizer.state_dict())
    assert torch.equal(loaded.state_dict()["weights.a"], ebc.state_dict()["weights.a"])


@pytest.mark.parametrize(
    ("precision", "cast"),
    [
        ("fp16", lambda m: m.to(torch.float32)),
        ("int8", lambda m: m.half()),
        ("fp32", lambda m: m.double()),
        ("bf16", lambda m: m.float()),
    ],
)
def test_module_casts_leave_rows_and_optimizer_state_at_their_precisions(
    precision: str, cast
) -> None:
    """``model.to(torch.float32)`` (a no-op in torch) rewrote FP16 rows as FP32 and the
    next forward failed; ``.half()`` silently made the FP32 optimizer state FP16 and
    failed in backward; ``.double()`` made FP32 rows FP64. Casts now leave the stores at
    their dtypes (bitwise) and training goes on."""
    ebc = _collection(TableConfig(name="a", num_embeddings=6, dim=4, precision=precision))
    sf = SparseFeatures.from_lists({"a": [[1, 2], [3]]})
    rows = ebc.state_dict()["weights.a"].clone()
    state = ebc.fused_optimizer.state_dict()["state"]["a"]["sum"].clone()
    cast(ebc)
    assert torch.equal(ebc.state_dict()["weights.a"], rows)
    assert ebc.state_dict()["weights.a"].dtype == rows.dtype
    assert torch.equal(ebc.fused_optimizer.state_dict()["state"]["a"]["sum"], state)
    _step(ebc, sf)
    assert ebc.fused_optimizer.state_dict()["state"]["a"]["sum"].dtype == torch.float32
    assert not torch.equal(ebc.state_dict()["weights.a"], rows)


def test_a_move_still_applies_to_the_stores() -> None:
    """The dtype guard must not stop moves: ``to_empty`` (which the meta-device path
    uses) still gives new storages, and ``share_memory`` shares them."""
    ebc = _collection(TableConfig(name="a", num_embeddings=6, dim=4))
    ebc.share_memory()
    assert all(s.is_shared() for s in ebc.storages())
    old = ebc.storages()[0].data_ptr()
    ebc.to_empty(device="cpu")
    assert ebc.storages()[0].data_ptr() != old


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_table_weights_are_copies_at_every_precision(precision: str) -> None:
    """``table_weights()`` returned the live storage for FP32 tables only: a snapshot
    taken before a step followed the step, and writing to it edited the table."""
    ebc = _collection(TableConfig(name="a", num_embeddings=6, dim=4, precision=precision))
    snapshot = ebc.table_weights()["a"]
    kept = snapshot.clone()
    _step(ebc, SparseFeatures.from_lists({"a": [[1, 2], [3]]}))
    assert torch.equal(snapshot, kept)
    after = ebc.table_weights()["a"]
    snapshot.zero_()
    assert torch.equal(ebc.table_weights()["a"], after)


def test_a_second_param_group_is_refused() -> None:
    """``add_param_group`` was accepted, and the group's settings silently ignored: the
    kernels read ``param_groups[0]`` only."""
    ebc = _collection(TableConfig(name="a", num_embeddings=6, dim=4))
    with pytest.raises(ValueError, match="a fused optimizer has one param group"):
        ebc.fused_optimizer.add_param_group({"params": [torch.zeros(1)], "lr": 1.0})
    assert len(ebc.fused_optimizer.param_groups) == 1


def test_a_refused_optimizer_state_load_changes_nothing() -> None:
    """A state whose later table did not fit was refused only after the earlier tables
    had been overwritten: a half-loaded optimizer."""
    ebc = _collection(
        TableConfig(name="a", num_embeddings=6, dim=4),
        TableConfig(name="b", num_embeddings=5, dim=4),
    )
    sf = SparseFeatures.from_lists({"a": [[1, 2], [3]], "b": [[0], [4]]})
    _step(ebc, sf)
    good = copy.deepcopy(ebc.fused_optimizer.state_dict())
    bad = copy.deepcopy(good)
    bad["state"]["a"]["sum"].fill_(7.0)
    bad["state"]["b"]["sum"] = torch.zeros(4, 4)  # one row short
    with pytest.raises(ValueError, match=r"table 'b' state 'sum': expected \(5, 4\), got \(4, 4\)"):
        ebc.fused_optimizer.load_state_dict(bad)
    assert torch.equal(
        ebc.fused_optimizer.state_dict()["state"]["a"]["sum"], good["state"]["a"]["sum"]
    )


@pytest.mark.parametrize(
    "bound", [-1.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"]
)
def test_a_bad_init_bound_is_refused_by_the_table(bound: float) -> None:
    """A negative or NaN bound failed later inside ``torch.Tensor.uniform_`` naming no
    table; an infinite one gave inf rows."""
    with pytest.raises(ValueError, match="table 't': init_bound must be finite"):
        TableConfig(name="t", num_embeddings=4, dim=2, init_bound=bound)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_an_init_bound_past_fp16s_range_is_refused(precision: str) -> None:
    """FP16 rows start rounded to nearest, INT8/INT4 rows keep an FP16 scale and bias: a
    bound of 1e6 gave inf rows (INT8: -inf and NaN)."""
    TableConfig(name="t", num_embeddings=4, dim=2, precision=precision, init_bound=60000.0)
    with pytest.raises(ValueError, match=r"for FP16, INT8 and INT4 rows, <= 65504; got 1000000\.0"):
        TableConfig(name="t", num_embeddings=4, dim=2, precision=precision, init_bound=1e6)
    TableConfig(name="t", num_embeddings=4, dim=2, precision="bf16", init_bound=1e6)
