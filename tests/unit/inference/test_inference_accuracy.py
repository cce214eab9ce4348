"""The accuracy tool chain: deltas against FP32, per-table sensitivity, the budget search,
the report in the manifest, the re-check on new data, and ``tetrarec quantize``.

One tiny model is trained and exported once per module (a few seconds). The search's
back-off is tested on a reference whose NE changes are given per table, so which table
it raises is known in advance.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tetrarec.cli import main
from tetrarec.config import RunConfig
from tetrarec.inference import InferenceModel, load, save
from tetrarec.inference.accuracy import (
    Deltas,
    Reference,
    recheck,
    reference,
    search,
    table_sensitivity,
)
from tetrarec.inference.accuracy_report import (
    attach_report,
    format_report,
    plot_report,
    report_dict,
)
from tetrarec.inference.dense import DENSE_FORMATS
from tetrarec.inference.export import export_checkpoint
from tetrarec.inference.quantize import (
    QuantSpec,
    precision_ladders,
    quantize_model,
    quantize_tables,
)
from tetrarec.inference.scoring import batches, model_dataset
from tetrarec.testing.models import trained_model_dir
from tetrarec.train import train
from tetrarec.train.metrics import compute_metrics
from tetrarec.types import Precision

TINY = [
    "data.source=synthetic",
    "data.batch_size=64",
    "data.eval_batch_size=256",
    "data.synthetic.num_samples=2048",
    "data.synthetic.eval_samples=600",
    "model.num_sparse=3",
    "model.num_embeddings=300",
    "model.embedding=fused",
    "model.dlrm.bottom_mlp=[8, 16]",
    "model.dlrm.top_mlp=[8, 1]",
    "model.dlrm.num_dense=13",
    "train.epochs=none",
    "train.steps=20",
    "train.eval_every=0",
    "train.keep_best=none",
    "train.early_stop_patience=0",
    "train.checkpoint_every=20",
    "train.progress=false",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("accuracy")
    return trained_model_dir(RunConfig.from_dict({}).with_overrides(TINY), root)


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Reference:
    model = load(model_dir)
    return reference(model, model_dataset(model), eval_rows=500, batch_size=128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _GivenNE(Reference):
    """A reference whose NE change is the sum of given per-(table, precision) costs."""

    costs: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)

    def measure(self, model: InferenceModel) -> Deltas:
        now = model.table_precisions()
        ne = sum(self.costs.get((t, p.value), 0.0) for t, p in now.items())
        return Deltas(
            ne_pct=ne, auc=0.0, calibration=0.0, metrics=self.metrics, model_bytes=model.nbytes()
        )


def _given(ref: Reference, costs: dict[tuple[str, str], float]) -> _GivenNE:
    fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(Reference)}
    return _GivenNE(**fields, costs=costs)


def test_the_reference_against_itself_has_no_delta(ref: Reference) -> None:
    """Bug caught: the deltas measured on other rows than the reference's logits (or
    with the sign turned) would show a change for the FP32 model itself."""
    d = ref.measure(ref.model)
    assert (d.ne_pct, d.auc, d.calibration) == (0.0, 0.0, 0.0)
    assert d.model_bytes == ref.model.nbytes()
    assert compute_metrics(ref.logits, ref.labels) == ref.metrics


def test_eval_rows_caps_the_rows_read(ref: Reference) -> None:
    """Bug caught: ``eval_rows`` ignored, so every evaluation of the search reads and
    scores the whole evaluation set."""
    assert ref.num_rows == 500
    assert sum(b.labels.numel() for b in ref.rows) == 500


def test_an_int8_table_changes_the_ne_by_a_known_amount(ref: Reference) -> None:
    """Bug caught: NE change computed from something other than the quantized model's
    logits (its own computation from the logits gives the same figure)."""
    table = next(iter(ref.model.table_precisions()))
    candidate = quantize_tables(ref.model, {table: Precision.INT8})
    got = ref.measure(candidate)
    m = compute_metrics(ref.logits_of(candidate), ref.labels)
    assert got.ne_pct == pytest.approx(100 * (m.ne - ref.metrics.ne) / ref.metrics.ne)
    assert got.auc == pytest.approx(m.auc - ref.metrics.auc)


def test_sensitivity_quantizes_one_table_and_counts_its_bytes(ref: Reference) -> None:
    """Bug caught: every table quantized at once for one table's row, or the bytes saved
    not the table's own (INT4 must save more than INT8, INT8 more than FP16, and the
    saving equals the table's FP32 bytes minus its new bytes)."""
    names = list(ref.model.table_precisions())
    sens = table_sensitivity(ref, tables=names[:1])
    assert [(s.table, s.precision) for s in sens] == [
        (names[0], "fp16"), (names[0], "int8"), (names[0], "int4")
    ]  # fmt: skip
    saved = [s.bytes_saved for s in sens]
    assert 0 < saved[0] < saved[1] < saved[2]
    fp32_bytes = sens[0].table_bytes + sens[0].bytes_saved
    assert all(s.table_bytes + s.bytes_saved == fp32_bytes for s in sens)


def test_search_backs_off_the_worst_ne_per_byte_until_it_fits(ref: Reference) -> None:
    """Two tables (of equal bytes) each within the budget alone at INT4 but not together:
    the search must raise the one whose INT4 costs more NE to INT8 and verify again.
    Bug caught: stopping at the first (over-budget) model, raising the cheaper table, or
    a choice that does not say it was the budget."""
    cheap, dear = list(ref.model.table_precisions())[:2]
    costs = {(cheap, "int4"): 0.02, (dear, "int4"): 0.025, (cheap, "int8"): 0.004,
             (dear, "int8"): 0.004}  # fmt: skip
    result = search(_given(ref, costs), 0.03)
    choices = {c.table: c for c in result.choices}
    assert result.fits
    assert result.deltas.ne_pct <= 0.03
    assert choices[dear].precision == "int8"
    assert choices[dear].why.startswith("budget")
    assert choices[cheap].precision == "int4"
    assert len(result.steps) == 2
    assert result.steps[0]["ne_pct"] > 0.03
    assert result.model.table_precisions()[dear] is Precision.INT8


def test_search_keeps_fp32_for_a_table_over_the_budget_alone(ref: Reference) -> None:
    """Bug caught: a table whose every lower precision alone exceeds the budget chosen
    anyway (or its reason not naming the FP16 change that ruled it out)."""
    table = next(iter(ref.model.table_precisions()))
    costs = {(table, p): 1.0 for p in ("fp16", "int8", "int4")}
    result = search(_given(ref, costs), 0.05)
    choice = next(c for c in result.choices if c.table == table)
    assert choice.precision == "fp32"
    assert "fp16 alone: NE +1%" in choice.why


def test_search_given_tables_are_not_searched(ref: Reference) -> None:
    """Bug caught: a table given with ``--table NAME=PREC`` searched (and changed)."""
    table = next(iter(ref.model.table_precisions()))
    result = search(ref, 0.05, fixed={table: Precision.FP16})
    assert result.model.table_precisions()[table] is Precision.FP16
    assert {c.table: c.why for c in result.choices}[table] == "given"
    assert all(s.table != table for s in result.sensitivity)


def test_report_is_kept_in_the_saved_manifest(ref: Reference, tmp_path: Path) -> None:
    """Bug caught: the report not written into ``quantization["report"]`` (or not
    JSON-safe), so a deployed model cannot say why it holds its precisions."""
    result = search(ref, 0.5)
    report = report_dict(result, eval_rows=ref.num_rows)
    save(attach_report(result.model, report), tmp_path / "q")
    back = load(tmp_path / "q").manifest.quantization["report"]
    assert back == json.loads(json.dumps(report))
    text = format_report(report)
    assert all(t in text for t in ref.model.table_precisions())
    plot_report(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_recheck_names_the_table_that_breaks_the_budget(ref: Reference) -> None:
    """On new rows where one deployed table costs more than the budget, the re-check
    must say it does not hold and name that table. Bug caught: judging the stored
    report's figures instead of re-measuring, or naming the wrong table."""
    names = list(ref.model.table_precisions())
    deployed = quantize_tables(ref.model, {names[0]: Precision.INT8, names[1]: Precision.INT4})
    costs = {(names[0], "int8"): 0.01, (names[1], "int4"): 0.09}
    check = recheck(deployed, _given(ref, costs), 0.05)
    assert not check.holds
    assert check.breaking == names[1]
    assert recheck(deployed, _given(ref, costs), 0.2).holds


def test_recheck_refuses_a_reference_with_other_tables(ref: Reference, tmp_path: Path) -> None:
    """Bug caught: re-checking against a model of other tables (not the source)."""
    other = RunConfig.from_dict({}).with_overrides(
        [*TINY, "model.num_sparse=2", f"train.checkpoint_dir={str(tmp_path / 'c')!r}"]
    )
    result = train(other)
    assert result.checkpoint is not None
    export_checkpoint(result.checkpoint, tmp_path / "m")
    with pytest.raises(ValueError, match="give the FP32 model it was quantized from"):
        recheck(load(tmp_path / "m"), ref, 0.05)


def test_cli_quantize_search_writes_model_json_and_plot(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bug caught: ``tetrarec quantize --budget-ne`` not writing the quantized model
    (with its report), the JSON or the plot, or printing figures other than the JSON's."""
    out = tmp_path / "q"
    code = main(["quantize", "--model", str(model_dir), "--output", str(out), "--eval-split",
                 "--budget-ne", "0.05", "--eval-rows", "300", "--json", str(tmp_path / "r.json"),
                 "--plot", str(tmp_path / "r.png"), "--no-progress"])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert load(out).manifest.quantization["report"] == report
    assert report["eval_rows"] == 300
    assert report["budget_ne_pct"] == 0.05
    assert f"NE change    {report['deltas']['ne_pct']:+.4f}%" in capsys.readouterr().out
    assert (tmp_path / "r.png").is_file()
    precisions = {k: v.value for k, v in load(out).table_precisions().items()}
    assert precisions == {t["table"]: t["precision"] for t in report["tables"]}


def test_cli_check_exits_1_when_the_choices_no_longer_hold(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bug caught: ``--check`` exiting 0 whatever it found (a script could not act on
    it). A budget below the measured change cannot hold."""
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dir), "--output", str(out),
                 "--tables", "int4"]) == 0  # fmt: skip
    args = ["quantize", "--check", "--model", str(out), "--reference", str(model_dir),
            "--eval-split", "--no-progress", "--json", str(tmp_path / "c.json")]  # fmt: skip
    measured = load(out)
    ref_model = load(model_dir)
    r = reference(ref_model, model_dataset(ref_model))
    ne = r.measure(measured).ne_pct
    assert main([*args, "--budget-ne", str(abs(ne) + 1.0)]) == 0
    assert "HOLDS" in capsys.readouterr().out
    assert main([*args, "--budget-ne", "0" if ne > 0 else "-1"]) == 1
    assert "DOES NOT HOLD" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["holds"] is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget-ne", "0.05"], "--budget-ne and --plot need evaluation rows"),
        (["--tables", "int8", "--budget-ne", "1", "--eval-split"], "--tables and --budget-ne"),
        (["--activations", "static"], "--activations applies to --mlp int8"),
        (["--table", "nosuch=int8"], "no such table(s) in the model: ['nosuch']"),
        (["--tables", "fp8"], "fp8 is not a table precision"),
    ],
)
def test_cli_quantize_usage_errors_are_one_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra, message
) -> None:
    """Bug caught: a contradictory or impossible request running (or tracing back)
    instead of one ``tetrarec quantize: error:`` line with exit status 2."""
    code = main(["quantize", "--model", str(model_dir), "--output", str(tmp_path / "q"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("tetrarec quantize: error: ")
    assert message in err[-1]
    assert not (tmp_path / "q").exists()


def test_the_search_never_picks_a_precision_that_stores_a_table_larger() -> None:
    """Bug caught (found in review): a first-order term's dim-1 table was "quantized" to
    INT4, 8 bytes a row (a code byte, FP16 scale and bias, aligned to 4) against FP32's 4,
    because the search took the lowest precision, not the smallest table. Its ladder is
    FP32 then FP16 only; a dim-4 table's stops at FP16 too (INT8 and INT4 rows are 8
    bytes, FP16's 8); a dim-16 table keeps every precision."""

    def entry(name: str, dim: int) -> dict[str, object]:
        return {"name": name, "dim": dim}

    manifest = dataclasses.make_dataclass("M", [("tables", list)])(
        [entry("C1_first_order", 1), entry("narrow", 4), entry("wide", 16)]
    )
    fake = dataclasses.make_dataclass("Model", [("manifest", object)])(manifest)
    ladders = precision_ladders(fake)  # type: ignore[arg-type]
    assert ladders["C1_first_order"] == (Precision.FP32, Precision.FP16)
    assert ladders["narrow"] == (Precision.FP32, Precision.FP16)
    assert ladders["wide"] == (Precision.FP32, Precision.FP16, Precision.INT8, Precision.INT4)


def test_cli_int8_mlp_is_calibrated_static_by_default_and_scores_do_not_depend_on_the_batch(
    model_dir: Path, tmp_path: Path
) -> None:
    """Bug caught (found in the server's load test): dynamic INT8 activations quantize per
    batch, so a row's score moved with the rows it was batched with (0.02 in a logit).
    ``--mlp int8`` calibrates static ranges on training rows by default; a row then scores
    the same alone as in a batch, and with --prune-min-count the unseen rows are pruned."""
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dir), "--output", str(out), "--mlp", "int8",
                 "--tables", "int8", "--calibration-batches", "2", "--prune-min-count", "1",
                 "--batch-size", "256"]) == 0  # fmt: skip
    model = load(out)
    assert model.manifest.dense["activations"] == "static"
    assert model.manifest.quantization["prune"]["min_count"] == 1
    batch = next(iter(batches(model_dataset(model), batch_size=64)))
    together = model.logits(batch.dense, batch.sparse)
    few = next(iter(batches(model_dataset(model), batch_size=4)))
    assert torch.equal(model.logits(few.dense, few.sparse), together[:4])


def test_the_report_separates_the_dense_formats_own_change(ref: Reference) -> None:
    """Bug caught (found reading a report): with an INT8 MLP most of a model's NE change
    was the MLP's, yet the report only listed tables, whose own changes were nil, and the
    search raised them in vain. The dense format's change alone is measured, reported,
    and a budget it alone is over stops the back-off at once (no table can fix it)."""
    if "int8" not in DENSE_FORMATS:
        pytest.skip("no INT8 dense format")
    result = search(ref, 0.0, mlp="int8", mlp_settings={"activations": "dynamic"})
    alone = result.mlp_alone
    assert alone is not None
    fp32_tables = quantize_model(
        ref.model, QuantSpec(mlp="int8", mlp_settings={"activations": "dynamic"})
    )
    assert alone.ne_pct == ref.measure(fp32_tables).ne_pct
    report = report_dict(result, eval_rows=ref.num_rows)
    assert report["mlp_alone"]["ne_pct"] == alone.ne_pct
    assert "of which the dense layers (int8) alone" in format_report(report)
    if alone.ne_pct > 0.0:  # over a zero budget by itself: no table is raised
        assert len(result.steps) == 1
        assert not result.fits
    assert search(ref, 1.0).mlp_alone is None  # FP32 dense layers: nothing to separate
