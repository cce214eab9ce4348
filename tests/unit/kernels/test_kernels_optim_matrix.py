"""Every optimizer at every row precision against a plain dense reference, step by step.

The reference below is written from the published rules, independently of
``tetrarec/kernels/optim_rules.py`` (never imported here), one row at a time in float64:

    g'  = g + wd * w                                     (L2 weight decay, as torch.optim)
    SGD              w -= lr * g'
    Adagrad (Duchi)  acc += g'^2;        w -= lr * g' / (sqrt(acc) + eps)
    row-wise Adagrad acc += mean(g'^2);  w -= lr * g' / (sqrt(acc) + eps)      (FBGEMM)
    Adam (Kingma-Ba) step += 1; m = b1 m + (1 - b1) g'; v = b2 v + (1 - b2) g'^2
                     w -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)
    row-wise Adam    as Adam with one v per row: v = b2 v + (1 - b2) mean(g'^2)

Only rows whose id occurs in the batch are updated ("lazy"): an untouched row keeps its
weights, its moments and its step count, so rows touched at different steps have
different step counts and bias corrections. Each step's batch leaves some rows untouched.

Low-precision rows: each step starts the reference from the rows as stored (decoded),
so that the only difference left is the rounding of the new rows, bounded from the
format alone: half a spacing of FP16 (10 mantissa bits) or BF16 (7) around the exact
value; for INT8/INT4 half a step of (max - min) / 255 or / 15 of the exact row, plus
the FP16 rounding of the stored scale and bias. The stored scale is checked against
(max - min) / levels too, so a codec that used half the levels fails. Optimizer state
is FP32 and compared tightly.
"""

import itertools
import math

import pytest
import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.kernels._build import compiled_cpu_kernels
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "rowwise_adam"]
PRECISIONS = ["fp32", "fp16", "bf16", "int8", "int4"]
SPECS = {
    "sgd": dict(kind="sgd", lr=0.1, weight_decay=0.05),
    "adagrad": dict(kind="adagrad", lr=0.1, eps=1e-3, initial_accumulator=0.02, weight_decay=0.05),
    "rowwise_adagrad": dict(kind="rowwise_adagrad", lr=0.1, eps=1e-3, weight_decay=0.05),
    "adam": dict(kind="adam", lr=0.02, eps=1e-3, beta1=0.8, beta2=0.95, weight_decay=0.05),
    "rowwise_adam": dict(
        kind="rowwise_adam", lr=0.02, eps=1e-3, beta1=0.8, beta2=0.95, weight_decay=0.05
    ),
}
STATE_NAMES = {
    "sgd": (),
    "adagrad": ("sum",),
    "rowwise_adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq", "step"),
    "rowwise_adam": ("exp_avg", "exp_avg_sq", "step"),
}
BATCH = 4
# Rows each step touches, per table. Table "t" (12 rows, dim 10: the compiled FP16 loop
# of 8 plus a tail of 2) has rows 10 and 11 never touched and >= 9 rows in steps 0 and
# 3 (row-wise Adagrad's 8-row interleaved branch); table "u" (9 rows, dim 3) never row 8.
TOUCHED = {
    "t": [list(range(9)), [0, 1, 2], [3, 4, 5, 6, 7, 8, 9], list(range(10))],
    "u": [[0, 1, 2], [3, 4], [0, 5, 6, 7], [1, 3]],
}
STEPS = len(TOUCHED["t"])


def _opt_state(ebc):
    """``{table: {state name: (rows, width) FP64}}`` of a fused collection."""
    state = ebc.fused_optimizer.state_dict()["state"]
    return {
        table: {name: v.reshape(v.shape[0], -1).double() for name, v in names.items()}
        for table, names in state.items()
    }


def _stored(ebc):
    """Every stored tensor: ``weights.<table>`` rows and ``state.<table>.<name>`` (copies)."""
    out = {k: v.clone() for k, v in ebc.state_dict().items()}
    for table, names in ebc.fused_optimizer.state_dict()["state"].items():
        out.update({f"state.{table}.{n}": v.clone() for n, v in names.items()})
    return out


def _tables(precision, mean):
    return [
        TableConfig(
            name="t", num_embeddings=12, dim=10, precision=precision, feature_names=("f0", "f1")
        ),
        TableConfig(
            name="u",
            num_embeddings=9,
            dim=3,
            precision=precision,
            pooling="mean" if mean else "sum",
            feature_names=("f2",),
        ),
    ]


def _bags(rows, n_bags, gen):
    """Every row of ``rows`` at least once, some twice or more, cut into ``n_bags`` bags
    (some empty)."""
    ids = torch.tensor(rows + rows[::2] + rows[:1] * 3)
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    cuts = torch.randint(0, ids.numel() + 1, (n_bags - 1,), generator=gen).sort().values
    bounds = [0, *cuts.tolist(), ids.numel()]
    return [ids[a:b].tolist() for a, b in itertools.pairwise(bounds)]


def make_batches(weighted, seed=0):
    """Per step: (bags per feature, per-id weights per feature or None, grad_out)."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(STEPS):
        t_bags = _bags(TOUCHED["t"][s], 2 * BATCH, gen)
        bags = {
            "f0": t_bags[:BATCH],
            "f1": t_bags[BATCH:],
            "f2": _bags(TOUCHED["u"][s], BATCH, gen),
        }
        weights = None
        if weighted:
            weights = {
                f: [(torch.rand(len(b), generator=gen) * 1.5 + 0.25).tolist() for b in fb]
                for f, fb in bags.items()
            }
        grad = torch.randn(BATCH, 10 + 10 + 3, generator=gen)
        steps.append((bags, weights, grad))
    return steps


# -- the dense reference ----------------------------------------------------------------


def reference_forward(w, bags, weights, mean):
    """Pooled (B, 23): each bag sums its rows (times per-id weights) / length if mean."""
    out = torch.zeros(BATCH, 23, dtype=torch.float64)
    for f, col, table in (("f0", 0, "t"), ("f1", 10, "t"), ("f2", 20, "u")):
        dim = w[table].shape[1]
        for b, ids in enumerate(bags[f]):
            for k, i in enumerate(ids):
                pw = weights[f][b][k] if weights else 1.0
                out[b, col : col + dim] += pw * w[table][i]
            if mean[table] and ids:
                out[b, col : col + dim] /= len(ids)
    return out


def row_gradients(bags, weights, grad, mean):
    """``{table: {row: summed gradient (D,)}}`` of the rows the batch touches."""
    grads = {"t": {}, "u": {}}
    for f, col, table in (("f0", 0, "t"), ("f1", 10, "t"), ("f2", 20, "u")):
        dim = 10 if table == "t" else 3
        for b, ids in enumerate(bags[f]):
            for k, i in enumerate(ids):
                g = grad[b, col : col + dim].double()
                if weights:
                    g = g * weights[f][b][k]
                if mean[table]:
                    g = g / len(ids)
                grads[table][i] = grads[table].get(i, torch.zeros(dim, dtype=torch.float64)) + g
    return grads


def apply_published_rule(name, spec, w, g, state):
    """One update of one row ``w`` (D,) float64 with gradient ``g``; ``state`` in place."""
    g = g + spec.weight_decay * w
    lr, eps = spec.lr, spec.eps
    if name == "sgd":
        return w - lr * g
    if name == "adagrad":
        state["sum"] = state["sum"] + g * g
        return w - lr * g / (state["sum"].sqrt() + eps)
    if name == "rowwise_adagrad":
        state["sum"] = state["sum"] + (g * g).mean()
        return w - lr * g / (state["sum"].sqrt() + eps)
    b1, b2 = spec.beta1, spec.beta2
    state["step"] = state["step"] + 1
    t = float(state["step"][0])
    g2 = g * g if name == "adam" else (g * g).mean()
    state["exp_avg"] = b1 * state["exp_avg"] + (1 - b1) * g
    state["exp_avg_sq"] = b2 * state["exp_avg_sq"] + (1 - b2) * g2
    m_hat = state["exp_avg"] / (1 - b1**t)
    v_hat = state["exp_avg_sq"] / (1 - b2**t)
    return w - lr * m_hat / (v_hat.sqrt() + eps)


def initial_state(name, spec, rows, dim):
    widths = {"sum": dim if name == "adagrad" else 1, "exp_avg": dim, "step": 1}
    widths["exp_avg_sq"] = dim if name == "adam" else 1
    return {
        n: torch.full((rows, widths[n]), spec.initial_accumulator if n == "sum" else 0.0).double()
        for n in STATE_NAMES[name]
    }


# -- format bounds, from the format alone -----------------------------------------------


def float_rounding_bound(x, mantissa_bits, min_normal_exp):
    """Half the spacing of a float format with ``mantissa_bits`` around ``x``."""
    exp = torch.floor(torch.log2(x.abs().clamp(min=2.0**min_normal_exp)))
    return 0.5 * torch.pow(2.0, exp - mantissa_bits)


def half_ulp16(x):
    return float_rounding_bound(x, 10, -14)


def rounding_bound(precision, exact):
    """Largest error of round-to-nearest storage of the FP64 rows ``exact`` (R, D)."""
    if precision is Precision.FP16:
        return half_ulp16(exact)
    if precision is Precision.BF16:
        return float_rounding_bound(exact, 7, -126)
    levels = (1 << precision.bits) - 1
    lo, hi = exact.amin(1, keepdim=True), exact.amax(1, keepdim=True)
    step = (hi - lo) / levels  # the quantum of the format
    # half a step, the FP16 rounding of the stored bias (min) and of the stored scale
    bound = step / 2 + half_ulp16(lo) + (hi - lo) * 2.0**-11
    return bound.expand_as(exact)


def stored_tails(packed, precision, dim):
    """FP16 scale and bias of each packed integer row: ``[codes | scale | bias | pad]``."""
    payload = (dim * precision.bits + 7) // 8
    tail = packed[:, payload : payload + 4].contiguous().view(torch.float16).double()
    return tail[:, 0], tail[:, 1]


# -- the test ---------------------------------------------------------------------------


def run_and_compare(name, precision, *, weighted, mean_u, seed=0):
    prec = Precision.parse(precision)
    spec = SparseOptimizerSpec(**SPECS[name])
    mean = {"t": False, "u": mean_u}
    tables = _tables(precision, mean_u)
    ebc = FusedEmbeddingBagCollection(tables, spec, seed=seed, stochastic_rounding=False)
    w = {k: v.double() for k, v in ebc.table_weights().items()}
    state = {t.name: initial_state(name, spec, t.num_embeddings, t.dim) for t in tables}
    exact_low_precision = prec is not Precision.FP32
    for step, (bags, weights, grad) in enumerate(make_batches(weighted, seed)):
        stored_before = _stored(ebc)
        if exact_low_precision:  # start from the rows as stored: only rounding differs
            w = {k: v.double() for k, v in ebc.table_weights().items()}
        sf = SparseFeatures.from_lists(bags, weights=weights)
        out = ebc(sf).values
        ref_out = reference_forward(w, bags, weights, mean)
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
        out.backward(grad)
        grads = row_gradients(bags, weights, grad, mean)
        for table, rows in grads.items():
            for r, g in rows.items():
                st = {n: v[r] for n, v in state[table].items()}
                w[table][r] = apply_published_rule(name, spec, w[table][r], g, st)
                for n, v in st.items():
                    state[table][n][r] = v
        got_w = ebc.table_weights()
        got_state = _opt_state(ebc)
        after = _stored(ebc)
        for t in tables:
            touched = sorted(grads[t.name])
            untouched = sorted(set(range(t.num_embeddings)) - set(touched))
            where = f"{name} {precision} step {step} table {t.name}"
            # untouched rows: stored bytes and every state bitwise unchanged
            for key in [f"weights.{t.name}"] + [f"state.{t.name}.{n}" for n in STATE_NAMES[name]]:
                assert torch.equal(after[key][untouched], stored_before[key][untouched]), where
            # touched rows
            exact, got = w[t.name][touched], got_w[t.name][touched].double()
            if exact_low_precision:
                bound = rounding_bound(prec, exact) + 1e-6 * (exact.abs() + 1e-3)
                err = (got - exact).abs()
                assert (err <= bound).all(), f"{where}: error {err.max()} > bound"
            else:
                torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6, msg=where)
            if prec.is_integer:
                levels = (1 << prec.bits) - 1
                # the grid bias + q * scale covers the row (bias: the min rounded down,
                # scale: rounded up), one FP16 step wide at most on each side
                lo, hi = exact.amin(1), exact.amax(1)
                scale, bias = stored_tails(after[f"weights.{t.name}"][touched], prec, t.dim)
                fp32 = 1e-6 * (exact.abs().amax(1) + 1e-3)  # the kernel computes in FP32
                assert (bias <= lo + fp32).all(), where
                assert (bias + levels * scale >= hi - fp32).all(), where
                assert (bias >= lo - 2 * half_ulp16(lo)).all(), where
                quantum = (hi - bias) / levels
                torch.testing.assert_close(scale, quantum, rtol=2e-3, atol=1e-7, msg=where)
            for n in STATE_NAMES[name]:
                torch.testing.assert_close(
                    got_state[t.name][n], state[t.name][n], rtol=1e-5, atol=1e-7, msg=where
                )
    return ebc


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_and_precision_matches_the_published_rule(kernel_path, name, precision):
    """Sum and mean pooling, four steps, untouched rows, weight decay.

    Fails on a wrong rule, a wrong pooling divisor, a state updated for untouched rows,
    a shared (non per-row) Adam step count, a codec with fewer levels or a wrong bias.
    """
    run_and_compare(name, precision, weighted=False, mean_u=True)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weighted_bags_update_rows_with_their_per_id_weights(kernel_path, name, precision):
    """The rows after backward, not only the forward output and the weights' gradient.

    Fails when the row update ignores the per-id weights of weighted bags.
    """
    run_and_compare(name, precision, weighted=True, mean_u=False)


@pytest.mark.parametrize("initial_accumulator", [0.0, 0.5])
def test_adagrad_eps_is_added_after_the_square_root(kernel_path, initial_accumulator):
    """A large eps on a zero accumulator: eps inside sqrt would give another step.

    w -= lr * g / (sqrt(g^2) + eps) = lr * g / (|g| + eps), not lr * g / sqrt(g^2 + eps).
    """
    for kind in ("adagrad", "rowwise_adagrad"):
        spec = SparseOptimizerSpec(
            kind=kind, lr=1.0, eps=0.5, initial_accumulator=initial_accumulator
        )
        table = TableConfig(name="t", num_embeddings=3, dim=2)
        ebc = FusedEmbeddingBagCollection([table], spec, seed=0)
        w0 = ebc.table_weights()["t"].double()
        g = torch.tensor([[0.3, -0.4]])
        ebc(SparseFeatures.from_lists({"t": [[1]]})).values.backward(g)
        g = g.double()[0]
        acc = initial_accumulator + (g * g if kind == "adagrad" else (g * g).mean())
        expect = w0[1] - g / (acc.sqrt() + 0.5)
        got = ebc.table_weights()["t"][1].double()
        torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-7)
        assert torch.equal(ebc.table_weights()["t"][[0, 2]].double(), w0[[0, 2]])


# -- compiled == portable, for every optimizer, weighted and not, sum and mean ----------

POOLING_CASES = {
    "sum": dict(weighted=False, mean_u=False),
    "mean": dict(weighted=False, mean_u=True),
    "weighted-sum": dict(weighted=True, mean_u=False),
}


def _short_bag_batches(weighted, seed):
    """Bags of 0 to 2 ids (fewer than two ids per bag on average: the compiled kernel
    reads grad_out directly instead of gathering it) plus one step of long bags."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(3):
        hi = 3 if s < 2 else 6
        bags = {
            f: [torch.randint(0, rows, (int(n),), generator=gen).tolist()
                for n in torch.randint(0, hi, (BATCH,), generator=gen)]
            for f, rows in (("f0", 12), ("f1", 12), ("f2", 9))
        }  # fmt: skip
        weights = None
        if weighted:
            weights = {f: [torch.rand(len(b), generator=gen).tolist() for b in fb]
                       for f, fb in bags.items()}  # fmt: skip
        steps.append((bags, weights, torch.randn(BATCH, 23, generator=gen)))
    return steps


def _run_path(monkeypatch, path, name, precision, case):
    monkeypatch.setenv("TETRAREC_KERNELS", "auto" if path == "compiled" else "reference")
    spec = SparseOptimizerSpec(**SPECS[name])
    ebc = FusedEmbeddingBagCollection(
        _tables(precision, case["mean_u"]), spec, seed=1, stochastic_rounding=False
    )
    outs = []
    for bags, weights, grad in _short_bag_batches(case["weighted"], seed=2):
        sf = SparseFeatures.from_lists(bags, weights=weights)
        if sf.weights is not None:
            sf.weights.requires_grad_(True)
        out = ebc(sf).values
        out.backward(grad)
        outs.append(out.detach())
        if sf.weights is not None:
            outs.append(sf.weights.grad)
    return outs, ebc.table_weights(), _opt_state(ebc)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", list(POOLING_CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_compiled_matches_portable_path(monkeypatch, name, case, precision):
    if compiled_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernel did not build on this machine")
    runs = {p: _run_path(monkeypatch, p, name, precision, POOLING_CASES[case])
            for p in ("compiled", "reference")}  # fmt: skip
    (c_out, c_w, c_st), (r_out, r_w, r_st) = runs["compiled"], runs["reference"]
    # FP16: a row whose FP32 results differ in the last bit may round one step apart,
    # which later outputs carry (a step of a value below 2 is at most 2^-10).
    atol = 1e-6 if precision == "fp32" else 2e-3
    for x, y in zip(c_out, r_out):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=atol)
    for table, w in r_w.items():
        if precision == "fp32":
            torch.testing.assert_close(c_w[table], w, rtol=1e-5, atol=1e-6)
        else:  # nearest rounding may flip by one step where FP32 results differ in the last
            # bit, at each of the 3 steps
            err = (c_w[table] - w).abs()
            assert (err <= 3 * 2 * half_ulp16(w.double()).float() + 1e-7).all(), err.max()
        for n, st in r_st.get(table, {}).items():
            torch.testing.assert_close(c_st[table][n], st, rtol=1e-5, atol=1e-6)


def test_reference_formats_bounds_are_tight():
    """The bound helpers themselves: FP16 half-spacing at 1 is 2^-11, INT8 step of a
    [0, 2.55] row is 0.01 (so half a step 0.005 plus the FP16 terms)."""
    assert half_ulp16(torch.tensor([1.0], dtype=torch.float64)).item() == 2.0**-11
    row = torch.tensor([[0.0, 1.0, 2.55]], dtype=torch.float64)
    bound = rounding_bound(Precision.INT8, row)[0, 0].item()
    assert 0.005 < bound < 0.005 + 2.55 * 2.0**-11 + 2.0**-25 + 1e-12
    assert math.isclose(((row.amax() - row.amin()) / 255).item(), 0.01)


def test_duplicates_of_rows_beyond_one_radix_digit_are_merged(kernel_path):
    """Rows 5 and 5 + 2^13 in a table of 10_000 rows: the compiled kernel sorts row keys
    by radix digits of 13 bits, so these two agree on the first digit.

    Bug it catches: a sort that misses the top bit leaves a row's ids non-contiguous; the
    row is then updated twice with partial sums (Adagrad: acc = g1^2 + g2^2 instead of
    (g1 + g2)^2).
    """
    spec = SparseOptimizerSpec(kind="adagrad", lr=0.5, eps=1e-2)
    table = TableConfig(name="t", num_embeddings=10_000, dim=4)
    ebc = FusedEmbeddingBagCollection([table], spec, seed=0)
    w0 = ebc.table_weights()["t"].double()
    bags = [[5, 5 + 8192], [5 + 8192, 5], [5]]
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    ebc(SparseFeatures.from_lists({"t": bags})).values.backward(grad)
    g = {5: grad.sum(0).double(), 5 + 8192: grad[:2].sum(0).double()}
    got = ebc.table_weights()["t"].double()
    for row, gr in g.items():
        expect = w0[row] - 0.5 * gr / ((gr * gr).sqrt() + 1e-2)
        torch.testing.assert_close(got[row], expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_opt_state(ebc)["t"]["sum"][5], g[5] * g[5], rtol=1e-5, atol=0)
