"""A trained, exported model for tests and benchmarks that need one to score or serve."""

from __future__ import annotations

from pathlib import Path

from tetrarec.config import RunConfig
from tetrarec.inference.export import export_checkpoint
from tetrarec.train import train

__all__ = ["trained_model_dir"]


def trained_model_dir(config: RunConfig, root: Path) -> Path:
    """Train ``config`` with its checkpoints under ``root/ckpt``; export the last one.

    Returns:
        ``root/model``, the exported model directory.
    """
    config = config.with_overrides([f"train.checkpoint_dir={str(root / 'ckpt')!r}"])
    result = train(config)
    if result.checkpoint is None:
        raise ValueError("the run wrote no checkpoint to export (train.checkpoint_every)")
    export_checkpoint(result.checkpoint, root / "model")
    return root / "model"
