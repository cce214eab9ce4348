"""``export_checkpoint``: a training checkpoint (any world size, any plan) as a model.

The model directory (``tetrarec.inference.format``) holds every table whole in FP32, as
the training run's evaluation read it (``tetrarec.train.checkpoint_tables``: sharded
blocks put back together, cached rows from their cache), the dense layers in FP32, the
run's config and its dense transform. Optimizer state, RNG states and the plan stay
behind. ``tetrarec quantize`` then stores tables and layers in lower precisions.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from tetrarec.inference.dense import DENSE_PREFIX
from tetrarec.inference.format import Manifest, ModelFileError
from tetrarec.inference.model import InferenceModel, save
from tetrarec.train.checkpoint_tables import CheckpointTables

__all__ = ["export_checkpoint"]

logger = logging.getLogger(__name__)


def export_checkpoint(
    checkpoint: str | Path, output: str | Path, *, progress: bool = False
) -> InferenceModel:
    """Export the model of ``checkpoint`` to the model directory ``output``.

    Args:
        checkpoint: a checkpoint directory, one-process or sharded.
        output: the model directory to write (replaced if it is a model directory).
        progress: show a bar of the tables read on stderr.

    Returns:
        The exported model, as loaded from what was written.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a checkpoint or misses a file.
        ModelFileError: if ``output``'s parent directory does not exist.
        ValueError: for a damaged checkpoint (naming the file).
    """
    if not Path(output).parent.is_dir():  # before reading every table, not after
        raise ModelFileError(f"{output}: its parent directory {Path(output).parent} does not exist")
    source = CheckpointTables(checkpoint)
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    bar = tqdm(
        source.tables, desc="export", unit="table", file=sys.stderr, disable=not progress,
        leave=False,
    )  # fmt: skip
    for t in bar:
        tensors[f"tables.{t.name}.rows"] = source.read_table(t.name)
        entries.append(
            {
                "name": t.name,
                "rows": t.num_embeddings,
                "stored_rows": t.num_embeddings,
                "dim": t.dim,
                "precision": "fp32",
                "trained_precision": t.precision.value,
                "pooling": t.pooling.value,
                "features": list(t.feature_names),
            }
        )
    tensors.update({DENSE_PREFIX + k: v for k, v in source.model_tensors().items()})
    sharding = source.meta.get("sharding") or {}
    manifest = Manifest(
        config=source.meta["config"],
        dense_transform=source.meta.get("dense_transform"),
        tables=entries,
        dense={"precision": "fp32"},
        source={
            "checkpoint": str(Path(checkpoint).resolve()),
            "step": int(source.meta["step"]),
            "world_size": source.world_size,
            "plan_fingerprint": sharding.get("fingerprint"),
        },
    )
    model = InferenceModel.from_parts(manifest, tensors)  # checks that everything fits
    written = save(model, output)
    logger.info(
        "exported %s (step %d, %d rank(s)) to %s: %d tables, %.1f MB",
        checkpoint, manifest.source["step"], source.world_size, output, len(entries),
        written.files["tensors.safetensors"]["bytes"] / 1e6,
    )  # fmt: skip
    return model.with_manifest(files=written.files, content_hash=written.content_hash)
