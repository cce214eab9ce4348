import itertools
import json
import math

import numpy as np
import pytest
import torch

from tetrarec.config import BestMetric
from tetrarec.train.metrics import (
    BestEval,
    MetricAccumulator,
    Metrics,
    compute_metrics,
    miscalibration,
)


def brute_force_auc(scores: list[float], labels: list[int]) -> float:
    """Count every (positive, negative) pair: 1 if ordered right, 1/2 if tied."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    total = 0.0
    for p, n in itertools.product(pos, neg):
        total += 1.0 if p > n else 0.5 if p == n else 0.0
    return total / (len(pos) * len(neg))


def direct_formulas(z: np.ndarray, y: np.ndarray) -> dict[str, float]:
    p = 1.0 / (1.0 + np.exp(-z))
    log_loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    c = y.mean()
    entropy = -(c * math.log(c) + (1 - c) * math.log(1 - c))
    return {
        "log_loss": log_loss,
        "ne": log_loss / entropy,
        "calibration": p.mean() / c,
        "accuracy": np.mean((p >= 0.5) == (y == 1)),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("levels", [3, 1000])  # 3 distinct scores: many ties
def test_auc_matches_brute_force_pair_count(seed: int, levels: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=200)
    z = np.round(rng.normal(size=200) + y * 0.7, 0 if levels == 3 else 6)
    got = compute_metrics(torch.tensor(z), torch.tensor(y, dtype=torch.float32)).auc
    assert got == pytest.approx(brute_force_auc(z.tolist(), y.tolist()), abs=1e-12)


def test_auc_all_tied_is_half_and_one_class_is_nan() -> None:
    y = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert compute_metrics(torch.zeros(4), y).auc == 0.5
    assert math.isnan(compute_metrics(torch.randn(4), torch.ones(4)).auc)


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_ne_calibration_accuracy_match_direct_formulas(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=300).astype(np.float64)
    z = rng.normal(scale=2.0, size=300)
    m = compute_metrics(torch.tensor(z), torch.tensor(y))
    want = direct_formulas(z, y)
    assert m.log_loss == pytest.approx(want["log_loss"], rel=1e-12)
    assert m.ne == pytest.approx(want["ne"], rel=1e-12)
    assert m.calibration == pytest.approx(want["calibration"], rel=1e-12)
    assert m.accuracy == pytest.approx(want["accuracy"], abs=0)
    assert m.num_samples == 300
    assert m.ctr == pytest.approx(y.mean())


def test_constant_prediction_at_base_rate_has_ne_one() -> None:
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    z = torch.full((4,), math.log(0.25 / 0.75), dtype=torch.float64)
    m = compute_metrics(z, y)
    assert m.ne == pytest.approx(1.0, rel=1e-12)
    assert m.calibration == pytest.approx(1.0, rel=1e-12)


def test_saturated_logits_stay_finite() -> None:
    m = compute_metrics(torch.tensor([800.0, -800.0]), torch.tensor([0.0, 1.0]))
    assert m.log_loss == pytest.approx(800.0)


def test_accumulator_equals_one_shot() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(100, generator=g)
    y = (torch.rand(100, generator=g) < 0.3).float()
    acc = MetricAccumulator()
    for lo in range(0, 100, 33):
        acc.update(z[lo : lo + 33], y[lo : lo + 33])
    assert acc.compute() == compute_metrics(z, y)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="3 logits but 2 labels"):
        compute_metrics(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        compute_metrics(torch.zeros(2), torch.tensor([0.0, 0.5]))
    with pytest.raises(ValueError, match=r"^no batches were evaluated$"):
        MetricAccumulator().compute()


def _metrics(**kw: float) -> Metrics:
    base = {"auc": 0.7, "ne": 0.9, "log_loss": 0.5, "calibration": 1.0, "accuracy": 0.7}
    return Metrics(**{**base, **kw}, num_samples=100, ctr=0.2)


# (metric, scripted values at steps 10, 20, ..., expected (best step, since) after each)
SCRIPTS = [
    (
        "auc",  # higher is better; a tie keeps the earlier; nan never improves
        [0.60, 0.70, 0.65, 0.70, 0.72, math.nan, 0.71],
        [(10, 0), (20, 0), (20, 1), (20, 2), (50, 0), (50, 1), (50, 2)],
    ),
    (
        "log_loss",  # lower is better
        [0.50, 0.45, 0.47, 0.45, 0.40, 0.41, 0.39],
        [(10, 0), (20, 0), (20, 1), (20, 2), (50, 0), (50, 1), (70, 0)],
    ),
    (
        "auc",  # nothing is best until a value is not nan
        [math.nan, math.nan, 0.5],
        [(None, 1), (None, 2), (30, 0)],
    ),
]


@pytest.mark.parametrize(("metric", "values", "expected"), SCRIPTS)
def test_best_eval_keeps_the_right_step(metric: str, values: list, expected: list) -> None:
    """Bugs caught: the wrong direction for a metric (log loss kept when it rises), a
    tie taken as a new best (the later checkpoint kept), a nan taken as best (every
    comparison with nan is False, so a nan best could never be beaten), and a count of
    non-improving evaluations that is not reset by an improvement (early stopping
    would stop too soon)."""
    best = BestEval(metric=BestMetric(metric))
    for i, (value, (step, since)) in enumerate(zip(values, expected)):
        best = best.update(10 * (i + 1), _metrics(**{metric: value}))
        assert (best.step, best.since) == (step, since), f"after eval {i + 1}"
        if step is not None:
            assert best.value(best.metrics) == values[step // 10 - 1]


def test_best_eval_round_trips_and_counts_a_step_once() -> None:
    """Bugs caught: meta that loses the count or the metrics (a resumed run would
    report another best or stop at another step), and a resumed run that evaluates its
    start step again counting that evaluation twice."""
    best = BestEval(metric=BestMetric.LOG_LOSS).update(4, _metrics(log_loss=0.4))
    best = best.update(6, _metrics(log_loss=0.5))
    again = BestEval.from_dict(json.loads(json.dumps(best.to_dict())))
    assert again == best
    assert (again.step, again.since, again.last_step) == (4, 1, 6)
    assert again.update(6, _metrics(log_loss=0.6)) is again
    assert again.update(7, _metrics(log_loss=0.6)).since == 2
    with pytest.raises(ValueError, match="not a BestEval"):
        BestEval.from_dict({"metric": "auc"})


@pytest.mark.parametrize(
    ("calibration", "direction"),
    [
        (1.0, None),
        (0.8, None),  # the bounds are inside
        (1.25, None),
        (math.nan, None),  # no positives: not judged
        (1.26, "over-predicts"),
        (0.79, "under-predicts"),
        (3.0, "over-predicts"),
    ],
)
def test_miscalibration_says_which_direction(calibration: float, direction: str | None) -> None:
    """Bugs caught: a warning for a calibrated model, none for a miscalibrated one, and
    the direction reversed (calibration > 1 means predictions above the observed CTR)."""
    note = miscalibration(_metrics(calibration=calibration))
    if direction is None:
        assert note is None
    else:
        assert note is not None
        assert direction in note
        assert f"{calibration:.3f}" in note


# -- found by mutation testing (make mutants, mutation/README.md) --------------------------


def test_auc_of_one_positive_or_one_negative_is_defined_and_warns_nothing() -> None:
    """Bugs caught: a one-of-a-class set taken as one-class (nan where the AUC is
    defined), and a one-class check that lets the division by zero through (the same
    nan, with a numpy warning in every evaluation of a one-class set)."""
    import warnings

    z = torch.tensor([0.1, 0.9, 0.4, 0.3])
    assert compute_metrics(z, torch.tensor([0.0, 1.0, 0.0, 0.0])).auc == 1.0
    one_negative = torch.tensor([1.0, 1.0, 0.0, 1.0])  # only 0.9 is above its 0.4
    assert compute_metrics(z, one_negative).auc == pytest.approx(1 / 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for one_class in (torch.zeros(4), torch.ones(4)):
            m = compute_metrics(z, one_class)
            assert math.isnan(m.auc)
            assert math.isnan(m.ne)  # the labels' entropy is 0: NE is undefined
        assert math.isnan(compute_metrics(z, torch.zeros(4)).calibration)  # no positives


def test_accumulator_computes_in_float64_whatever_the_batches_dtype() -> None:
    """Bug caught: FP32 logits kept in FP32 (log loss and calibration summed in single
    precision over a whole evaluation set drift from the exact figures)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5000, generator=g) * 4
    y = (torch.rand(5000, generator=g) < 0.3).float()
    acc = MetricAccumulator()
    for lo in range(0, 5000, 700):
        acc.update(z[lo : lo + 700], y[lo : lo + 700])  # FP32 batches
    assert acc.compute() == compute_metrics(z.double(), y.double())


def test_error_and_warning_messages_say_what_and_how_much() -> None:
    """Bugs caught: messages that lose their content (a bad Metrics dict not named, the
    direction or the mean prediction of a miscalibration wrong in the log line)."""
    with pytest.raises(ValueError, match=r"not a Metrics dict .*'bogus'"):
        Metrics.from_dict({"bogus": 1.0})
    over = miscalibration(_metrics(calibration=1.5))  # ctr 0.2: mean prediction 0.3
    assert over == (
        "calibration 1.500 is outside [0.8, 1.25]: the model over-predicts the CTR "
        "(mean prediction 0.3000, observed 0.2000)"
    )
    under = miscalibration(_metrics(calibration=0.5))
    assert under is not None
    assert under.endswith(
        "the model under-predicts the CTR (mean prediction 0.1000, observed 0.2000)"
    )


def test_best_eval_before_any_evaluation_round_trips_and_an_improved_step_counts_once() -> None:
    """Bugs caught: a run checkpointed before its first evaluation that cannot write or
    read its meta (no step, no metrics), and an improvement that does not record its
    step as seen (a resumed run re-evaluating that step would count it again)."""
    empty = BestEval(metric=BestMetric.AUC)
    assert BestEval.from_dict(json.loads(json.dumps(empty.to_dict()))) == empty
    best = empty.update(5, _metrics(auc=0.7))
    assert best.last_step == 5
    assert best.update(5, _metrics(auc=0.9)) is best


def test_shapes_edge_values_and_bad_labels() -> None:
    """Bugs caught: (B, 1) logits or labels not flattened, a single sample refused as if
    empty, a logit of exactly 0 (p = 0.5) not counted as predicting a click, and the
    error for bad labels listing other values than the first five that are not 0 or 1;
    ``tensors()`` returning another dtype than FP64."""
    z = torch.tensor([0.0, -1.0, 2.0, 0.5])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    flat = compute_metrics(z, y)
    assert compute_metrics(z.view(4, 1), y) == flat
    assert compute_metrics(z, y.view(4, 1)) == flat
    assert flat.accuracy == 0.75  # z = 0 predicts a click (p >= 0.5); 0.5 is wrong
    assert compute_metrics(torch.tensor([1.0]), torch.tensor([1.0])).num_samples == 1
    with pytest.raises(ValueError, match=r"^cannot compute metrics over 0 samples$"):
        compute_metrics(torch.zeros(0), torch.zeros(0))
    bad = torch.tensor([0.0, 0.5, 2.0, 1.0, -1.0, 3.0, 4.0, 5.0])
    with pytest.raises(ValueError, match=r"got \[0\.5, 2\.0, -1\.0, 3\.0, 4\.0\]$"):
        compute_metrics(torch.zeros(8), bad)
    acc = MetricAccumulator()
    for empty in acc.tensors():  # nothing added yet: two empty FP64 tensors
        assert empty.dtype == torch.float64
        assert empty.shape == (0,)
    acc.update(z.float(), y.long())
    logits, labels = acc.tensors()
    assert logits.dtype == labels.dtype == torch.float64
    assert torch.equal(logits, z.double())
    assert torch.equal(labels, y.double())


def test_nan_logits_make_every_metric_nan_and_never_the_best(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bug caught: nan logits sorted last by the AUC's argsort, so nan rows that happened
    to be positives ranked above every negative: an overflowed model scored AUC 1.0 and
    keep_best = "auc" kept it as the run's best checkpoint."""
    z = torch.tensor([math.nan, 0.3, math.nan, -0.2])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    m = compute_metrics(z, y)
    for name in ("auc", "ne", "log_loss", "calibration", "accuracy"):
        assert math.isnan(getattr(m, name)), name
    assert (m.num_samples, m.ctr) == (4, 0.5)
    assert "2 of 4 logits are nan" in caplog.text
    best = BestEval(metric=BestMetric.AUC).update(
        10, compute_metrics(torch.tensor([0.1, 0.9, -0.5, 0.2]), y)
    )
    assert best.update(20, m).step == 10


def test_infinite_logits_give_exact_log_loss() -> None:
    """Bug caught: log(1 + exp(z)) - y z is inf - inf = nan for a logit of +inf on a
    positive (a certain and right prediction, whose loss is 0)."""
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    right = compute_metrics(torch.tensor([math.inf, -math.inf, math.inf, -math.inf]), y)
    assert (right.log_loss, right.auc, right.accuracy) == (0.0, 1.0, 1.0)
    wrong = compute_metrics(torch.tensor([-math.inf, 0.0, 0.0, 0.0]), y)
    assert wrong.log_loss == math.inf
    big = torch.tensor([800.0, -800.0, 40.0, 3.0], dtype=torch.float64)
    want = np.mean([0.0, 0.0, math.log1p(math.exp(-40.0)), math.log1p(math.exp(3.0))])
    assert compute_metrics(big, y).log_loss == pytest.approx(want, rel=1e-12)
