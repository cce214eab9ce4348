"""Kernel numerics found by mutation testing (``mutation/README.md``, kernels section).

Each test pins a behaviour of the oracles in ``tetrarec/kernels`` (row codecs, optimizer
rules, the portable lookup and update, the row-store layout, the fused optimizer's
surface) that a seeded bug changed while every other selected test still passed. The
docstrings name that bug.
"""

import os
import re
import sys
import warnings

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig, TableSlice
from tetrarec.embedding.config import SPARSE_HPARAM_RULES
from tetrarec.kernels import (
    FusedEmbeddingBagCollection,
    FusedOptimizer,
    decode_rows,
    dequantize_rows,
    encode_rows,
    quantize_rows,
    reference,
    stochastic_round,
)
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.kernels.layout import RowStore, plan_stores
from tetrarec.kernels.memory import advise_huge_pages, host_buffer
from tetrarec.kernels.quant import row_width
from tetrarec.sparse import SparseFeatures
from tetrarec.types import OptimizerKind, PoolingMode, Precision

PRECISIONS = [Precision.FP32, Precision.FP16, Precision.BF16, Precision.INT8, Precision.INT4]


def _stored(rows: torch.Tensor, precision: Precision) -> torch.Tensor:
    return encode_rows(rows, precision, stochastic=False)


# -- rows between FP32 buffers and row stores (the mixed-precision cache) ----------------


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.value)
def test_load_rows_decodes_each_indexed_row_into_its_slot(precision: Precision) -> None:
    """``dst[dst_index[j]] = decode(src[src_index[j]])``; other rows of ``dst`` untouched.

    Bugs caught: rows decoded with another width or precision, read from or written to
    the wrong index, or the whole buffer overwritten (the cache would serve another
    row's values).
    """
    gen = torch.Generator().manual_seed(0)
    src = _stored(torch.randn(6, 5, generator=gen), precision)
    dst = torch.full((4, 5), 7.0)
    reference.load_rows(src, torch.tensor([4, 0, 2]), dst, torch.tensor([1, 3, 0]), precision.value)
    want = decode_rows(src, precision, 5)
    assert torch.equal(dst[[1, 3, 0]], want[[4, 0, 2]])
    assert torch.equal(dst[2], torch.full((5,), 7.0))


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.value)
def test_store_rows_rounds_to_nearest_without_the_stochastic_flag(precision: Precision) -> None:
    """Flags ``[0, ...]``: ``dst[dst_index[j]] = encode(src[src_index[j]])`` rounded to
    nearest, other stored rows untouched.

    Bugs caught: stochastic rounding applied although not asked for, rows encoded in
    another precision, written to the wrong rows.
    """
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(3, 6, generator=gen)
    dst = _stored(torch.zeros(5, 6), precision)
    before = dst.clone()
    flags = [0, 3, 4, 1000, 0]
    reference.store_rows(
        src, torch.tensor([2, 0]), dst, torch.tensor([4, 1]), precision.value, flags
    )
    assert torch.equal(dst[[4, 1]], _stored(src[[2, 0]], precision))
    assert torch.equal(dst[[0, 2, 3]], before[[0, 2, 3]])


@pytest.mark.parametrize(
    "precision", [Precision.FP16, Precision.BF16, Precision.INT8], ids=lambda p: p.value
)
def test_store_rows_draws_what_the_fused_update_draws(
    monkeypatch: pytest.MonkeyPatch, precision: Precision
) -> None:
    """A row written back by the cache rounds exactly as the fused update would round it.

    An SGD step with lr 1 from zero rows is exact, so the portable fused backward stores
    ``encode(target)`` with its stochastic draws for ``(seed, iteration 0, row key + row,
    column)``; ``store_rows`` with flags ``[1, seed, 0, row_key, col_start]`` must give
    the same bits, here with the rows given in another order than the backward's.

    Bugs caught: draws keyed by a row's position in the call instead of its row (key +
    ``dst_index``), by another seed, iteration or column, round-to-nearest where the
    flag asks for stochastic rounding (a cached run would then drift from an uncached one).
    """
    monkeypatch.setenv("TETRAREC_KERNELS", "reference")
    rows, dim, seed = 8, 6, 11
    table = TableConfig(name="t", num_embeddings=rows, dim=dim, precision=precision.value)
    ebc = FusedEmbeddingBagCollection(
        [table], SparseOptimizerSpec(kind="sgd", lr=1.0), seed=seed, stochastic_rounding=True
    )
    zeros = _stored(torch.zeros(rows, dim), precision)
    ebc.load_state_dict({"weights.t": zeros.clone()})
    gen = torch.Generator().manual_seed(2)
    if precision.is_integer:  # every row spans [-1, 1] (its scale), interior codes round
        target = torch.rand(rows, dim, generator=gen) * 2 - 1
        target[:, 0], target[:, -1] = -1.0, 1.0
    else:
        target = torch.rand(rows, dim, generator=gen) * 1e-2
    ebc(SparseFeatures.from_lists({"t": [[i] for i in range(rows)]})).values.backward(-target)
    fused = ebc.state_dict()["weights.t"]
    assert not torch.equal(fused, _stored(target, precision))  # some draw rounded up

    dst = zeros.clone()
    order = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    flags = [1, seed, 0, TableSlice(table=table).row_key(), 0]
    reference.store_rows(target, order, dst, order, precision.value, flags)
    assert torch.equal(dst, fused)


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.value)
def test_compiled_load_and_store_rows_equal_the_portable_ones(precision: Precision) -> None:
    """The compiled ``load_rows`` and ``store_rows`` (what the CPU cache runs) and the
    portable ones (the oracle, what runs elsewhere) give the same bits, stochastic
    rounding included.

    Bugs caught: any change to the portable codecs' indexing, flags or draws that the
    compiled kernel does not share.
    """
    ext = compiled_cpu_kernels()
    if ext is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    gen = torch.Generator().manual_seed(3)
    src_f = torch.randn(7, 9, generator=gen) * 0.1
    src_i, dst_i = torch.tensor([6, 1, 3, 0]), torch.tensor([2, 9, 4, 7])
    stored = _stored(torch.randn(10, 9, generator=gen), precision)
    for flags in ([0, 0, 0, 0, 0], [1, 5, 3, 123456789, 17]):
        got, want = stored.clone(), stored.clone()
        ext.store_rows(src_f, src_i, got, dst_i, precision.value, flags)
        reference.store_rows(src_f, src_i, want, dst_i, precision.value, flags)
        assert torch.equal(got, want), flags
    got_f, want_f = torch.full((8, 9), 3.0), torch.full((8, 9), 3.0)
    ext.load_rows(stored, dst_i, got_f, src_i, precision.value)
    reference.load_rows(stored, dst_i, want_f, src_i, precision.value)
    assert torch.equal(got_f, want_f)


# -- row codecs (quant.py) -----------------------------------------------------------------


def test_codec_errors_name_the_value_and_the_valid_ones(raises_exactly) -> None:
    """Each codec refuses bad input with its exact message: the precision or dtype it got
    and what it takes, the shapes that disagree.

    Bugs caught: a garbled list of valid precisions, a message that drops the value given
    or the shape expected, a row width check that also refuses good rows.
    """
    x = torch.zeros(2, 2)
    valid = "fp32, fp16, bf16, int8, int4"
    with raises_exactly(f"row precision 'fp8' is not supported; valid: {valid}"):
        encode_rows(x, Precision.FP8, stochastic=False)
    with raises_exactly("stochastic_round targets float16 or bfloat16, got torch.float32"):
        stochastic_round(x, torch.float32)
    with raises_exactly("noise (2, 3) must be shaped like x (2, 2)"):
        stochastic_round(x, torch.float16, noise=torch.zeros(2, 3))
    with raises_exactly("quantize_rows packs INT8/INT4 rows, got fp16"):
        quantize_rows(x, Precision.FP16)
    u8 = torch.zeros(2, 8, dtype=torch.uint8)
    with raises_exactly("dequantize_rows unpacks INT8/INT4 rows, got bf16"):
        dequantize_rows(u8, Precision.BF16, 4)
    with raises_exactly("int8 rows of dim 4 are 8 bytes, got shape (2, 7)"):
        dequantize_rows(u8[:, :7], Precision.INT8, 4)
    with raises_exactly("int4 rows of dim 4 are 8 bytes, got shape (8,)"):
        dequantize_rows(u8[0], Precision.INT4, 4)
    assert dequantize_rows(u8, Precision.INT4, 4).shape == (2, 4)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize(
    ("dtype", "lo", "gap", "steps", "grid"),
    [
        (torch.bfloat16, 1.0, 2.0**-7, [1, 0x3000, 0xFFFF], 65536),  # 16 bits below BF16
        (torch.float16, 1.0, 2.0**-10, [1, 0x0C00, 0x1FFF], 8192),  # 13 bits below FP16
        # subnormal, below 2^7 spacings: the FP32 sum |x| 2^24 + (r + 1/2) / 65536 is exact
        (torch.float16, 3 * 2.0**-24, 2.0**-24, [1, 0x3000, 0xFFFF], 65536),
    ],
    ids=["bf16", "fp16", "fp16-subnormal"],
)
def test_stochastic_round_rounds_up_in_exactly_p_of_the_draws(dtype, lo, gap, steps, grid, sign):
    """Over all 65536 draws, ``x = lo + (k / grid) gap`` rounds up (in magnitude) in
    exactly ``k / grid`` of them: the rule is exactly unbiased on its 16-bit draw grid.

    Bugs caught: the draw scaled by another factor than 65536 or clamped to start at 1
    (one draw in 65536 moves to the next code: invisible to statistical tests), the
    wrong number of random bits below the target's last mantissa bit, a subnormal
    rule whose draw is offset or scaled otherwise.
    """
    # Every 16-bit draw once: r = floor(65536 u) takes each value 0..65535 exactly once.
    # (Built here, not at import: a tensor op this large at import starts torch's thread
    # pool in mutmut's fork server, and its forked workers then deadlock.)
    all_draws = (torch.arange(65536, dtype=torch.float32) + 0.5) / 65536
    for k in steps:
        x = torch.full((65536,), sign * (lo + k / grid * gap))
        assert abs(x[0].item()) == lo + k / grid * gap  # exact in FP32
        out = stochastic_round(x, dtype, noise=all_draws).float()
        up = out.abs() == lo + gap
        assert bool((up | (out.abs() == lo)).all())
        assert int(up.sum()) == k * 65536 // grid, k


@pytest.mark.parametrize(
    "precision", [Precision.BF16, Precision.FP16, Precision.INT8, Precision.INT4], ids=str
)
def test_stochastic_rounding_draws_from_the_generator_it_is_given(precision: Precision) -> None:
    """Two generators seeded alike give the same rounding, another seed another one.

    Bug caught: the draws taken from torch's global generator instead of ``generator``
    (a seeded run would not be reproducible), in ``encode_rows``, ``stochastic_round``
    or ``quantize_rows``.
    """
    x = torch.linspace(-1.0, 1.0, 64).repeat(64, 1) + 2.0**-12

    def rounded(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return encode_rows(x, precision, stochastic=True, generator=gen)

    torch.manual_seed(0)
    a = rounded(1)
    torch.manual_seed(99)
    assert torch.equal(rounded(1), a)
    assert not torch.equal(rounded(2), a)


# -- the portable lookup and update (reference.py) -----------------------------------------


def test_rounding_noise_takes_any_seed_and_iteration_modulo_2_to_the_64() -> None:
    """Seeds and iterations wrap modulo 2^64, as the compiled kernel's ``uint64`` does:
    ``-1`` draws as ``2^64 - 1``, ``2^64 + 5`` as ``5``; and no overflow warning is given
    (the 64-bit hash wraps on purpose).

    Bugs caught: another modulus (a negative or large seed then raised ``OverflowError``),
    numpy's overflow warning let through on every backward pass.
    """
    keys = torch.tensor([0, 7, 2**40], dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for a, b in [((-1, 3), (2**64 - 1, 3)), ((2**64 + 5, 3), (5, 3))]:
            want = reference.rounding_noise(*b, keys, 2, 4)
            assert torch.equal(reference.rounding_noise(*a, keys, 2, 4), want)
        for a, b in [((9, -1), (9, 2**64 - 1)), ((9, 2**64 + 5), (9, 5))]:
            want = reference.rounding_noise(*b, keys, 2, 4)
            assert torch.equal(reference.rounding_noise(*a, keys, 2, 4), want)


def test_rounding_noise_draws_are_the_midpoints_of_all_65536_cells() -> None:
    """Each draw is ``(r + 1/2) / 65536`` for a 16-bit ``r``, strictly inside (0, 1), and
    a million draws use every ``r``: ``floor(65536 u)`` gives back the kernel's 16 bits.

    Bugs caught: draws offset by a whole cell (``r - 1/2`` or ``r + 3/2``: the first and
    last cells leave (0, 1) and every rounding decision moves by one draw in 65536) or
    scaled by ``1/65537`` (off the cell midpoints).
    """
    keys = torch.arange(4096, dtype=torch.int64) * 977
    u = reference.rounding_noise(3, 1, keys, 0, 256).double()  # (4096, 256)
    assert bool((u > 0).all())
    assert bool((u < 1).all())
    r = u * 65536 - 0.5
    assert torch.equal(r, r.floor())
    assert torch.equal(r.unique(), torch.arange(65536, dtype=torch.float64))


# The portable lookup and fused update called as the ops call them, on two row stores: an
# FP16 table "x" (its store's only table; a feature of another store for the FP32 one)
# and the FP32 tables "a" (3 rows, two mean-pooled features) and "b" (6 rows).

_B = 3
_REF_TABLES = [
    TableConfig(name="x", num_embeddings=4, dim=2, precision="fp16"),
    TableConfig(
        name="a", num_embeddings=3, dim=2, feature_names=("a1", "a2"), pooling=PoolingMode.MEAN
    ),
    TableConfig(name="b", num_embeddings=6, dim=3),
]
_REF_COLS = 2 + 2 + 2 + 3  # x, a1, a2, b


def _ref_stores(kind: OptimizerKind) -> list[tuple[RowStore, list[torch.Tensor]]]:
    slices = [TableSlice(table=t, row_start=3 * i, col_start=i) for i, t in enumerate(_REF_TABLES)]
    stores = plan_stores(_REF_TABLES, kind)
    return [(st, st.meta(_REF_TABLES, slices, torch.device("cpu"))) for st in stores]


def _ref_batch(bags: dict[str, list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-major ``(values, lengths)`` of the four features, ``_B`` samples each."""
    feats = [bags.get(f, [[]] * _B) for f in ("x", "a1", "a2", "b")]
    values = [i for f in feats for bag in f for i in bag]
    lengths = [len(bag) for f in feats for bag in f]
    return torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int32)


_REF_BAGS = {  # duplicates within and across bags, an empty bag; b's ids beyond a's rows
    "x": [[3, 3], [0], [1, 2]],
    "a1": [[2, 0], [], [2]],
    "a2": [[1], [2, 2, 2], [0]],
    "b": [[5, 4], [0], [5, 3, 5]],
}


def _ref_rows(store: RowStore, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(store.numel, generator=gen) * 0.5).to(store.precision.torch_dtype)


@pytest.mark.parametrize("psw", [False, True], ids=["no-psw", "psw"])
def test_portable_forward_and_update_equal_the_compiled_kernel(psw: bool) -> None:
    """Both stores, the portable ``pooled_forward`` gives the compiled kernel's pooled
    columns bit for bit, and ``backward_update`` its rows, Adam's state (betas 0.5 /
    0.75, weight decay, two steps, FP16 stochastic rounding) and the per-id weights'
    gradient, to the last bit of Adam's moments.

    Bugs caught: features pooled from or written to another table's rows or columns,
    mean pooling by another count, a feature of another store stopping the loop, the
    per-feature value ranges (``starts``) taken per bag, Adam's betas or weight decay
    left at their defaults in the update, the rows' rounding keys or columns, the
    per-id weights' gradient lost or allocated when not asked for.
    """
    ext = compiled_cpu_kernels()
    if ext is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    gen = torch.Generator().manual_seed(4)
    values, lengths = _ref_batch(_REF_BAGS)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if psw else None
    hparams = [0.0625, 1e-3, 0.5, 0.75, 0.125]
    for store, meta in _ref_stores(OptimizerKind.ADAM):
        rows = _ref_rows(store, gen)
        outs, states, results = [], [], []
        for impl in (ext, reference):
            w = rows.clone()
            st = [torch.full((n,), 0.25) for n in store.state_numel]
            offs = [torch.tensor(o, dtype=torch.int64) for o in store.state_offsets]
            out = torch.zeros(_B, _REF_COLS)
            bad = impl.tbe_forward if impl is ext else impl.pooled_forward
            assert bad(
                w, meta, values, lengths, weights, out, store.precision.value, True
            ).tolist() == [-1, -1]
            res = []
            for it in range(2):
                grad = torch.randn(_B, _REF_COLS, generator=torch.Generator().manual_seed(it))
                update = impl.tbe_backward_update if impl is ext else impl.backward_update
                res.append(
                    update(
                        grad,
                        w,
                        meta,
                        values,
                        lengths,
                        weights,
                        st,
                        offs,
                        "adam",
                        hparams,
                        store.precision.value,
                        [1, 9, it, 1, int(psw)],
                    )
                )
            outs.append((out, w))
            states.append(st)
            results.append(res)
        (out_c, w_c), (out_r, w_r) = outs
        assert torch.equal(out_r, out_c)
        assert out_r.abs().sum() > 0
        assert not torch.equal(w_r, rows)
        # Adam's moments may differ from the kernel's in the last bit (its FMAs).
        atol = 1e-6 if store.precision is Precision.FP32 else 2e-3  # one FP16 step
        torch.testing.assert_close(w_r.float(), w_c.float(), rtol=1e-5, atol=atol)
        for r, c in zip(states[1], states[0], strict=True):
            torch.testing.assert_close(r, c, rtol=1e-5, atol=1e-6)
        for r, c in zip(results[1], results[0], strict=True):
            assert r.shape == c.shape == ((values.numel(),) if psw else (0,))
            torch.testing.assert_close(r, c, rtol=1e-5, atol=1e-6)


def test_portable_update_without_per_id_weights_returns_no_gradient() -> None:
    """Asked for the per-id weights' gradient (flag 1) when there are no weights, the
    update returns an empty tensor, as the op's contract says.

    Bug caught: the gradient buffer allocated from absent weights (a crash).
    """
    values, lengths = _ref_batch(_REF_BAGS)
    store, meta = _ref_stores(OptimizerKind.SGD)[1]
    w = torch.zeros(store.numel)
    got = reference.backward_update(
        torch.ones(_B, _REF_COLS), w, meta, values, lengths, None, [], [], "sgd",
        [1.0, 1e-8, 0.9, 0.999, 0.0], "fp32", [0, 0, 0, 1, 1],
    )  # fmt: skip
    assert got.shape == (0,)
    assert w.abs().sum() > 0


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT4], ids=lambda p: p.value)
def test_per_id_weight_gradient_of_packed_rows_equals_the_compiled_kernel(
    precision: Precision,
) -> None:
    """For packed (INT8/INT4) rows the per-id weights' gradient is ``grad . decode(row)``,
    the row decoded with its table's dim, as the compiled kernel computes it.

    Bug caught: the rows decoded without their dim for that gradient (the float formats
    do not need it, so only packed rows show it).
    """
    ext = compiled_cpu_kernels()
    if ext is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    table = TableConfig(name="q", num_embeddings=5, dim=3, precision=precision.value)
    (store,) = plan_stores([table], OptimizerKind.SGD)
    meta = store.meta([table], [TableSlice(table=table)], torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    rows = _stored(torch.randn(5, 3, generator=gen), precision).flatten()
    values = torch.tensor([4, 1, 1, 0, 3, 2])
    lengths = torch.tensor([2, 0, 4], dtype=torch.int32)
    psw = torch.rand(6, generator=gen) + 0.5
    grad = torch.randn(3, 3, generator=gen)
    got = [
        impl(
            grad,
            rows.clone(),
            meta,
            values,
            lengths,
            psw,
            [],
            [],
            "sgd",
            [0.0, 1e-8, 0.9, 0.999, 0.0],
            precision.value,
            [0, 0, 0, 1, 1],
        )
        for impl in (ext.tbe_backward_update, reference.backward_update)
    ]
    assert got[0].shape == (6,)
    assert got[0].abs().sum() > 0
    torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("bags", "feature", "bad"),
    [
        ({"a1": [[0], [3], []]}, 1, 3),  # a's first id past the end (table 0 of the store)
        ({"a1": [[-1, 2], [], []]}, 1, -1),
        ({"a2": [[0, 1], [2], []], "b": [[0, 6], [], []]}, 3, 6),  # 0 is fine: names 6
        ({"b": [[5], [-2, 4], [7]]}, 3, -2),  # the lowest when both ends are out
    ],
    ids=["end", "negative", "after-a-good-feature", "both-ends"],
)
def test_out_of_range_ids_are_named_as_the_compiled_kernel_names_them(
    bags: dict[str, list[list[int]]], feature: int, bad: int
) -> None:
    """The forward returns ``[feature, id]`` of the first feature with an id outside its
    table (the lowest id if negative, else the smallest past the end); the update refuses it before
    touching any row, naming feature, id and rows, word for word as the compiled kernel.
    Valid ids of the features around it (and of the other store's feature) pass.

    Bugs caught: the table's last row + 1 accepted, id 0 taken for out of range or
    named instead of the bad one, table 0's features or the features after an empty one
    or another store's one not checked, ids checked against another table's rows.
    """
    ext = compiled_cpu_kernels()
    if ext is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    values, lengths = _ref_batch({"x": [[3], [], [0]], **bags})
    store, meta = _ref_stores(OptimizerKind.SGD)[1]
    rows = torch.randn(store.numel)
    out = torch.zeros(_B, _REF_COLS)
    got = reference.pooled_forward(rows, meta, values, lengths, None, out, "fp32", True)
    assert got.tolist() == [feature, bad]
    assert ext.tbe_forward(rows, meta, values, lengths, None, out, "fp32", True).tolist() == [
        feature,
        bad,
    ]
    table = _REF_TABLES[1 if feature < 3 else 2]
    message = (
        f"tetrarec tbe backward: feature {feature} (its index in the feature order): "
        f"id {bad} is outside its table of {table.num_embeddings} rows"
    )
    for impl in (ext.tbe_backward_update, reference.backward_update):
        w = rows.clone()
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
            impl(
                torch.ones(_B, _REF_COLS), w, meta, values, lengths, None, [], [], "sgd",
                [1.0, 1e-8, 0.9, 0.999, 0.0], "fp32", [0, 0, 0, 1, 0],
            )  # fmt: skip
        assert torch.equal(w, rows)


def test_update_names_the_first_out_of_range_id_by_position_as_the_compiled_kernel() -> None:
    """With several ids of one feature out of range, both updates name the first by
    position (7 here, before -2).

    Bug caught (found by this test, fixed in ``reference._check_ids_before_update``): the
    portable update, documented to raise as the compiled kernel does, named the
    feature's lowest id if negative, else its highest (-2 here).
    """
    ext = compiled_cpu_kernels()
    if ext is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    values, lengths = _ref_batch({"b": [[5], [4, 7], [-2]]})
    store, meta = _ref_stores(OptimizerKind.SGD)[1]
    messages = []
    for impl in (ext.tbe_backward_update, reference.backward_update):
        with pytest.raises(RuntimeError) as err:
            impl(
                torch.ones(_B, _REF_COLS), torch.zeros(store.numel), meta, values, lengths,
                None, [], [], "sgd", [1.0, 1e-8, 0.9, 0.999, 0.0], "fp32", [0, 0, 0, 1, 0],
            )  # fmt: skip
        messages.append(str(err.value).splitlines()[0])
    assert messages[0].endswith("id 7 is outside its table of 6 rows")
    assert messages[1] == messages[0]


def test_lookup_names_the_smallest_out_of_range_id_as_the_compiled_kernel() -> None:
    """With several ids of one feature past its table's end, both lookups name the
    smallest (7 here, after 9 by position), the one the compiled kernel keeps whatever
    order its threads meet them in.

    Bug caught: the portable lookup named the feature's highest id (9 here), another id
    than the compiled path for the same batch.
    """
    ext = compiled_cpu_kernels()
    if ext is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    values, lengths = _ref_batch({"b": [[9], [2, 7], [8]]})
    store, meta = _ref_stores(OptimizerKind.SGD)[1]
    rows = torch.randn(store.numel)
    got = [
        impl(rows, meta, values, lengths, None, torch.zeros(_B, _REF_COLS), "fp32", True)
        for impl in (ext.tbe_forward, reference.pooled_forward)
    ]
    assert got[0].tolist() == [3, 7]
    assert got[1].tolist() == got[0].tolist()


# -- layout.py: where each table sits in the flat row stores ---------------------------


def _layout_tables() -> list[TableConfig]:
    return [
        TableConfig(name="a", num_embeddings=10, dim=4),
        TableConfig(name="b", num_embeddings=7, dim=6, precision=Precision.INT8),
        TableConfig(name="c", num_embeddings=5, dim=3),
        TableConfig(name="d", num_embeddings=3, dim=8, precision=Precision.INT8),
    ]


def test_plan_stores_places_tables_back_to_back_per_precision() -> None:
    """Stores in order of first precision; each table's storage, row and state offsets
    (three tables in one store) are the running sums of the tables before it in its
    store (row-wise Adam: a ``dim`` wide ``exp_avg``, one ``exp_avg_sq`` and one
    ``step`` value per row).

    Bugs caught: a table's offsets counted from the wrong table or with the wrong width
    (the kernels would read another table's rows or state), state names for another
    dim or kind, the stores' sizes off.
    """
    tables = [*_layout_tables(), TableConfig(name="e", num_embeddings=6, dim=2)]
    stores = plan_stores(tables, OptimizerKind.ROWWISE_ADAM)
    b_w = row_width(Precision.INT8, 6)
    d_w = row_width(Precision.INT8, 8)
    assert (b_w, d_w) == (12, 12)
    assert stores == (
        RowStore(
            precision=Precision.FP32,
            tables=(0, 2, 4),
            w_offsets=(0, 40, 55),
            row_offsets=(0, 10, 15),
            state_names=("exp_avg", "exp_avg_sq", "step"),
            state_offsets=((0, 40, 55), (0, 10, 15), (0, 10, 15)),
            numel=67,
            state_numel=(67, 21, 21),
        ),
        RowStore(
            precision=Precision.INT8,
            tables=(1, 3),
            w_offsets=(0, 7 * b_w),
            row_offsets=(0, 7),
            state_names=("exp_avg", "exp_avg_sq", "step"),
            state_offsets=((0, 42), (0, 7), (0, 7)),
            numel=7 * b_w + 3 * d_w,
            state_numel=(42 + 24, 10, 10),
        ),
    )
    (sgd,) = plan_stores(_layout_tables()[:1], OptimizerKind.SGD)
    assert (sgd.state_names, sgd.state_offsets, sgd.state_numel) == ((), (), ())


def test_plan_stores_rejects_fp8_rows_by_name() -> None:
    """FP8 tables are refused before any store is planned, naming the precision.

    Bug caught: the precision check dropped, so an FP8 table got a store of FP8 width.
    """
    tables = [TableConfig(name="a", num_embeddings=4, dim=4, precision=Precision.FP8)]
    with pytest.raises(ValueError, match="fp8"):
        plan_stores(tables, OptimizerKind.SGD)


def test_row_store_meta_is_the_nine_int64_tensors_of_ops() -> None:
    """The meta of the INT8 store: its tables' storage offsets, dims, rows, row offsets;
    per feature of the whole collection its table in the store (-1: another store), its
    first output column and whether it is mean-pooled; per table its rounding key and
    first global column. They are made on the device asked for.

    Bugs caught: features mapped to the wrong table or column (the lookup would write a
    feature into another's columns), mean pooling flagged for sum, the rounding keys or
    columns of other tables (stochastic rounding would differ from the unsharded run),
    the tensors made on the CPU for a module on another device.
    """
    tables = _layout_tables()
    tables[1] = TableConfig(
        name="b",
        num_embeddings=7,
        dim=6,
        precision=Precision.INT8,
        feature_names=("b1", "b2"),
        pooling=PoolingMode.MEAN,
    )
    slices = [TableSlice(table=t, row_start=i, col_start=2 * i) for i, t in enumerate(tables)]
    _, int8 = plan_stores(tables, OptimizerKind.ADAGRAD)
    meta = int8.meta(tables, slices, torch.device("cpu"))
    assert all(m.dtype == torch.int64 and m.device.type == "cpu" for m in meta)
    b_w = row_width(Precision.INT8, 6)
    assert [m.tolist() for m in meta] == [
        [0, 7 * b_w],
        [6, 8],
        [7, 3],
        [0, 7],
        [-1, 0, 0, -1, 1],
        [0, 4, 10, 16, 19],
        [0, 1, 1, 0, 0],
        [slices[1].row_key(), slices[3].row_key()],
        [2, 6],
    ]
    assert slices[1].row_key() != slices[3].row_key()
    elsewhere = int8.meta(tables, slices, torch.device("meta"))
    assert [m.device.type for m in elsewhere] == ["meta"] * 9


# -- memory.py: huge-page advice for the large host buffers -----------------------------

_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_MIB = 1 << 20


def _huge_page_spans(t: torch.Tensor) -> list[tuple[int, int]]:
    """The parts of ``t``'s memory in mappings flagged ``hg`` (MADV_HUGEPAGE)."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    spans, vma = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                vma = (int(m.group(1), 16), int(m.group(2), 16))
            elif line.startswith("VmFlags") and vma is not None:
                lo, hi = max(vma[0], start), min(vma[1], end)
                if lo < hi and "hg" in line.split():
                    spans.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _aligned_interior(t: torch.Tensor) -> list[tuple[int, int]]:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // (2 * _MIB)) * (2 * _MIB)
    return [(lo, lo + (end - lo) // (2 * _MIB) * (2 * _MIB))]


def _covers(spans: list[tuple[int, int]], interior: list[tuple[int, int]]) -> bool:
    """Every span of ``interior`` lies inside one of ``spans``. (A 32 MiB buffer may be
    served by glibc from memory an earlier test advised, flagged beyond the interior, so
    only the tests on fresh mappings compare the spans exactly.)"""
    return all(any(lo <= a and b <= hi for lo, hi in spans) for a, b in interior)


needs_thp = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.path.exists(_THP)),
    reason="transparent huge pages (Linux) needed",
)


@needs_thp
def test_advise_huge_pages_flags_exactly_the_2mib_aligned_interior(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh 32 MiB CPU buffer (the threshold) is advised ``MADV_HUGEPAGE`` over its
    2 MiB-aligned interior, and nothing else of it: the kernel's ``hg`` flag in
    ``/proc/self/smaps`` covers exactly that span.

    Bugs caught: another madvise advice (15 is ``MADV_NOHUGEPAGE``), an unaligned or
    wrongly sized span (madvise refuses it, or advises memory outside the buffer), the
    threshold raised above 32 MiB, the environment default read as "off".
    """
    monkeypatch.delenv("TETRAREC_HUGE_PAGES", raising=False)
    t = torch.empty(32 * _MIB, dtype=torch.uint8)
    if _huge_page_spans(t):  # glibc served it from memory that an earlier test advised
        pytest.skip("the buffer reuses memory already advised by an earlier allocation")
    assert advise_huge_pages(t) is True
    assert _huge_page_spans(t) == _aligned_interior(t)


@needs_thp
def test_advise_huge_pages_declines_small_off_or_non_cpu_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No advice (``False``, no ``hg`` flag added) below 32 MiB, with
    ``TETRAREC_HUGE_PAGES=0``, or for a tensor not on the CPU; ``=1`` advises.

    Bugs caught: the size threshold lowered, the switch ignored or inverted, advice given
    to a non-CPU tensor's address.
    """
    # The memory may already be flagged (glibc reuses what an earlier test advised): a
    # decline must leave the flags as they were.
    monkeypatch.setenv("TETRAREC_HUGE_PAGES", "0")
    off = torch.empty(64 * _MIB, dtype=torch.uint8)
    before = _huge_page_spans(off)
    assert advise_huge_pages(off) is False
    assert _huge_page_spans(off) == before
    monkeypatch.setenv("TETRAREC_HUGE_PAGES", "1")
    small = torch.empty(32 * _MIB - 1, dtype=torch.uint8)
    before = _huge_page_spans(small)
    assert advise_huge_pages(small) is False
    assert _huge_page_spans(small) == before
    assert advise_huge_pages(torch.empty(16 * _MIB, dtype=torch.int64, device="meta")) is False
    on = torch.empty(8 * _MIB, dtype=torch.float32)
    assert advise_huge_pages(on) is True
    assert _covers(_huge_page_spans(on), _aligned_interior(on))


def test_host_buffer_has_the_size_type_and_fill_asked_for() -> None:
    """``host_buffer(n, dtype, device, fill)`` is 1-D, ``n`` long, of ``dtype``, every
    element ``fill``; a large one is also advised.

    Bugs caught: the fill skipped or given another value, the buffer of another size or
    type (the flat tables would be cut wrongly).
    """
    small = host_buffer(7, torch.float16, torch.device("cpu"), fill=2.5)
    assert small.shape == (7,)
    assert small.dtype == torch.float16
    assert torch.equal(small, torch.full((7,), 2.5, dtype=torch.float16))
    empty = host_buffer(3, torch.int32, torch.device("cpu"))
    assert empty.shape == (3,)
    assert empty.dtype == torch.int32
    big = host_buffer(8 * _MIB, torch.float32, torch.device("cpu"), fill=-1.0)
    assert bool((big == -1.0).all())
    if sys.platform.startswith("linux") and os.path.exists(_THP):
        assert _covers(_huge_page_spans(big), _aligned_interior(big))


@needs_thp
@pytest.mark.parametrize(("skew", "extra"), [(0, 1), (1, 0)], ids=["aligned", "one-past"])
def test_advise_huge_pages_rounds_the_span_inward_to_2mib(skew: int, extra: int) -> None:
    """A buffer that starts exactly on a 2 MiB boundary is advised from its first byte;
    one that starts a byte past one, from the next boundary; a length one byte over a
    multiple of 2 MiB is advised to the multiple only.

    Bugs caught: the start rounded up past an aligned start, or down to before the
    buffer (advising memory the buffer does not own), the length not rounded down to a
    whole huge page.
    """
    import mmap

    # A fresh mapping: torch.empty may get memory that glibc reuses from a buffer an
    # earlier test advised, flagged beyond this test's span (seen in a CI run).
    region = mmap.mmap(-1, 40 * _MIB)
    base = torch.frombuffer(region, dtype=torch.uint8)
    first = -(-base.data_ptr() // (2 * _MIB)) * (2 * _MIB) - base.data_ptr() + skew
    t = base[first : first + 32 * _MIB + extra]
    assert advise_huge_pages(t) is True
    assert _huge_page_spans(t) == _aligned_interior(t)


@needs_thp
def test_advise_huge_pages_reports_a_refused_advice(caplog: pytest.LogCaptureFixture) -> None:
    """When madvise fails (here: part of the range is not mapped) the advice is not
    taken (``False``) and the debug log names the call and the OS error.

    Bugs caught: a failure reported as advice taken, the log without the error.
    """
    import ctypes
    import logging
    import mmap

    from tetrarec.kernels import memory

    region = mmap.mmap(-1, 64 * _MIB)
    t = torch.frombuffer(region, dtype=torch.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    hole = -(-t.data_ptr() // (2 * _MIB)) * (2 * _MIB) + 8 * _MIB
    assert libc.munmap(ctypes.c_void_p(hole), ctypes.c_size_t(2 * _MIB)) == 0
    with caplog.at_level(logging.DEBUG, logger=memory.__name__):
        assert advise_huge_pages(t) is False
    assert [r.getMessage() for r in caplog.records] == [
        f"madvise(MADV_HUGEPAGE) failed: {os.strerror(12)}"
    ]
    del t


def test_advise_huge_pages_without_libc_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Elsewhere than Linux there is no libc to advise with: ``False``, no call.

    Bug caught: a missing libc reported as advice taken.
    """
    from tetrarec.kernels import memory

    monkeypatch.delenv("TETRAREC_HUGE_PAGES", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    memory._libc.cache_clear()
    try:
        assert advise_huge_pages(torch.empty(32 * _MIB, dtype=torch.uint8)) is False
    finally:
        monkeypatch.undo()
        memory._libc.cache_clear()


def test_host_buffer_is_made_on_the_device_asked_for() -> None:
    """``host_buffer(..., device)`` puts the buffer on ``device``.

    Bug caught: the buffer made on the CPU for a module on another device.
    """
    t = host_buffer(5, torch.float32, torch.device("meta"), fill=1.0)
    assert t.device.type == "meta"
    assert t.shape == (5,)


# -- fused_optim.py: the torch.optim surface of the fused update ---------------------------

_ADAM = SparseOptimizerSpec(
    kind="adam", lr=0.125, eps=1e-6, beta1=0.75, beta2=0.875, weight_decay=0.25
)


def _adam_collection() -> FusedEmbeddingBagCollection:
    tables = [
        TableConfig(name="a", num_embeddings=5, dim=3),
        TableConfig(name="b", num_embeddings=4, dim=2, precision="fp16"),
    ]
    return FusedEmbeddingBagCollection(tables, _ADAM, seed=0)


class _NoTables:
    """A ``FusedState`` that holds no table: a rank of a sharded run given no shard."""

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {}

    def load_optimizer_state(self, state: object) -> None:
        assert state == {}

    def storages(self) -> list[torch.Tensor]:
        return []


def test_fused_optimizer_groups_the_modules_storages_with_the_spec() -> None:
    """One group: the module's storages as ``params`` (the same tensors) and the spec's
    hyperparameters under torch.optim's names; an owner without storages gets one empty
    placeholder (torch.optim refuses an empty parameter list).

    Bugs caught: the placeholder used whatever the storages (``and`` for ``or``: a
    scheduler or ``clip_grad_norm_`` over the optimizer's params would not see the
    rows), a placeholder holding an element, hyperparameters under other names.
    """
    ebc = _adam_collection()
    group = ebc.fused_optimizer.param_groups[0]
    assert len(ebc.fused_optimizer.param_groups) == 1
    assert sorted(group) == ["betas", "eps", "lr", "params", "weight_decay"]
    assert [p is s for p, s in zip(group["params"], ebc.storages(), strict=True)] == [True] * 2
    assert (group["lr"], group["eps"], group["betas"], group["weight_decay"]) == (
        0.125,
        1e-6,
        (0.75, 0.875),
        0.25,
    )
    empty = FusedOptimizer(_ADAM, _NoTables()).param_groups[0]["params"]
    assert [p.shape for p in empty] == [torch.Size([0])]


def test_kernel_hparams_reads_the_group_and_refuses_each_bad_setting(raises_exactly) -> None:
    """``[lr, eps, beta1, beta2, weight_decay]`` from the group as it is now; a learning
    rate of 0 (a warm-up starts there) and no weight decay are allowed; a negative
    learning rate, an eps of 0 or below, or a negative weight decay, each alone, is
    refused with the exact message; so is a NaN or infinite setting, and a beta
    outside [0, 1).

    Bugs caught: ``or`` made ``and`` (a bad setting passing when another is good), lr 0
    or weight decay 0 refused, eps 0 accepted (Adagrad would divide by zero), an empty
    message; a NaN learning rate (from a scheduler) accepted because ``nan < 0`` is
    false, which wrote NaN into every touched row; Adam's beta 1.5 accepted.
    """
    opt = _adam_collection().fused_optimizer
    group = opt.param_groups[0]
    group.update(lr=0.0, weight_decay=0.0, betas=(0.5, 0.625))
    assert opt.kernel_hparams() == [0.0, 1e-6, 0.5, 0.625, 0.0]
    nan, inf = float("nan"), float("inf")
    for key, bad, named in [
        ("lr", -0.5, "{'lr': -0.5}"),
        ("eps", 0.0, "{'eps': 0.0}"),
        ("eps", -1.0, "{'eps': -1.0}"),
        ("weight_decay", -0.5, "{'weight_decay': -0.5}"),
        ("lr", nan, "{'lr': nan}"),
        ("lr", inf, "{'lr': inf}"),
        ("eps", nan, "{'eps': nan}"),
        ("weight_decay", nan, "{'weight_decay': nan}"),
        ("betas", (1.5, 0.625), "{'betas': (1.5, 0.625)}"),
        ("betas", (0.5, nan), "{'betas': (0.5, nan)}"),
        ("betas", (-0.1, 0.625), "{'betas': (-0.1, 0.625)}"),
    ]:
        good = group[key]
        group[key] = bad
        with raises_exactly(f"fused optimizer: bad settings {named} ({SPARSE_HPARAM_RULES})"):
            opt.kernel_hparams()
        group[key] = good


def test_fused_optimizer_state_dict_is_the_hyperparameters_kind_and_module_state() -> None:
    """``{"state": owner's optimizer_state(), "param_groups": [hyperparameters + kind]}``,
    without the ``params`` (the rows are saved by the module).

    Bugs caught: the groups saved as only their params or without the kind, the kind
    under another key or ``None``, the two parts under other keys.
    """
    ebc = _adam_collection()
    sd = ebc.fused_optimizer.state_dict()
    assert sorted(sd) == ["param_groups", "state"]
    assert sd["param_groups"] == [
        {"lr": 0.125, "eps": 1e-6, "betas": (0.75, 0.875), "weight_decay": 0.25, "kind": "adam"}
    ]
    state = ebc.optimizer_state()
    assert sorted(sd["state"]) == sorted(state) == ["a", "b"]
    for t, names in state.items():
        assert sorted(sd["state"][t]) == sorted(names)
        assert all(torch.equal(sd["state"][t][k], v) for k, v in names.items())


def test_fused_optimizer_load_restores_state_and_hyperparameters(raises_exactly) -> None:
    """Loading sets the module's state bitwise and the group's hyperparameters (``betas``
    back to a tuple when saved as a list, as a JSON round trip gives), keeps the group's
    own params and adds no ``kind`` to it; groups saved without a kind load; a saved
    optimizer of another kind is refused with the exact message.

    Bugs caught: only the kind copied into the group (the hyperparameters of the
    checkpoint lost), the kind copied too, ``betas`` left a list, a kind-less
    checkpoint refused, another kind's state loaded (its layout differs), an empty
    message.
    """
    ebc = _adam_collection()
    opt = ebc.fused_optimizer
    storages = opt.param_groups[0]["params"]
    state = {
        t: {k: torch.full_like(v, 0.5 + i) for i, (k, v) in enumerate(names.items())}
        for t, names in ebc.optimizer_state().items()
    }
    saved = {"lr": 0.5, "eps": 1e-4, "betas": [0.25, 0.375], "weight_decay": 0.0625}
    opt.load_state_dict({"state": state, "param_groups": [{**saved, "kind": "adam"}]})
    group = opt.param_groups[0]
    assert group == {**saved, "betas": (0.25, 0.375), "params": storages}
    assert type(group["betas"]) is tuple
    assert opt.kernel_hparams() == [0.5, 1e-4, 0.25, 0.375, 0.0625]
    for t, names in ebc.optimizer_state().items():
        assert all(torch.equal(v, state[t][k]) for k, v in names.items()), t

    opt.load_state_dict({"state": state, "param_groups": [{**saved, "lr": 0.25}]})
    assert opt.param_groups[0]["lr"] == 0.25
    with raises_exactly("the saved fused optimizer is 'sgd', this one is 'adam'"):
        opt.load_state_dict({"state": {}, "param_groups": [{**saved, "kind": "sgd"}]})
