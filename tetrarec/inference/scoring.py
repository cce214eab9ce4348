"""Scoring an exported model over a dataset: logits of every row, and exact metrics.

``model_dataset`` gives the rows a model scores, read with the model's own data
settings (its source, columns, hashing and bad-line rules) through its saved dense
transform; ``score_dataset`` runs the model over them in order; ``evaluate_model`` turns
the logits into the training run's metrics (``tetrarec.train.metrics``: the same
AUC, NE, log loss and calibration the run's evaluation reported). Scoring input may lack
labels (``model_dataset(..., require_labels=False)``); metrics refuse such a dataset.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import torch
from tqdm import tqdm

from tetrarec.config.tables import build_tables
from tetrarec.data import BatchLoader, Dataset, evaluation_dataset
from tetrarec.data.datasets import has_labels
from tetrarec.inference.model import InferenceModel
from tetrarec.sparse import Batch
from tetrarec.train.metrics import Metrics, compute_metrics

__all__ = ["batches", "evaluate_model", "model_dataset", "score_dataset"]


def model_dataset(
    model: InferenceModel, files: Sequence[str] = (), *, require_labels: bool = True
) -> Dataset:
    """The rows of ``files`` (or the training run's evaluation split) as ``model`` reads them.

    With ``require_labels=False`` files without labels are read too (``has_labels``
    of the dataset says whether they had them; their batches' labels are NaN).

    Raises:
        ValueError, DataError, DataFileNotFoundError: as ``evaluation_dataset``.
    """
    config = model.config
    if files:  # the run's row ranges were for its own inputs
        config = config.with_overrides(["data.train_rows=none", "data.eval_rows=none"])
    return evaluation_dataset(
        config.data,
        build_tables(config.model),
        model.dense_transform,
        tuple(files),
        require_labels=require_labels,
    )


def batches(
    dataset: Dataset, *, batch_size: int, progress: bool = False, desc: str = "score"
) -> Iterator[Batch]:
    """Every row of ``dataset`` in order, ``batch_size`` at a time (a bar on stderr)."""
    loader = BatchLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False, epochs=1)
    bar = tqdm(
        total=dataset.num_samples, desc=desc, unit="sample", unit_scale=True,
        file=sys.stderr, disable=not progress, dynamic_ncols=True, leave=False,
    )  # fmt: skip
    try:
        for batch in loader:
            yield batch
            bar.update(batch.labels.numel())
    finally:
        bar.close()
        loader.close()


def score_dataset(
    model: InferenceModel, dataset: Dataset, *, batch_size: int = 8192, progress: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, labels)``, ``(N,)`` FP32 each, of every row of ``dataset`` in order."""
    logits, labels = [], []
    for batch in batches(dataset, batch_size=batch_size, progress=progress):
        batch = batch.to(model.device)
        logits.append(model.logits(batch.dense, batch.sparse).float().cpu())
        labels.append(batch.labels.float().cpu())
    if not logits:
        return torch.empty(0), torch.empty(0)
    return torch.cat(logits), torch.cat(labels)


def evaluate_model(
    model: InferenceModel, dataset: Dataset, *, batch_size: int = 8192, progress: bool = False
) -> Metrics:
    """Exact metrics of ``model`` over every row of ``dataset``.

    Raises:
        ValueError: if ``dataset`` has no labels (files read without them).
    """
    if not has_labels(dataset):
        raise ValueError(
            "cannot compute metrics: the input has no labels (its files lack the label "
            "column); score it with predict instead"
        )
    logits, labels = score_dataset(model, dataset, batch_size=batch_size, progress=progress)
    return compute_metrics(logits, labels)
