"""Evaluation: exact metrics of a model over a dataset, or of a saved checkpoint."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from tetrarec.comm import Communicator
from tetrarec.config import RunConfig
from tetrarec.config.tables import build_tables
from tetrarec.data import BatchLoader, Dataset, evaluation_dataset
from tetrarec.train.build import build_parts, check_cache_dir
from tetrarec.train.checkpoint import read_meta
from tetrarec.train.metrics import MetricAccumulator, Metrics, compute_metrics
from tetrarec.train.state import check_same_cache, load_dense_transform, load_model_state

__all__ = ["checkpoint_config", "evaluate", "evaluate_checkpoint"]

logger = logging.getLogger(__name__)


def evaluate(
    model: torch.nn.Module,
    dataset: Dataset,
    *,
    batch_size: int,
    comm: Communicator | None = None,
    device: torch.device | None = None,
    progress: bool = False,
) -> Metrics:
    """Exact metrics of ``model`` over every row of ``dataset``, in order.

    ``progress`` shows a bar of the rows evaluated on stderr (rank 0's): ``tetrarec
    eval`` turns it on; the training loop's evaluations keep to the training bar.

    The model is put in eval mode for the pass and restored afterwards. With ``comm``
    (a sharded model), each rank evaluates its slice of every batch and the metrics are
    those of the whole dataset, the same on every rank (logits and labels gathered).
    Each batch goes to ``device`` (the model's; default CPU); the logits come back to
    the host in float64, where the metrics are computed exactly as on a CPU run.
    """
    device = torch.device("cpu") if device is None else device
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    loader = BatchLoader(
        dataset,
        batch_size=batch_size,
        rank=rank,
        world_size=world,
        shuffle=False,
        drop_last=False,
        epochs=1,
    )
    acc = MetricAccumulator()
    was_training = model.training
    model.eval()
    bar = tqdm(
        total=dataset.num_samples,
        unit="sample",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress or rank != 0,
        dynamic_ncols=True,
        leave=False,
    )
    try:
        with torch.no_grad():
            for batch in loader:
                batch = batch.to(device)
                acc.update(model(batch.dense, batch.sparse), batch.labels)  # logits (B,)
                bar.update(batch.labels.numel() * world)  # every rank's slice alike
    finally:
        bar.close()
        loader.close()
        model.train(was_training)
    if comm is None or world == 1:
        return acc.compute()
    logits, labels = acc.tensors()
    sizes = comm.all_gather_v(
        torch.tensor([logits.numel()]), sizes=[1] * world, label="eval_sizes"
    ).wait()
    counts = [int(s[0]) for s in sizes]
    pairs = comm.all_gather_v(torch.stack([logits, labels], 1), sizes=counts, label="eval").wait()
    every = torch.cat(pairs)  # (N, 2), rank-major (metrics do not depend on the order)
    return compute_metrics(every[:, 0], every[:, 1])


def checkpoint_config(path: str | Path) -> RunConfig:
    """The ``RunConfig`` a checkpoint was trained with.

    Raises:
        FileNotFoundError: if ``path`` is not a checkpoint.
        ValueError: if its ``meta.json`` is damaged (no ``config``, for one).
    """
    return RunConfig.from_dict(read_meta(path, require={"config": dict})["config"])


def evaluate_checkpoint(
    path: str | Path,
    *,
    data: Sequence[str] = (),
    overrides: Sequence[str] = (),
    progress: bool = False,
) -> Metrics:
    """Rebuild the model saved in checkpoint ``path`` and evaluate it.

    The dense features go through the transform saved in the checkpoint (fitted on the
    run's training rows), never one refitted on the evaluated data. The model is built
    on the device ``train.device`` resolves to here (the saved run's setting unless an
    override changes it; checkpoints hold CPU tensors, so any device loads them).

    Args:
        path: a checkpoint directory (``<checkpoint_dir>/step_<n>``).
        data: input files (or a directory for ``binary``) of the run's ``data.source``
            to evaluate on, all rows unless ``data.eval_rows`` is set (by an override);
            empty evaluates on the run's own evaluation split: when that is
            ``data.eval_path``, only those files are read (the training files may be
            gone); rows of ``data.train_path`` need that file.
        progress: show a progress bar of the rows evaluated on stderr.
        overrides: dotted config overrides of the run's config (for example
            ``"data.source=criteo"`` or ``"data.eval_rows=[0, 1000]"``); the dense
            transform is the checkpoint's whatever ``data.dense_*`` says.

    Returns:
        The metrics over every evaluated row.

    Raises:
        ValueError: on a bad override, a source that reads no files with ``data``, data
            that does not fit the model (its dense columns mapped in another order than
            the run's among them), or ``train.device = "cuda"`` without CUDA.
    """
    saved_config = checkpoint_config(path)
    config = saved_config
    if data:  # the run's row ranges were for its own inputs
        config = config.with_overrides(["data.train_rows=none", "data.eval_rows=none"])
    config = config.with_overrides(list(overrides))
    check_same_cache(
        path,
        saved_config.to_dict()["model"],
        config.model,
        doing="eval",
        advice="evaluate with the run's [model.cache] settings (leave them out of --set)",
    )
    if not config.model.cached:
        # Evaluation applies no optimizer: build the tables with SGD's, which holds no
        # state (Adam's would take twice the tables' memory, for nothing). The rows'
        # layout does not depend on it. A cache keeps optimizer state per slot, and its
        # checkpoint holds it, so a cached model keeps its optimizer.
        config = config.with_overrides(["optim.sparse.kind=sgd"])
    check_cache_dir(config.model)  # as training does: by its key, before any file is read
    tables = build_tables(config.model)
    eval_ds = evaluation_dataset(config.data, tables, load_dense_transform(path), data)
    device = config.train.resolve_device()
    parts = build_parts(config, num_dense=eval_ds.num_dense, device=device)
    load_model_state(path, parts.model)
    logger.info("evaluating %s on %d rows (%s)", path, eval_ds.num_samples, device)
    return evaluate(
        parts.model,
        eval_ds,
        batch_size=config.data.eval_batch_size,
        device=device,
        progress=progress,
    )
