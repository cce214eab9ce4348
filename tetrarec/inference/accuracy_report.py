"""The accuracy report of a quantized model: JSON, a text table and a PNG plot.

``report_dict`` is what the quantized model's manifest keeps under
``quantization["report"]`` (``attach_report``) and what ``tetrarec quantize --json``
writes::

    {"budget_ne_pct": 0.05, "fits": true, "eval_rows": 4584,
     "reference": {metrics}, "metrics": {metrics},
     "deltas": {"ne_pct", "auc", "calibration"},
     "model_bytes": {"reference", "quantized", "ratio"}, "mlp": {"precision", ...},
     "mlp_alone": {"ne_pct", "auc", "calibration"} or null (FP32 dense layers),
     "tables": [{"table", "precision", "why", "bytes"}, ...],
     "sensitivity": [{"table", "precision", "ne_pct", "auc", "calibration",
                      "table_bytes", "bytes_saved"}, ...],
     "steps": [{"tables", "ne_pct", "auc", "model_bytes", "action"}, ...]}

``quantize_to_report`` and ``check_deployed`` are what ``tetrarec quantize`` runs.

``plot_report`` draws, per table, the NE change of the table alone against its bytes at
each precision tried (FP32 at 0), with the chosen precision marked.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tetrarec.inference.accuracy import (
    Check,
    SearchResult,
    evaluate_spec,
    recheck,
    reference,
    search,
    table_bytes,
)
from tetrarec.inference.model import InferenceModel, load
from tetrarec.inference.prune import count_ids, training_dataset
from tetrarec.inference.quantize import QuantSpec, quantize_model
from tetrarec.inference.scoring import model_dataset
from tetrarec.sparse import Batch
from tetrarec.types import Precision

__all__ = [
    "EvalSettings",
    "attach_report",
    "check_deployed",
    "format_check",
    "format_report",
    "plot_report",
    "quantize_to_report",
    "report_dict",
]


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """Which rows the accuracy tools evaluate on, and how.

    Args:
        files: data files of the model's source (empty: the training run's evaluation
            split).
        eval_rows: use only the first this many rows (``None``: all).
        batch_size: rows per scoring call.
        progress: progress bars on stderr.
    """

    files: Sequence[str] = field(default_factory=tuple)
    eval_rows: int | None = None
    batch_size: int = 8192
    progress: bool = False


def quantize_to_report(
    model: InferenceModel,
    *,
    tables: Mapping[str, Precision],
    mlp: str = "fp32",
    mlp_settings: Mapping[str, Any] | None = None,
    budget_ne_pct: float | None = None,
    evaluation: EvalSettings | None = None,
    prune_min_count: int = 0,
    calibration: Sequence[Batch] | None = None,
) -> tuple[InferenceModel, dict[str, Any] | None]:
    """Quantize ``model``: as given, or searched to a budget; measured when asked.

    Args:
        model: the FP32 model.
        tables: given table precisions (with a budget: the tables not searched).
        mlp: the dense format.
        mlp_settings: its settings.
        budget_ne_pct: search the other tables' precisions to this NE budget (needs
            ``evaluation``).
        evaluation: the evaluation rows; ``None``: quantize without measuring.
        prune_min_count: prune rows seen fewer times in the training rows
            (``QuantSpec.prune_min_count``; counted once).
        calibration: batches of training rows for static INT8 activations.

    Returns:
        The quantized model (with the report in its manifest when measured) and the
        report (``None`` when not measured).

    Raises:
        ValueError: for a budget without evaluation rows, or as ``quantize_model``.
    """
    settings = dict(mlp_settings or {})
    quantize = functools.partial(quantize_model, calibration=calibration)
    counts = None
    if prune_min_count > 0:
        progress = evaluation.progress if evaluation is not None else False
        counts = count_ids(model, training_dataset(model), progress=progress)
    spec = QuantSpec(
        tables=tables,
        mlp=mlp,
        mlp_settings=settings,
        prune_min_count=prune_min_count,
        prune_counts=counts,
    )
    if evaluation is None:
        if budget_ne_pct is not None:
            raise ValueError("a NE budget needs evaluation rows (--eval FILES or --eval-split)")
        return quantize(model, spec), None
    ref = reference(
        model,
        model_dataset(model, evaluation.files),
        eval_rows=evaluation.eval_rows,
        batch_size=evaluation.batch_size,
        progress=evaluation.progress,
    )
    if budget_ne_pct is None:
        result = evaluate_spec(ref, spec, progress=evaluation.progress, quantize=quantize)
    else:
        result = search(
            ref, budget_ne_pct, fixed=tables, mlp=mlp, mlp_settings=settings,
            prune_min_count=prune_min_count, prune_counts=counts,
            progress=evaluation.progress, quantize=quantize,
        )  # fmt: skip
    report = report_dict(result, eval_rows=ref.num_rows)
    return attach_report(result.model, report), report


def check_deployed(
    deployed: str | Path,
    reference_model: str | Path,
    *,
    budget_ne_pct: float | None,
    evaluation: EvalSettings,
) -> Check:
    """Re-measure a deployed quantized model against its FP32 model on new rows.

    Args:
        deployed: the quantized model directory.
        reference_model: the FP32 model directory it came from.
        budget_ne_pct: the budget (``None``: the one its stored report searched to).
        evaluation: the new evaluation rows.

    Raises:
        ValueError: when no budget is given and the model's report has none;
            ``ModelFileError`` for a bad model directory.
    """
    mine = load(deployed)
    if budget_ne_pct is None:
        stored = mine.manifest.quantization.get("report")
        budget_ne_pct = stored.get("budget_ne_pct") if isinstance(stored, dict) else None
        if budget_ne_pct is None:
            raise ValueError(
                f"{deployed}: its manifest holds no searched NE budget; give --budget-ne PCT"
            )
    ref_model = load(reference_model)
    ref = reference(
        ref_model,
        model_dataset(ref_model, evaluation.files),
        eval_rows=evaluation.eval_rows,
        batch_size=evaluation.batch_size,
        progress=evaluation.progress,
    )
    return recheck(mine, ref, float(budget_ne_pct), progress=evaluation.progress)


def report_dict(result: SearchResult, *, eval_rows: int) -> dict[str, Any]:
    """The report as plain JSON values (see the module docstring)."""
    sizes = table_bytes(result.model)
    quantized = result.deltas.model_bytes
    return {
        "budget_ne_pct": result.budget_ne_pct,
        "fits": result.fits,
        "eval_rows": eval_rows,
        "reference": result.reference_metrics.to_dict(),
        "metrics": result.deltas.metrics.to_dict(),
        "deltas": {
            "ne_pct": result.deltas.ne_pct,
            "auc": result.deltas.auc,
            "calibration": result.deltas.calibration,
        },
        "model_bytes": {
            "reference": result.reference_bytes,
            "quantized": quantized,
            "ratio": quantized / result.reference_bytes,
        },
        "mlp": dict(result.mlp),
        "mlp_alone": None
        if result.mlp_alone is None
        else {
            "ne_pct": result.mlp_alone.ne_pct,
            "auc": result.mlp_alone.auc,
            "calibration": result.mlp_alone.calibration,
        },
        "tables": [
            {"table": c.table, "precision": c.precision, "why": c.why, "bytes": sizes[c.table]}
            for c in result.choices
        ],
        "sensitivity": [s.to_dict() for s in result.sensitivity],
        "steps": list(result.steps),
    }


def attach_report(model: InferenceModel, report: dict[str, Any]) -> InferenceModel:
    """``model`` with ``report`` in its manifest's ``quantization["report"]``."""
    quantization = {**model.manifest.quantization, "report": report}
    return model.with_manifest(quantization=quantization)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table (a summary, then one line per table)."""
    d, b = report["deltas"], report["model_bytes"]
    budget = report["budget_ne_pct"]
    head = [
        f"model size   {_mib(b['quantized'])} (FP32 {_mib(b['reference'])}, "
        f"{b['ratio']:.3f}x)   dense layers: {report['mlp'].get('precision')}",
        f"NE change    {d['ne_pct']:+.4f}%"
        + (
            f"   (budget {budget:g}%: {'within' if report['fits'] else 'OVER'})"
            if budget is not None
            else ""
        ),
        f"AUC change   {d['auc']:+.5f}   calibration change {d['calibration']:+.5f}   "
        f"({report['eval_rows']:,} evaluation rows; FP32 AUC "
        f"{report['reference']['auc']:.4f}, NE {report['reference']['ne']:.4f})",
    ]
    alone = report.get("mlp_alone")
    if alone is not None:
        head.append(
            f"of which the dense layers ({report['mlp'].get('precision')}) alone: NE "
            f"{alone['ne_pct']:+.4f}%, AUC {alone['auc']:+.5f} (every table FP32)"
        )
    head.append("")
    sens = {(s["table"], s["precision"]): s for s in report["sensitivity"]}
    width = max([len("table"), *(len(t["table"]) for t in report["tables"])])
    lines = [f"{'table':<{width}}  {'precision':<9}  {'bytes':>12}  {'alone NE %':>10}  why"]
    for t in report["tables"]:
        alone = sens.get((t["table"], t["precision"]))
        ne = f"{alone['ne_pct']:+.4f}" if alone is not None else "-"
        lines.append(
            f"{t['table']:<{width}}  {t['precision']:<9}  {t['bytes']:>12,}  {ne:>10}  {t['why']}"
        )
    return "\n".join(head + lines)


def format_check(check: Check) -> str:
    """A re-check as a few lines: holds or not, the deltas, the breaking table."""
    d = check.deltas
    verdict = "HOLDS" if check.holds else "DOES NOT HOLD"
    lines = [
        f"{verdict}: NE change {d.ne_pct:+.4f}% against a budget of {check.budget_ne_pct:g}% "
        f"(AUC change {d.auc:+.5f}, calibration change {d.calibration:+.5f}; "
        f"{check.reference_metrics.num_samples:,} rows)"
    ]
    if check.reported is not None:
        was = check.reported
        lines.append(
            f"when chosen: NE change {was.get('ne_pct', math.nan):+.4f}%, "
            f"AUC change {was.get('auc', math.nan):+.5f}"
        )
    for s in sorted(check.tables, key=lambda s: -s.deltas.ne_pct):
        lines.append(f"  {s.table} at {s.precision} alone: NE {s.deltas.ne_pct:+.4f}%")
    if check.breaking is not None:
        lines.append(f"breaks the budget most: table {check.breaking} (raise its precision)")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """A PNG: per table, its NE change alone against its bytes at each precision tried.

    Raises:
        ValueError: if matplotlib is not installed.
    """
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    chosen = {t["table"]: t for t in report["tables"]}
    by_table: dict[str, list[dict[str, Any]]] = {}
    for s in report["sensitivity"]:
        by_table.setdefault(s["table"], []).append(s)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in sorted(by_table.items()):
        fp32_bytes = points[0]["table_bytes"] + points[0]["bytes_saved"]
        xs = [fp32_bytes] + [p["table_bytes"] for p in points]
        ys = [0.0] + [p["ne_pct"] for p in points]
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        (line,) = ax.plot([xs[i] for i in order], [ys[i] for i in order], marker=".", label=name)
        pick = chosen.get(name)
        if pick is not None:
            mine = [p for p in points if p["precision"] == pick["precision"]]
            x, y = (mine[0]["table_bytes"], mine[0]["ne_pct"]) if mine else (fp32_bytes, 0.0)
            ax.plot([x], [y], marker="o", markersize=9, fillstyle="none", color=line.get_color())
    if report["budget_ne_pct"] is not None:
        ax.axhline(report["budget_ne_pct"], color="red", linewidth=0.8, linestyle="--")
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("table bytes (each precision tried; circled: chosen)")
    ax.set_ylabel("NE change of the table alone, % of FP32's NE")
    d = report["deltas"]
    ax.set_title(
        f"whole model: {report['model_bytes']['ratio']:.3f}x FP32's bytes, "
        f"NE {d['ne_pct']:+.4f}%, AUC {d['auc']:+.5f}",
        fontsize=9,
    )
    if len(by_table) <= 30:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
