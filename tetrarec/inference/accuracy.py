"""The accuracy tool chain: a quantized model against its FP32 model, per table and whole.

Every figure is a change against the FP32 model on the same evaluation rows, whose
logits are computed once (``Reference``; the rows are read once too and kept, at most
``eval_rows`` of them)::

    ne_pct       100 * (NE - NE_fp32) / NE_fp32   (positive: worse)
    auc          AUC - AUC_fp32                    (negative: worse)
    calibration  calibration - calibration_fp32

Three tools use it:

- ``table_sensitivity``: one table at a time at each lower precision (FP16, INT8, INT4),
  every other table as in the reference; its deltas and the bytes it saves.
- ``search``: the lowest precision per table whose whole model stays within a budget of
  NE change. It starts from each table's lowest precision whose own NE change is within
  the budget, verifies the whole model, and while it is over the budget raises the
  precision of the table whose step down costs the most NE per byte saved (from the
  sensitivities), verifying again each time. Each table's choice says why: the NE change
  of its next lower precision alone, or ``budget`` when it was raised to fit.
- ``recheck``: a deployed quantized model and its FP32 model on new rows: whether the
  whole model is still within the budget, and which table breaks it if not.

``tetrarec.inference.report`` renders the result as text, JSON and a PNG plot. This
module needs ``tetrarec.train.metrics`` and so is not imported by
``tetrarec.inference`` (which loads a model without the training code).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from tetrarec.data import Dataset, RowRange
from tetrarec.inference.model import InferenceModel
from tetrarec.inference.prune import count_ids, training_dataset
from tetrarec.inference.quantize import (
    LADDER_PRECISIONS,
    QuantSpec,
    precision_ladders,
    quantize_model,
    quantize_tables,
)
from tetrarec.inference.scoring import batches
from tetrarec.sparse import Batch
from tetrarec.train.metrics import Metrics, compute_metrics
from tetrarec.types import Precision

__all__ = [
    "SEARCH_PRECISIONS",
    "Check",
    "Choice",
    "Deltas",
    "Reference",
    "SearchResult",
    "Sensitivity",
    "evaluate_spec",
    "recheck",
    "reference",
    "search",
    "table_bytes",
    "table_sensitivity",
]

#: The precisions the search and the sensitivity consider, widest first.
SEARCH_PRECISIONS = LADDER_PRECISIONS  # each table climbs its precision_ladders


@dataclass(frozen=True, kw_only=True)
class Deltas:
    """A candidate model's metrics against the reference's (see the module docstring).

    Args:
        ne_pct: NE change, in percent of the reference's NE.
        auc: AUC change.
        calibration: calibration change.
        metrics: the candidate's own metrics.
        model_bytes: the candidate's bytes (``InferenceModel.nbytes``).
    """

    ne_pct: float
    auc: float
    calibration: float
    metrics: Metrics
    model_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        return {
            "ne_pct": self.ne_pct,
            "auc": self.auc,
            "calibration": self.calibration,
            "model_bytes": self.model_bytes,
            "metrics": self.metrics.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class Reference:
    """The FP32 model, its evaluation rows (read once) and its logits on them.

    Args:
        model: the reference model.
        rows: the evaluation batches, in order.
        labels: ``(N,)`` labels of the rows.
        logits: ``(N,)`` the reference's logits.
        metrics: the reference's metrics.
    """

    model: InferenceModel
    rows: tuple[Batch, ...]
    labels: torch.Tensor
    logits: torch.Tensor
    metrics: Metrics

    @property
    def num_rows(self) -> int:
        """Evaluation rows."""
        return int(self.labels.numel())

    def logits_of(self, model: InferenceModel) -> torch.Tensor:
        """``(N,)`` logits of ``model`` on the reference's rows."""
        return _logits(model, self.rows)

    def measure(self, model: InferenceModel) -> Deltas:
        """``model``'s deltas against the reference on the same rows."""
        m = compute_metrics(self.logits_of(model), self.labels)
        ref = self.metrics
        return Deltas(
            ne_pct=100.0 * (m.ne - ref.ne) / ref.ne,
            auc=m.auc - ref.auc,
            calibration=m.calibration - ref.calibration,
            metrics=m,
            model_bytes=model.nbytes(),
        )


def _logits(model: InferenceModel, rows: Sequence[Batch]) -> torch.Tensor:
    out = [model.logits(b.dense, b.sparse).float().cpu() for b in rows]
    return torch.cat(out) if out else torch.empty(0)


def reference(
    model: InferenceModel,
    dataset: Dataset,
    *,
    eval_rows: int | None = None,
    batch_size: int = 8192,
    progress: bool = False,
) -> Reference:
    """Read the evaluation rows once and score them with the reference ``model``.

    Args:
        model: the FP32 model (any model: the deltas are against it).
        dataset: the evaluation rows (``tetrarec.inference.scoring.model_dataset``).
        eval_rows: use only the first this many rows (``None``: all).
        batch_size: rows per scoring call.
        progress: a progress bar on stderr.

    Raises:
        ValueError: for ``eval_rows`` under 1, or rows whose labels are all one class
            (NE and AUC are undefined there).
    """
    if eval_rows is not None:
        if eval_rows < 1:
            raise ValueError(f"eval_rows must be at least 1, got {eval_rows}")
        if eval_rows < dataset.num_samples:
            dataset = RowRange(dataset, 0, eval_rows, what="eval_rows")
    rows = tuple(
        b.to(model.device)
        for b in batches(dataset, batch_size=batch_size, progress=progress, desc="read eval rows")
    )
    labels = torch.cat([b.labels.float().cpu() for b in rows]) if rows else torch.empty(0)
    logits = _logits(model, rows)
    metrics = compute_metrics(logits, labels)
    if not 0.0 < metrics.ctr < 1.0:
        raise ValueError(
            f"the {metrics.num_samples} evaluation rows all have label {metrics.ctr:g}: "
            "NE and AUC are undefined; evaluate on rows with both labels"
        )
    return Reference(model=model, rows=rows, labels=labels, logits=logits, metrics=metrics)


def table_bytes(model: InferenceModel) -> dict[str, int]:
    """``{table: bytes}`` of each table as stored (its rows and any id map)."""
    out = dict.fromkeys(model.table_precisions(), 0)
    for key, t in model.tensors().items():
        parts = key.split(".")
        if parts[0] == "tables" and len(parts) == 3:
            out[parts[1]] += t.numel() * t.element_size()
    return out


@dataclass(frozen=True, kw_only=True)
class Sensitivity:
    """One table alone at one precision (every other table as in the reference).

    Args:
        table: the table.
        precision: its precision here (``fp16``, ``int8``, ``int4``).
        deltas: the whole model's deltas.
        table_bytes: the table's bytes at this precision.
        bytes_saved: the reference's bytes minus this model's.
    """

    table: str
    precision: str
    deltas: Deltas
    table_bytes: int
    bytes_saved: int

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        return {
            "table": self.table,
            "precision": self.precision,
            "ne_pct": self.deltas.ne_pct,
            "auc": self.deltas.auc,
            "calibration": self.deltas.calibration,
            "table_bytes": self.table_bytes,
            "bytes_saved": self.bytes_saved,
        }


def _bar(total: int, desc: str, progress: bool) -> tqdm[Any]:
    return tqdm(
        total=total, desc=desc, unit="model", file=sys.stderr, disable=not progress,
        dynamic_ncols=True, leave=False,
    )  # fmt: skip


def table_sensitivity(
    ref: Reference,
    precisions: Iterable[Precision] = SEARCH_PRECISIONS[1:],
    *,
    tables: Sequence[str] | None = None,
    progress: bool = False,
) -> list[Sensitivity]:
    """Each table alone at each of ``precisions``: its deltas and the bytes it saves.

    Args:
        ref: the reference (its model's tables are the starting point).
        precisions: the precisions to try (those a table already has, and those that
            would not store it smaller, ``precision_ladders``, are skipped).
        tables: the tables to try (default: every table of the model).
        progress: a progress bar on stderr (one step per model scored).
    """
    now = ref.model.table_precisions()
    names = list(tables) if tables is not None else list(now)
    base_bytes = ref.model.nbytes()
    ladders = precision_ladders(ref.model)
    todo = [(t, p) for t in names for p in precisions if p is not now[t] and p in ladders[t]]
    out = []
    with _bar(len(todo), "sensitivity", progress) as bar:
        for name, precision in todo:
            candidate = quantize_tables(ref.model, {name: precision})
            deltas = ref.measure(candidate)
            out.append(
                Sensitivity(
                    table=name,
                    precision=precision.value,
                    deltas=deltas,
                    table_bytes=table_bytes(candidate)[name],
                    bytes_saved=base_bytes - deltas.model_bytes,
                )
            )
            bar.update(1)
    return out


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One table's chosen precision and why.

    Args:
        table: the table.
        precision: the chosen precision.
        why: a short reason (its next lower precision's NE change alone, ``budget``,
            ``given``, ``smallest searched``).
    """

    table: str
    precision: str
    why: str


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What ``search`` chose, its verification and the steps it took.

    Args:
        spec: the chosen ``QuantSpec`` (every table named).
        model: the quantized model (its manifest not yet holding the report).
        deltas: the chosen model's verified deltas.
        fits: whether ``deltas.ne_pct`` is within ``budget_ne_pct``.
        budget_ne_pct: the budget.
        choices: per table, the precision and why.
        sensitivity: the per-table sensitivities it started from.
        steps: each verified model: ``{"tables", "ne_pct", "model_bytes", "action"}``.
        reference_metrics: the reference's metrics.
        reference_bytes: the reference's bytes.
        mlp: the dense format and its settings.
        mlp_alone: the dense format's deltas alone (every table FP32); ``None`` for FP32
            dense layers.
    """

    spec: QuantSpec
    model: InferenceModel
    deltas: Deltas
    fits: bool
    budget_ne_pct: float | None
    choices: tuple[Choice, ...]
    sensitivity: tuple[Sensitivity, ...]
    steps: tuple[dict[str, Any], ...]
    reference_metrics: Metrics
    reference_bytes: int
    mlp: dict[str, Any] = field(default_factory=dict)
    mlp_alone: Deltas | None = None


def _mlp_alone(
    ref: Reference,
    mlp: str,
    settings: Mapping[str, Any],
    quantize: Callable[[InferenceModel, QuantSpec], InferenceModel],
) -> Deltas | None:
    """The deltas of the dense format alone (every table as in the reference).

    The part of a whole model's change that no table causes; ``None`` for FP32 dense
    layers.
    """
    if mlp == "fp32":
        return None
    return ref.measure(quantize(ref.model, QuantSpec(mlp=mlp, mlp_settings=settings)))


def _sens_index(sens: Iterable[Sensitivity]) -> dict[tuple[str, str], Sensitivity]:
    return {(s.table, s.precision): s for s in sens}


def _cost(index: Mapping[tuple[str, str], Sensitivity], table: str, p: Precision) -> float:
    """The NE change (clipped at 0: noise never pays) of ``table`` alone at ``p``."""
    if p is Precision.FP32:
        return 0.0
    return max(index[(table, p.value)].deltas.ne_pct, 0.0)


def _saved(index: Mapping[tuple[str, str], Sensitivity], table: str, p: Precision) -> int:
    return 0 if p is Precision.FP32 else index[(table, p.value)].bytes_saved


def _raise_one(
    index: Mapping[tuple[str, str], Sensitivity],
    current: Mapping[str, Precision],
    ladders: Mapping[str, tuple[Precision, ...]],
) -> str | None:
    """The table to raise one precision (``None`` when every table is at FP32).

    It is the one whose last step down costs the most NE per byte it saves.
    """
    worst, worst_rate = None, -1.0
    for table, p in current.items():
        if p is Precision.FP32:
            continue
        up = ladders[table][ladders[table].index(p) - 1]
        cost = _cost(index, table, p) - _cost(index, table, up)
        saved = max(_saved(index, table, p) - _saved(index, table, up), 1)
        rate = max(cost, 0.0) / saved
        if rate > worst_rate:
            worst, worst_rate = table, rate
    return worst


def _first_choice(
    index: Mapping[tuple[str, str], Sensitivity],
    table: str,
    budget: float,
    ladder: tuple[Precision, ...],
) -> tuple[Precision, str]:
    """The smallest precision of ``ladder`` whose own NE change is within ``budget``, and why."""
    if len(ladder) == 1:
        return Precision.FP32, "no smaller precision for its dim"
    for i in range(len(ladder) - 1, 0, -1):
        p = ladder[i]
        if index[(table, p.value)].deltas.ne_pct <= budget:
            if i == len(ladder) - 1:
                ne = index[(table, p.value)].deltas.ne_pct
                return p, f"smallest searched ({p.value} alone: NE {ne:+.3g}%)"
            lower = ladder[i + 1]
            ne = index[(table, lower.value)].deltas.ne_pct
            return p, f"{lower.value} alone: NE {ne:+.3g}% > budget {budget:g}%"
    ne = index[(table, ladder[1].value)].deltas.ne_pct
    return Precision.FP32, f"{ladder[1].value} alone: NE {ne:+.3g}% > budget {budget:g}%"


def search(
    ref: Reference,
    budget_ne_pct: float,
    *,
    fixed: Mapping[str, Precision] | None = None,
    mlp: str = "fp32",
    mlp_settings: Mapping[str, Any] | None = None,
    prune_min_count: int = 0,
    prune_counts: Mapping[str, torch.Tensor] | None = None,
    progress: bool = False,
    quantize: Callable[[InferenceModel, QuantSpec], InferenceModel] = quantize_model,
) -> SearchResult:
    """The lowest precision per table that keeps the whole model within the NE budget.

    Args:
        ref: the FP32 reference and its evaluation rows.
        budget_ne_pct: the largest NE change allowed, in percent of the reference's NE.
        fixed: tables whose precision is given (not searched).
        mlp: the dense format of every model tried (a key of ``DENSE_FORMATS``).
        mlp_settings: its settings (``{"activations": "dynamic"}``).
        prune_min_count: prune every model tried as ``QuantSpec.prune_min_count`` says
            (the per-table sensitivities are of unpruned tables).
        prune_counts: the counts to prune by (``None``: counted once, here).
        progress: progress bars on stderr.
        quantize: how a spec becomes a model (``quantize_model``; a test may wrap it).

    Returns:
        The chosen model, verified; ``fits`` is false only when even every searched
        table at FP32 is over the budget (the fixed tables or the MLP format alone
        cost more), and then the model is that one.

    Raises:
        ValueError: for a negative budget, an unknown fixed table or dense format.
    """
    if budget_ne_pct < 0:
        raise ValueError(f"the NE budget must be 0% or more, got {budget_ne_pct}%")
    fixed = dict(fixed or {})
    settings = dict(mlp_settings or {})
    searched = [t for t in ref.model.table_precisions() if t not in fixed]
    ladders = precision_ladders(ref.model)
    if prune_min_count > 0 and prune_counts is None:
        prune_counts = count_ids(ref.model, training_dataset(ref.model), progress=progress)

    def spec_of(tables: Mapping[str, Precision]) -> QuantSpec:
        return QuantSpec(
            tables=tables,
            mlp=mlp,
            mlp_settings=settings,
            prune_min_count=prune_min_count,
            prune_counts=prune_counts,
        )

    sens = table_sensitivity(ref, tables=searched, progress=progress)
    index = _sens_index(sens)
    current: dict[str, Precision] = {}
    why: dict[str, str] = {}
    for table in searched:
        current[table], why[table] = _first_choice(index, table, budget_ne_pct, ladders[table])
    steps: list[dict[str, Any]] = []

    def verify(action: str) -> tuple[InferenceModel, Deltas]:
        spec = spec_of({**fixed, **current})
        model = quantize(ref.model, spec)
        deltas = ref.measure(model)
        steps.append(
            {
                "tables": {t: p.value for t, p in current.items()},
                "ne_pct": deltas.ne_pct,
                "auc": deltas.auc,
                "model_bytes": deltas.model_bytes,
                "action": action,
            }
        )
        return model, deltas

    with _bar(1, "search", progress) as bar:
        model, deltas = verify("start: each table's lowest precision within the budget alone")
        bar.update(1)
        mlp_alone = _mlp_alone(ref, mlp, settings, quantize)
        # Raising tables cannot bring the model under a budget its dense format alone is over.
        over = mlp_alone is not None and mlp_alone.ne_pct > budget_ne_pct
        while deltas.ne_pct > budget_ne_pct and not over:
            worst = _raise_one(index, current, ladders)
            if worst is None:
                break
            p = current[worst]
            up = ladders[worst][ladders[worst].index(p) - 1]
            current[worst] = up
            why[worst] = f"budget (raised from {p.value})"
            bar.total += 1
            model, deltas = verify(f"{worst}: {p.value} -> {up.value}")
            bar.update(1)
    choices = [Choice(table=t, precision=p.value, why="given") for t, p in fixed.items()]
    choices += [Choice(table=t, precision=current[t].value, why=why[t]) for t in searched]
    return SearchResult(
        spec=spec_of({**fixed, **current}),
        model=model,
        deltas=deltas,
        fits=deltas.ne_pct <= budget_ne_pct,
        budget_ne_pct=budget_ne_pct,
        choices=tuple(choices),
        sensitivity=tuple(sens),
        steps=tuple(steps),
        reference_metrics=ref.metrics,
        reference_bytes=ref.model.nbytes(),
        mlp={"precision": mlp, **settings},
        mlp_alone=mlp_alone,
    )


def evaluate_spec(
    ref: Reference,
    spec: QuantSpec,
    *,
    progress: bool = False,
    quantize: Callable[[InferenceModel, QuantSpec], InferenceModel] = quantize_model,
) -> SearchResult:
    """A given spec, measured: the whole model's deltas and each changed table's alone.

    The result has the shape of ``search``'s (``budget_ne_pct`` ``None``, every
    choice ``given``), so that one report renders both.
    """
    model = quantize(ref.model, spec)
    now = ref.model.table_precisions()
    changed = {t: p for t, p in spec.tables.items() if p is not now.get(t)}
    sens = []
    with _bar(len(changed) + 1, "evaluate", progress) as bar:
        deltas = ref.measure(model)
        bar.update(1)
        for t, p in changed.items():
            sens += table_sensitivity(ref, (p,), tables=(t,))
            bar.update(1)
    precisions = model.table_precisions()
    return SearchResult(
        spec=spec,
        model=model,
        deltas=deltas,
        fits=True,
        budget_ne_pct=None,
        choices=tuple(
            Choice(table=t, precision=p.value, why="given") for t, p in precisions.items()
        ),
        sensitivity=tuple(sens),
        steps=(),
        reference_metrics=ref.metrics,
        reference_bytes=ref.model.nbytes(),
        mlp={"precision": spec.mlp, **spec.mlp_settings},
        mlp_alone=_mlp_alone(ref, spec.mlp, spec.mlp_settings, quantize),
    )


@dataclass(frozen=True, kw_only=True)
class Check:
    """A deployed quantized model re-measured against its FP32 model on new rows.

    Args:
        holds: whether the whole model's NE change is within the budget.
        budget_ne_pct: the budget.
        deltas: the deployed model's deltas on the new rows.
        tables: per quantized table, its deltas alone at its deployed precision.
        breaking: the table that costs the most NE alone when the budget does not
            hold (``None`` when it holds, or no table is quantized).
        reference_metrics: the FP32 model's metrics on the new rows.
        reported: the deltas the model's stored report measured when it was chosen.
    """

    holds: bool
    budget_ne_pct: float
    deltas: Deltas
    tables: tuple[Sensitivity, ...]
    breaking: str | None
    reference_metrics: Metrics
    reported: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        return {
            "holds": self.holds,
            "budget_ne_pct": self.budget_ne_pct,
            "breaking_table": self.breaking,
            "deltas": self.deltas.to_dict(),
            "reference": self.reference_metrics.to_dict(),
            "tables": [s.to_dict() for s in self.tables],
            "reported": self.reported,
        }


def recheck(
    deployed: InferenceModel,
    ref: Reference,
    budget_ne_pct: float,
    *,
    progress: bool = False,
) -> Check:
    """Whether ``deployed``'s precision choices still hold on ``ref``'s (new) rows.

    Args:
        deployed: the quantized model.
        ref: its FP32 source model on the new evaluation rows.
        budget_ne_pct: the budget the choices must stay within.
        progress: a progress bar on stderr.

    Raises:
        ValueError: if the two models do not have the same tables.
    """
    mine, theirs = deployed.table_precisions(), ref.model.table_precisions()
    if set(mine) != set(theirs):
        raise ValueError(
            f"the quantized model's tables {sorted(mine)} are not its reference's "
            f"{sorted(theirs)}: give the FP32 model it was quantized from"
        )
    deltas = ref.measure(deployed)
    per_table: list[Sensitivity] = []
    with _bar(len(mine), "recheck", progress) as bar:
        for t, p in mine.items():
            if p is not theirs[t]:
                per_table += table_sensitivity(ref, (p,), tables=(t,))
            bar.update(1)
    holds = deltas.ne_pct <= budget_ne_pct
    breaking = None
    if not holds and per_table:
        breaking = max(per_table, key=lambda s: s.deltas.ne_pct).table
    report = deployed.manifest.quantization.get("report")
    reported = report.get("deltas") if isinstance(report, dict) else None
    return Check(
        holds=holds,
        budget_ne_pct=budget_ne_pct,
        deltas=deltas,
        tables=tuple(per_table),
        breaking=breaking,
        reference_metrics=ref.metrics,
        reported=reported,
    )
