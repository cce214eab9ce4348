"""The kernels' op layer (``ops.py``, ``tbe.py``): behaviour found by mutation testing.

Each test kills mutants of ``tetrarec.kernels.tbe`` or ``tetrarec.kernels.ops`` that the
other kernel tests left alive (mutation/README.md, section "tetrarec/kernels ops"); its
docstring names the behaviour the mutants break.
"""

from __future__ import annotations

import re

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig, TableSlice
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.sparse import SparseFeatures

SGD = SparseOptimizerSpec(kind="sgd", lr=0.1)


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16"])
def test_row_gradients_gives_the_rows_current_values_decoded(precision):
    """``row_gradients`` returns each touched row's current value as FP32 ``(U, D)``.

    For packed INT8/INT4 rows the decode needs the table's dim: a mutant that passed no
    dim decoded nothing (an error) instead of the rows ``table_weights`` gives.
    """
    tables = [
        TableConfig(name="a", num_embeddings=9, dim=6, precision=precision),
        TableConfig(name="b", num_embeddings=5, dim=4, precision=precision),
    ]
    ebc = FusedEmbeddingBagCollection(tables, SGD, seed=3)
    sf = SparseFeatures.from_lists({"a": [[4, 1], [4]], "b": [[2], []]})
    grad = torch.arange(2 * 10, dtype=torch.float32).view(2, 10)
    weights = ebc.table_weights()
    for i, t in enumerate(tables):
        rows, grads, current = ebc.row_gradients(i, grad, sf.values, sf.lengths, None)
        assert current.dtype == torch.float32
        assert current.shape == grads.shape == (rows.numel(), t.dim)
        assert torch.equal(current, weights[t.name][rows])
    assert rows.tolist() == [2]


TABLES = [
    TableConfig(name="a", num_embeddings=7, dim=4),
    TableConfig(name="b", num_embeddings=5, dim=4, feature_names=("b_click", "b_view")),
]


def test_an_id_outside_its_table_found_in_backward_is_named_exactly(raises_exactly):
    """With ``check_bounds=False`` a bad id fails in backward with the forward's message
    plus where it was found, so the user knows to turn the check on."""
    ebc = FusedEmbeddingBagCollection(TABLES, SGD, check_bounds=False, seed=0)
    sf = SparseFeatures.from_lists({"a": [[1], [2]], "b_click": [[0], [4]], "b_view": [[3], [-1]]})
    out = ebc(sf).values
    with raises_exactly(
        "feature 'b_view': id -1 is outside its table 'b' of 5 rows (valid ids are 0..4)"
        " (found in backward: check_bounds is off)"
    ):
        out.sum().backward()


def test_load_optimizer_state_copies_bitwise_and_names_what_does_not_fit(raises_exactly):
    """``load_optimizer_state`` copies every table's state in place, and refuses other
    tables, other state names and another shape with messages that name them."""
    spec = SparseOptimizerSpec(kind="adam", lr=0.1)
    src = FusedEmbeddingBagCollection(TABLES, spec, seed=0)
    dst = FusedEmbeddingBagCollection(TABLES, spec, seed=1)
    state = src.optimizer_state()
    for i, names in enumerate(state.values()):
        for j, v in enumerate(names.values()):
            v.copy_(torch.arange(v.numel(), dtype=torch.float32).view(v.shape) * (i + 1) + j)
    dst.load_optimizer_state(state)
    got = dst.optimizer_state()
    assert all(torch.equal(got[t][n], v) for t, names in state.items() for n, v in names.items())
    with raises_exactly("optimizer state for tables ['a', 'z'], this module has ['a', 'b']"):
        dst.load_optimizer_state({"a": state["a"], "z": state["b"]})
    with raises_exactly(f"table 'b': optimizer state ['m'], expected {sorted(state['b'])}"):
        dst.load_optimizer_state({"a": state["a"], "b": {"m": state["b"]["exp_avg"]}})
    short = {**state["b"], "exp_avg": state["b"]["exp_avg"][:3]}
    with raises_exactly("table 'b' state 'exp_avg': expected (5, 4), got (3, 4)"):
        dst.load_optimizer_state({"a": state["a"], "b": short})


def test_a_missing_table_does_not_stop_loading_the_others():
    """A non-strict load without one table's rows still loads the tables after it, and
    reports just the missing one (a mutant stopped at the first missing table) and the
    unexpected keys by name."""
    src = FusedEmbeddingBagCollection(TABLES, SGD, seed=0)
    dst = FusedEmbeddingBagCollection(TABLES, SGD, seed=1)
    state = {k: v for k, v in src.state_dict().items() if k != "weights.a"}
    state["weights.z"] = torch.zeros(2, 4)
    result = dst.load_state_dict(state, strict=False)
    assert result.missing_keys == ["weights.a"]
    assert result.unexpected_keys == ["weights.z"]
    assert torch.equal(dst.table_weights()["b"], src.table_weights()["b"])
    assert not torch.equal(dst.table_weights()["a"], src.table_weights()["a"])


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        (torch.zeros(3, 4), "weights.a: expected (7, 4) torch.float32, got (3, 4) torch.float32"),
        (
            torch.zeros(7, 4, dtype=torch.float64),
            "weights.a: expected (7, 4) torch.float32, got (7, 4) torch.float64",
        ),
    ],
)
def test_rows_of_another_size_or_dtype_are_refused_by_name(rows, want):
    """Rows of another size, or of the right size in another dtype, are an error naming the
    table, not a reshape failure or a silent cast (a mutant required both to differ)."""
    ebc = FusedEmbeddingBagCollection(TABLES, SGD, seed=0)
    before = ebc.table_weights()["a"].clone()
    state = {**ebc.state_dict(), "weights.a": rows}
    with pytest.raises(RuntimeError, match=re.escape(want)):
        ebc.load_state_dict(state)
    assert torch.equal(ebc.table_weights()["a"], before)


def test_every_table_that_does_not_fit_is_named():
    """When several tables' rows do not fit, the error names each of them (a mutant
    stopped checking at the first)."""
    ebc = FusedEmbeddingBagCollection(TABLES, SGD, seed=0)
    state = {**ebc.state_dict(), "weights.a": torch.zeros(3, 4), "weights.b": torch.zeros(2, 4)}
    with pytest.raises(RuntimeError) as info:
        ebc.load_state_dict(state)
    assert "weights.a: expected (7, 4) torch.float32, got (3, 4) torch.float32" in str(info.value)
    assert "weights.b: expected (5, 4) torch.float32, got (2, 4) torch.float32" in str(info.value)


def test_a_dim_1_tables_per_element_state_keeps_its_column():
    """Per-element state is ``(rows, dim)`` even for a dim-1 table, per-row state
    ``(rows,)``: the state dict's shapes follow the layout, not the table's dim (a mutant
    squeezed every state)."""
    tables = [TableConfig(name="t", num_embeddings=6, dim=1)]
    ebc = FusedEmbeddingBagCollection(tables, SparseOptimizerSpec(kind="adam", lr=0.1), seed=0)
    shapes = {k: tuple(v.shape) for k, v in ebc.optimizer_state()["t"].items()}
    assert shapes == {"exp_avg": (6, 1), "exp_avg_sq": (6, 1), "step": (6,)}


def test_update_ids_returns_the_weights_gradient_only_when_asked():
    """``update_ids`` returns ``None`` unless ``want_psw`` (its documented default),
    and the ``(N,)`` gradient of the per-id weights when asked, with the same update."""
    sf = SparseFeatures.from_lists({"a": [[1, 2], [3]], "b_click": [[0], []], "b_view": [[4], [1]]})
    psw = torch.linspace(0.5, 1.5, sf.values.numel())
    grad = torch.ones(2, 12)
    plain = FusedEmbeddingBagCollection(TABLES, SGD, seed=0)
    asked = FusedEmbeddingBagCollection(TABLES, SGD, seed=0)
    assert plain.update_ids(grad, sf.values, sf.lengths, psw) is None
    got = asked.update_ids(grad, sf.values, sf.lengths, psw, want_psw=True)
    assert got is not None
    assert got.shape == (sf.values.numel(),)
    assert all(torch.equal(v, asked.table_weights()[k]) for k, v in plain.table_weights().items())


def test_each_update_advances_the_rounding_stream_by_one():
    """Every ``update_ids`` moves the stochastic-rounding iteration on by one, and the
    state dict saves it, so a resumed run rounds as the uninterrupted one."""
    ebc = FusedEmbeddingBagCollection(TABLES, SGD, seed=5)
    sf = SparseFeatures.from_lists({"a": [[1], [2]], "b_click": [[0], [4]], "b_view": [[3], []]})
    for _ in range(3):
        ebc.update_ids(torch.ones(2, 12), sf.values, sf.lengths, None)
    assert ebc.iteration == 3
    assert ebc.state_dict()["rounding"].tolist() == [5, 3]


def test_per_id_weights_gradient_sums_over_the_row_stores():
    """With tables in two row stores (FP32 and FP16), the per-id weights' gradient is the
    sum of both stores' parts: ``grad[b, feature columns] . w[id]`` for every id."""
    tables = [
        TableConfig(name="a", num_embeddings=7, dim=4),
        TableConfig(name="b", num_embeddings=5, dim=4, precision="fp16"),
    ]
    ebc = FusedEmbeddingBagCollection(tables, SGD, seed=0)
    sf = SparseFeatures.from_lists({"a": [[1, 2], [3]], "b": [[0], [4, 4]]})
    psw = torch.linspace(0.5, 1.5, sf.values.numel())
    grad = torch.arange(16, dtype=torch.float32).view(2, 8) / 8
    w = ebc.table_weights()
    want = []
    for f, (name, bags) in enumerate((("a", [[1, 2], [3]]), ("b", [[0], [4, 4]]))):
        for b, bag in enumerate(bags):
            want += [float(grad[b, 4 * f : 4 * f + 4] @ w[name][i]) for i in bag]
    got = ebc.update_ids(grad, sf.values, sf.lengths, psw, want_psw=True)
    assert got is not None
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_per_id_weights_on_a_mean_pooled_collection_are_refused_exactly(raises_exactly):
    """Per-id weights with a mean-pooled table are refused with the exact message (a
    mutant garbled it); a sum-pooled collection takes them, a mean-pooled one runs
    without them."""
    mean = [*TABLES, TableConfig(name="m", num_embeddings=3, dim=2, pooling="mean")]
    bags = {"a": [[1], [2]], "b_click": [[0], [4]], "b_view": [[3], []]}
    weighted = SparseFeatures.from_lists(
        bags, weights={k: [[0.5] * len(b) for b in v] for k, v in bags.items()}
    )
    assert FusedEmbeddingBagCollection(TABLES, SGD, seed=0)(weighted).values.shape == (2, 12)
    ebc = FusedEmbeddingBagCollection(mean, SGD, seed=0)
    assert ebc(SparseFeatures.from_lists({**bags, "m": [[2], [0, 1]]})).values.shape == (2, 14)
    with raises_exactly("per-id weights are supported with sum pooling only"):
        ebc(
            SparseFeatures.from_lists(
                {**bags, "m": [[2], [0]]},
                weights={
                    **{k: [[0.5] * len(b) for b in v] for k, v in bags.items()},
                    "m": [[1.0], [1.0]],
                },
            )
        )


def test_a_bad_id_in_the_first_feature_is_named(raises_exactly):
    """An id outside its table in the collection's first feature (index 0) is refused
    like one in any other feature (a mutant took index 0 for "no bad id")."""
    ebc = FusedEmbeddingBagCollection(TABLES, SGD, seed=0)
    sf = SparseFeatures.from_lists({"a": [[1], [7]], "b_click": [[0], [4]], "b_view": [[3], []]})
    with raises_exactly(
        "feature 'a': id 7 is outside its table 'a' of 7 rows (valid ids are 0..6)"
    ):
        ebc(sf)


def test_a_shard_starts_with_its_global_cells_and_needs_one_slice_per_table(raises_exactly):
    """A collection built with ``slices`` (a shard) starts with the rows of its cells of
    the global table (a mutant ignored the slices and started it as a whole table of its
    size); a slice count other than the table count is refused with the counts."""
    whole = TableConfig(name="g", num_embeddings=10, dim=6)
    shard = TableConfig(name="g", num_embeddings=4, dim=2)
    at = TableSlice(table=whole, row_start=3, col_start=2)
    rows = FusedEmbeddingBagCollection([shard], SGD, seed=4, slices=[at]).table_weights()["g"]
    whole_rows = FusedEmbeddingBagCollection([whole], SGD, seed=4).table_weights()["g"]
    assert torch.equal(rows, whole_rows[3:7, 2:4])
    with raises_exactly("2 slices for 1 tables"):
        FusedEmbeddingBagCollection([shard], SGD, seed=4, slices=[at, at])


def test_a_meta_collection_only_describes_its_tables():
    """On the ``meta`` device (a layout to be sharded) no initial row is computed: a table
    of 2^40 rows of 2^20 columns is described at once (a mutant computed its first
    chunk of initial rows, which cannot be allocated)."""
    huge = TableConfig(name="h", num_embeddings=1 << 40, dim=1 << 20)
    ebc = FusedEmbeddingBagCollection([huge], SGD, seed=0, device="meta")
    assert ebc.storages()[0].device.type == "meta"
    assert ebc.storages()[0].numel() == 1 << 60


def test_only_adagrads_sum_starts_at_the_initial_accumulator():
    """``initial_accumulator`` is Adagrad's starting ``sum``; every other optimizer state
    (Adam's moments and step) starts at zero whatever it is set to (a mutant filled
    every state with it)."""
    spec = SparseOptimizerSpec(kind="adam", lr=0.1, initial_accumulator=0.5)
    state = FusedEmbeddingBagCollection(TABLES, spec, seed=0).optimizer_state()
    assert all(not v.any() for names in state.values() for v in names.values())
    spec = SparseOptimizerSpec(kind="adagrad", lr=0.1, initial_accumulator=0.5)
    state = FusedEmbeddingBagCollection(TABLES, spec, seed=0).optimizer_state()
    assert all(bool((names["sum"] == 0.5).all()) for names in state.values())


def test_the_defaults_check_bounds_deterministically_and_round_stochastically():
    """By default a collection checks ids, is deterministic and rounds low-precision
    updates stochastically: the same update as ``stochastic_rounding=True``, not as
    round-to-nearest (mutants turned each default off)."""
    tables = [TableConfig(name="h", num_embeddings=6, dim=8, precision="fp16")]
    sf = SparseFeatures.from_lists({"h": [[1, 2], [2, 5]]})
    grad = torch.linspace(-1e-3, 1e-3, 16).view(2, 8)

    def updated(**kwargs: bool) -> torch.Tensor:
        ebc = FusedEmbeddingBagCollection(tables, SGD, seed=2, **kwargs)
        ebc.update_ids(grad, sf.values, sf.lengths, None)
        return ebc.table_weights()["h"]

    default = FusedEmbeddingBagCollection(tables, SGD, seed=2)
    assert (default.check_bounds, default.deterministic) == (True, True)
    assert torch.equal(updated(), updated(stochastic_rounding=True))
    assert not torch.equal(updated(), updated(stochastic_rounding=False))


def test_a_collection_without_a_seed_draws_one_from_the_torch_rng():
    """``seed=None`` draws the seed from the global torch RNG: collections built after the
    same ``torch.manual_seed`` start alike, and the drawn seed is saved for stochastic
    rounding (a mutant kept ``None``, which no initial row or saved state can use)."""
    torch.manual_seed(11)
    a = FusedEmbeddingBagCollection(TABLES, SGD)
    torch.manual_seed(11)
    b = FusedEmbeddingBagCollection(TABLES, SGD)
    assert isinstance(a.seed, int)
    assert a.seed == b.seed
    assert a.state_dict()["rounding"].tolist() == [a.seed, 0]
    assert all(torch.equal(w, b.table_weights()[k]) for k, w in a.table_weights().items())


def test_optimizer_state_is_fp32_whatever_the_default_dtype():
    """Optimizer state is FP32 as documented even when a program sets another default
    dtype (a mutant made the state buffers in the default dtype)."""
    spec = SparseOptimizerSpec(kind="adam", lr=0.1)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ebc = FusedEmbeddingBagCollection(TABLES, spec, seed=0)
    finally:
        torch.set_default_dtype(before)
    dtypes = {v.dtype for names in ebc.optimizer_state().values() for v in names.values()}
    assert dtypes == {torch.float32}
