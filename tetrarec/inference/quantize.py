"""Post-training quantization of an exported model: tables per precision, then the MLPs.

``quantize_tables`` stores each named table in a lower precision (FP16, BF16, INT8 or
INT4; round to nearest, row-wise scale and bias for the integer formats: no stochastic
rounding at inference). Tables are converted from the rows the model holds, decoded to
FP32 first, ``CHUNK_ROWS`` rows at a time, so a large table never needs a second FP32
copy of itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tetrarec.inference.dense import DENSE_FORMATS, DENSE_PREFIX
from tetrarec.inference.model import InferenceModel
from tetrarec.inference.prune import count_ids, prune_tables, training_dataset
from tetrarec.kernels import decode_rows, encode_rows, row_width
from tetrarec.sparse import Batch
from tetrarec.types import Precision

__all__ = [
    "CHUNK_ROWS",
    "LADDER_PRECISIONS",
    "TABLE_PRECISIONS",
    "QuantSpec",
    "convert_rows",
    "precision_ladders",
    "quantize_model",
    "quantize_tables",
    "tables_at",
]

CHUNK_ROWS = 1 << 18
#: The precisions a table of an exported model may be stored in, widest first.
TABLE_PRECISIONS = (Precision.FP32, Precision.FP16, Precision.BF16, Precision.INT8, Precision.INT4)

#: The precisions a table steps down through, widest first (BF16 is FP16's size: one of
#: them is enough, and FP16 keeps more mantissa for embedding values).
LADDER_PRECISIONS = (Precision.FP32, Precision.FP16, Precision.INT8, Precision.INT4)


def precision_ladders(model: InferenceModel) -> dict[str, tuple[Precision, ...]]:
    """``{table: precisions to search, widest first}``: each one stores the table smaller.

    ``LADDER_PRECISIONS`` in order, keeping only a precision whose rows take fewer bytes
    than the last one kept: a packed INT8/INT4 row carries 4 bytes of scale and bias
    (aligned to 4), so on a narrow table it is no smaller than FP16 (a first-order
    term's dim-1 table: FP32 4 bytes, FP16 2, INT8 and INT4 8) and is never chosen.
    """
    out = {}
    for entry in model.manifest.tables:
        dim = int(entry["dim"])
        ladder = [Precision.FP32]
        for p in LADDER_PRECISIONS[1:]:
            if _row_bytes(p, dim) < _row_bytes(ladder[-1], dim):
                ladder.append(p)
        out[str(entry["name"])] = tuple(ladder)
    return out


def _row_bytes(precision: Precision, dim: int) -> int:
    return precision.row_bytes(dim) if precision.is_integer else dim * precision.bits // 8


def tables_at(model: InferenceModel, precision: Precision) -> dict[str, Precision]:
    """``{table: precision}`` for every table, unless a wider precision stores it as small.

    Each table gets, of ``precision`` and the wider ones of ``LADDER_PRECISIONS``, the one
    that stores it in the fewest bytes (the widest on a tie): ``--tables int8`` on a model
    with a first-order term puts its dim-1 tables in FP16 (2 bytes a row), not INT8 (8
    bytes: a code, FP16 scale and bias, aligned to 4); a dim-4 table asked for INT8 stays
    FP16 (8 bytes either way).

    Raises:
        ValueError: for a precision a table cannot be stored in (FP8).
    """
    if precision not in TABLE_PRECISIONS:
        valid = ", ".join(p.value for p in TABLE_PRECISIONS)
        raise ValueError(f"{precision.value} is not a table precision; valid: {valid}")
    level = {p: i for i, p in enumerate(LADDER_PRECISIONS)}
    level[Precision.BF16] = level[Precision.FP16]
    wider = [p for p in LADDER_PRECISIONS if level[p] < level[precision]]
    out = {}
    for entry in model.manifest.tables:
        dim = int(entry["dim"])
        choices = [*wider, precision]
        out[str(entry["name"])] = min(choices, key=lambda p: (_row_bytes(p, dim), level[p]))
    return out


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """What ``quantize_model`` does to a model.

    Args:
        tables: ``{table: precision}``; tables not named keep theirs.
        mlp: the dense layers' format, a key of ``tetrarec.inference.dense.DENSE_FORMATS``
            (``fp32``, and the lower ones registered there).
        mlp_settings: the format's settings (for INT8: ``{"activations": "dynamic"}``
            or ``"static"``), stored in the manifest's ``dense`` section.
        prune_min_count: prune, before converting precisions, every table's rows seen
            fewer than this many times in the training rows
            (``tetrarec.inference.prune``); 0 prunes nothing.
        prune_counts: the counts to prune by (``count_ids``); ``None`` counts the
            training run's training rows (``training_dataset``), which must be readable.
    """

    tables: Mapping[str, Precision] = field(default_factory=dict)
    mlp: str = "fp32"
    mlp_settings: Mapping[str, Any] = field(default_factory=dict)
    prune_min_count: int = 0
    prune_counts: Mapping[str, torch.Tensor] | None = None


def quantize_model(
    model: InferenceModel, spec: QuantSpec, *, calibration: Iterable[Batch] | None = None
) -> InferenceModel:
    """``model`` with its tables and dense layers stored as ``spec`` says.

    Args:
        model: the model to quantize (left as it is).
        spec: what to do.
        calibration: batches (dense features already transformed, as
            ``tetrarec.inference.scoring.batches`` gives them) that a dense format
            calibrates on: static INT8 activations need them (a few batches of training
            rows, e.g. ``batches(training_dataset(model), batch_size=2048)`` cut short).

    Raises:
        ValueError: for an unknown table, table precision, dense format or dense
            setting, or static INT8 activations without calibration batches.
    """
    if spec.mlp not in DENSE_FORMATS:
        raise ValueError(
            f"dense format {spec.mlp!r} is not one this tetrarec has; valid: "
            f"{sorted(DENSE_FORMATS)}"
        )
    out = model
    if spec.prune_min_count > 0:
        counts = spec.prune_counts
        if counts is None:
            counts = count_ids(model, training_dataset(model))
        now = out.table_precisions()
        dims = {str(e["name"]): int(e["dim"]) for e in out.manifest.tables}
        row_bytes = {
            name: _row_bytes(spec.tables.get(name, p), dims[name]) for name, p in now.items()
        }
        out = prune_tables(out, counts, spec.prune_min_count, row_bytes=row_bytes)
    out = quantize_tables(out, spec.tables) if spec.tables else out
    dense = DENSE_FORMATS[spec.mlp].complete_settings(
        out.module, {**spec.mlp_settings, "precision": spec.mlp}, calibration
    )
    if dense == dict(out.manifest.dense):
        return out
    tensors = out.tensors()
    tensors = {k: v for k, v in tensors.items() if not k.startswith(DENSE_PREFIX)}
    tensors.update(DENSE_FORMATS[spec.mlp].save(out.module, dense))
    manifest = dataclasses.replace(
        out.manifest,
        dense=dense,
        quantization={**out.manifest.quantization, "dense": dense},
    )
    return InferenceModel.from_parts(manifest, tensors, backend=out.embeddings.backend)


def convert_rows(
    rows: torch.Tensor, source: Precision, target: Precision, dim: int
) -> torch.Tensor:
    """Stored rows of ``source`` precision as stored rows of ``target`` (round to nearest)."""
    if source is target:
        return rows.clone()
    out = torch.empty(rows.shape[0], row_width(target, dim), dtype=_stored_dtype(target))
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, rows.shape[0])
        fp32 = decode_rows(rows[start:stop], source, dim)
        out[start:stop] = encode_rows(fp32, target, stochastic=False)
    return out


def _stored_dtype(precision: Precision) -> torch.dtype:
    return torch.uint8 if precision.is_integer else precision.torch_dtype


def quantize_tables(model: InferenceModel, precisions: Mapping[str, Precision]) -> InferenceModel:
    """``model`` with each table named in ``precisions`` stored in that precision.

    A first-order table may be named too (``C1_first_order``); tables not named keep
    their precision. The result is a new model built from the converted tensors (the
    unchanged ones shared with ``model``).

    Raises:
        ValueError: for a table the model does not have, or a precision a table cannot
            be stored in (FP8).
    """
    now = model.table_precisions()
    unknown = sorted(set(precisions) - set(now))
    if unknown:
        raise ValueError(f"no such table(s) in the model: {unknown}; it has {sorted(now)}")
    bad = sorted(p.value for p in precisions.values() if p not in TABLE_PRECISIONS)
    if bad:
        valid = ", ".join(p.value for p in TABLE_PRECISIONS)
        raise ValueError(f"{bad[0]} is not a table precision; valid: {valid}")
    tensors = model.tensors()
    entries = []
    for entry in model.manifest.tables:
        name = str(entry["name"])
        target = precisions.get(name, now[name])
        if target is not now[name]:
            key = f"tables.{name}.rows"
            tensors[key] = convert_rows(tensors[key], now[name], target, int(entry["dim"]))
        entries.append({**entry, "precision": target.value})
    quantization = {
        **model.manifest.quantization,
        "tables": {str(e["name"]): e["precision"] for e in entries},
    }
    manifest = dataclasses.replace(model.manifest, tables=entries, quantization=quantization)
    return InferenceModel.from_parts(manifest, tensors, backend=model.embeddings.backend, path=None)
