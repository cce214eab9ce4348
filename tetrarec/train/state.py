"""What a training checkpoint holds, and how a run is saved into and restored from one.

Tensor names in ``tensors.safetensors``::

    model.<name>              dense layers (``model.state_dict()`` minus the embeddings)
    embedding.<name>          ``model.embeddings.state_dict()`` (a fused module's state
                              dict includes its optimizer state)
    dense_optim.<i>.<name>    dense optimizer state per parameter index
    sparse_optim.<k>.<name>   the tables' optimizer state: ``<k>`` is the table name for a
                              fused module's optimizer, the parameter index for the
                              reference embedding's sparse-gradient optimizer
    rng.torch|numpy|python    RNG states

``meta.json`` holds the step, the data position (the global batch number the next step
reads), the run config and the non-tensor parts of the optimizer and RNG states.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tetrarec.config import RunConfig
from tetrarec.train.build import RunParts
from tetrarec.train.checkpoint import (
    CheckpointData,
    capture_rng_state,
    flatten_optimizer_state,
    prune_checkpoints,
    read_checkpoint,
    restore_rng_state,
    unflatten_optimizer_state,
    write_checkpoint,
)

__all__ = ["NonFiniteStateError", "load_model_state", "load_run_state", "save_run_state"]

_EMB = "embeddings."


class NonFiniteStateError(RuntimeError):
    """A weight or optimizer state holds nan or inf; it must not be checkpointed."""


def _model_tensors(parts: RunParts) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in parts.model.state_dict().items() if not k.startswith(_EMB)}
    out.update({f"embedding.{k}": v for k, v in parts.model.embeddings.state_dict().items()})
    return out


def save_run_state(
    root: str | Path,
    parts: RunParts,
    *,
    step: int,
    config: RunConfig,
    keep: int,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Checkpoint ``parts`` after ``step`` steps into ``root``; keep the ``keep`` newest.

    Raises:
        NonFiniteStateError: if a weight or optimizer state is not finite (the previous
            checkpoints are left untouched).
    """
    tensors = _model_tensors(parts)
    dense_t, dense_j = flatten_optimizer_state(parts.dense_optimizer.state_dict(), "dense_optim")
    tensors.update(dense_t)
    meta: dict[str, Any] = {
        "data_position": step,
        "config": config.to_dict(),
        "dense_optim": dense_j,
        **(extra_meta or {}),
    }
    sp_t, sp_j = flatten_optimizer_state(parts.sparse_optimizer.state_dict(), "sparse_optim")
    tensors.update(sp_t)
    meta["sparse_optim"] = sp_j
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise NonFiniteStateError(
            f"not checkpointing step {step}: non-finite values in {bad[:5]}"
            f"{' ...' if len(bad) > 5 else ''}"
        )
    rng_t, rng_j = capture_rng_state()
    tensors.update(rng_t)
    meta["rng"] = rng_j
    path = write_checkpoint(root, CheckpointData(step=step, tensors=tensors, meta=meta))
    prune_checkpoints(root, keep)
    return path


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def load_model_state(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load only the model (dense layers and embeddings) from a checkpoint; return meta.

    Raises:
        ValueError: if the checkpoint's tensors do not fit the model.
    """
    data = read_checkpoint(path)
    _load_model(data, model, path)
    return data.meta


def _load_model(data: CheckpointData, model: torch.nn.Module, path: str | Path) -> None:
    dense = _strip(data.tensors, "model.")
    emb = _strip(data.tensors, "embedding.")
    try:
        result = model.load_state_dict(dense, strict=False)
        model.get_submodule("embeddings").load_state_dict(emb)
    except RuntimeError as e:  # torch reports size mismatches and missing keys so
        raise ValueError(f"{path}: checkpoint does not fit the model: {e}") from e
    missing = [k for k in result.missing_keys if not k.startswith(_EMB)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path}: checkpoint does not fit the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def load_run_state(path: str | Path, parts: RunParts) -> tuple[int, int]:
    """Restore model, optimizers and RNG states from a checkpoint.

    Returns:
        ``(step, data_position)``: steps done and the next global batch number.

    Raises:
        ValueError: if the checkpoint does not fit the run (model or optimizers).
    """
    data = read_checkpoint(path)
    _load_model(data, parts.model, path)
    parts.dense_optimizer.load_state_dict(
        unflatten_optimizer_state(data.tensors, data.meta["dense_optim"], "dense_optim")
    )
    try:
        parts.sparse_optimizer.load_state_dict(
            unflatten_optimizer_state(data.tensors, data.meta["sparse_optim"], "sparse_optim")
        )
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"{path}: the tables' optimizer state does not fit this run (was it written with "
            f"another embedding module or optimizer?): {e}"
        ) from e
    restore_rng_state(data.tensors, data.meta["rng"])
    return data.step, int(data.meta["data_position"])
