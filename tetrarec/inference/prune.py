"""Pruning an exported model's tables: drop the rows the training data rarely used.

``count_ids`` counts how often each id of each table appears in the training rows;
``prune_tables`` keeps, per table, the rows seen at least ``min_count`` times::

    table C1, 6 ids, counts [9, 0, 3, 1, 0, 7], min_count 2
    stored rows:  [row 0, row 2, row 5, zeros]          (kept + 1 zero row)
    remap (int32): [0, 3, 1, 3, 3, 2]                   (id -> stored row)

A pruned id then pools the zero row: it adds nothing to a sum (a mean still counts it,
as an unseen id would). A table where nothing would be pruned stays as it is (no id
map). Pruning a pruned table again keeps the rows it kept that are still counted often
enough. The rows are moved in their stored precision, so pruning and quantizing
commute bit for bit.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping

import torch
from tqdm import tqdm

from tetrarec.config.tables import build_tables
from tetrarec.data import BatchLoader, Dataset, build_datasets
from tetrarec.inference.model import InferenceModel
from tetrarec.models import FIRST_ORDER_SUFFIX

__all__ = ["count_ids", "prune_tables", "training_dataset"]


def training_dataset(model: InferenceModel) -> Dataset:
    """The training run's training rows, through the model's saved dense transform.

    What ``count_ids`` counts, and what static INT8 activations calibrate on.

    Raises:
        DataFileNotFoundError, DataError, ValueError: as ``build_datasets`` (for
            example, the training files are gone).
    """
    config = model.config
    train, _ = build_datasets(config.data, build_tables(config.model), dense=model.dense_transform)
    return train


def count_ids(
    model: InferenceModel,
    dataset: Dataset,
    *,
    batch_size: int = 8192,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """``{table: (rows,) int64}``: how often each id of each table appears in ``dataset``.

    Every feature of a table adds to its counts; a first-order table
    (``C1_first_order``) gets its embedding table's counts (it is looked up by the same
    ids). ``rows`` is the number of ids the table answers (the manifest's ``rows``).
    """
    tables = model.embeddings.tables
    rows = {str(e["name"]): int(e["rows"]) for e in model.manifest.tables}
    counts = {t.name: torch.zeros(rows[t.name], dtype=torch.int64) for t in tables}
    table_of = {f: t.name for t in tables for f in t.feature_names}
    loader = BatchLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False, epochs=1)
    bar = tqdm(
        total=dataset.num_samples, desc="count ids", unit="sample", unit_scale=True,
        file=sys.stderr, disable=not progress, leave=False,
    )  # fmt: skip
    try:
        for batch in loader:
            sparse = batch.sparse
            start = 0
            for key, n in zip(sparse.keys, sparse.value_counts_host()):
                ids = sparse.values[start : start + n].long()
                start += n
                name = table_of[key]
                counts[name] += torch.bincount(ids, minlength=rows[name])[: rows[name]]
            bar.update(batch.labels.numel())
    finally:
        bar.close()
        loader.close()
    if model.first_order_rows is not None:
        for t in model.first_order_rows.tables:
            counts[t.name] = counts[t.name.removesuffix(FIRST_ORDER_SUFFIX)]
    return counts


def prune_tables(
    model: InferenceModel,
    counts: Mapping[str, torch.Tensor],
    min_count: int,
    *,
    row_bytes: Mapping[str, int] | None = None,
) -> InferenceModel:
    """``model`` with each counted table's rows seen fewer than ``min_count`` times pruned.

    Args:
        model: the model (left as it is).
        counts: ``count_ids``'s result, or any ``{table: (rows,) counts}``; tables not
            named are left as they are.
        min_count: the fewest times a row must have been seen to be kept (1 drops the
            rows never seen).
        row_bytes: ``{table: bytes of a row}`` as the table will be stored (after a
            precision change that follows); default: as stored now. A table is pruned
            only where that saves bytes: its id map costs 4 bytes per id, more than the
            rows it drops when few are dropped or the rows are small (a dim-1 table).

    Raises:
        ValueError: for a table the model does not have, counts of another length than
            the ids the table answers, or ``min_count < 1``.
    """
    if min_count < 1:
        raise ValueError(f"prune min_count must be at least 1, got {min_count}")
    ids = {str(e["name"]): int(e["rows"]) for e in model.manifest.tables}
    unknown = sorted(set(counts) - set(ids))
    if unknown:
        raise ValueError(f"counts for table(s) the model does not have: {unknown}")
    tensors = model.tensors()
    entries, kept_rows = [], {}
    for entry in model.manifest.tables:
        name = str(entry["name"])
        c = counts.get(name)
        if c is None:
            entries.append(entry)
            continue
        if c.shape != (ids[name],):
            raise ValueError(
                f"table {name!r}: counts of shape {tuple(c.shape)}, the table answers "
                f"{ids[name]} ids"
            )
        keep = c.cpu() >= min_count
        width = (row_bytes or {}).get(name)
        if width is None:
            stored = tensors[f"tables.{name}.rows"]
            width = stored.shape[1] * stored.element_size()
        kept_now = int(keep.sum()) + 1  # and the zero row
        if f"tables.{name}.remap" not in tensors and kept_now * width + 4 * ids[name] >= (
            ids[name] * width
        ):
            entries.append(entry)  # the id map would cost more than the rows it drops
            continue
        pruned = _prune(tensors, name, keep)
        if pruned is None:
            entries.append(entry)
            continue
        rows, remap = pruned
        tensors[f"tables.{name}.rows"] = rows
        tensors[f"tables.{name}.remap"] = remap
        entries.append({**entry, "stored_rows": rows.shape[0]})
        kept_rows[name] = rows.shape[0] - 1
    quantization = {
        **model.manifest.quantization,
        "prune": {"min_count": min_count, "kept_rows": kept_rows},
    }
    manifest = dataclasses.replace(model.manifest, tables=entries, quantization=quantization)
    return InferenceModel.from_parts(manifest, tensors, backend=model.embeddings.backend)


def _prune(
    tensors: Mapping[str, torch.Tensor], name: str, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(stored rows, remap)`` keeping the ids of ``keep``, or ``None`` if all stay."""
    rows = tensors[f"tables.{name}.rows"]
    old = tensors.get(f"tables.{name}.remap")
    if old is None:
        if bool(keep.all()):
            return None
        current = torch.arange(keep.numel())
    else:
        current = old.long()
        keep = keep & (current != rows.shape[0] - 1)  # its zero row stays pruned
    kept = torch.nonzero(keep).squeeze(1)  # ids kept, ascending
    stored = torch.cat([rows[current[kept]], torch.zeros_like(rows[:1])])  # + zero row
    remap = torch.full((keep.numel(),), kept.numel(), dtype=torch.int32)
    remap[kept] = torch.arange(kept.numel(), dtype=torch.int32)
    return stored, remap
