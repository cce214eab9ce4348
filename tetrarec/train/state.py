"""What a training checkpoint holds, and how a run is saved into and restored from one.

Tensor names in ``tensors.safetensors``::

    model.<name>              dense layers (``model.state_dict()`` minus the embeddings);
                              with a first-order term, its per-row weights and their
                              Adagrad sums too (``first_order.*``: a small fused module
                              whose state dict holds its own optimizer state)
    embedding.<name>          ``model.embeddings.state_dict()``: the rows and the
                              rounding stream (a fused module's optimizer state is in
                              ``sparse_optim``, below)
    dense_optim.<i>.<name>    dense optimizer state per parameter index
    sparse_optim.<k>.<name>   the tables' optimizer state: ``<k>`` is the table name for a
                              fused module's optimizer, the parameter index for the
                              reference embedding's sparse-gradient optimizer
    rng.torch|numpy|python    RNG states (and rng.cuda, the GPU generator of a CUDA run)

Every tensor is saved from the CPU (a CUDA run's are copied to the host) and loaded
into the run's own tensors wherever they live, so a checkpoint written on one device
resumes or evaluates on another.

``meta.json`` holds the step, the data position (the global batch number the next step
reads), the run config, the fitted dense transform (``dense_transform``: per-column
kind, training-row mean and standard deviation, clipping; see ``tetrarec.data.dense``)
and the non-tensor parts of the optimizer and RNG states. Evaluation and resume apply
the saved dense transform; they never refit it on whatever data they are given.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tetrarec.config import ModelConfig, RunConfig
from tetrarec.data import DenseTransform, TransformedDataset
from tetrarec.train.build import RunParts, model_collections
from tetrarec.train.checkpoint import (
    CheckpointData,
    _damaged_meta,
    capture_rng_state,
    flatten_optimizer_state,
    prune_checkpoints,
    read_checkpoint,
    read_meta,
    read_rank_tensors,
    restore_rng_state,
    unflatten_optimizer_state,
    verify_for_load,
    write_checkpoint,
    write_sharded_checkpoint,
)

__all__ = [
    "NonFiniteStateError",
    "check_same_cache",
    "load_dense_transform",
    "load_model_state",
    "load_run_state",
    "restore_dense_transform",
    "save_run_state",
    "verify_run_checkpoint",
]

logger = logging.getLogger(__name__)

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
    dense: DenseTransform | None = None,
) -> Path:
    """Checkpoint ``parts`` after ``step`` steps into ``root``; keep the ``keep`` newest.

    Args:
        root: the checkpoint directory of the run.
        parts: the model and its optimizers.
        step: steps done.
        config: the run's config (saved, so the checkpoint alone rebuilds the model).
        keep: how many checkpoints to keep.
        extra_meta: more JSON values for ``meta.json``.
        dense: the run's fitted dense transform (``train_ds.transform``), saved so that
            evaluation and resume apply the training statistics.

    Returns:
        The checkpoint's path.

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
    if dense is not None:
        meta["dense_transform"] = dense.to_dict()
    sp_t, sp_j = flatten_optimizer_state(parts.sparse_optimizer.state_dict(), "sparse_optim")
    tensors.update(sp_t)
    meta["sparse_optim"] = sp_j
    rng_t, rng_j = capture_rng_state(device=parts.device)
    if parts.env is not None and parts.env.world_size > 1:
        return _save_sharded(root, parts, step, tensors, meta, (rng_t, rng_j), keep)
    _check_finite(tensors, step, 0)
    tensors.update(rng_t)
    meta["rng"] = rng_j
    path = write_checkpoint(root, CheckpointData(step=step, tensors=tensors, meta=meta))
    prune_checkpoints(root, keep)
    return path


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(v.isfinite().all())]


def _check_finite(tensors: dict[str, torch.Tensor], step: int, bad_elsewhere: int) -> None:
    bad = _non_finite(tensors)
    if bad or bad_elsewhere:
        where = f"{bad[:5]}{' ...' if len(bad) > 5 else ''}" if bad else "another rank's state"
        raise NonFiniteStateError(f"not checkpointing step {step}: non-finite values in {where}")


def _save_sharded(
    root: str | Path,
    parts: RunParts,
    step: int,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]],
    keep: int,
) -> Path:
    """Each rank writes its blocks, their optimizer state and its RNGs; rank 0 the rest."""
    env, plan = parts.env, parts.plan
    assert env is not None
    assert plan is not None
    comm = env.comm
    # Rank 0 writes the dense parameters (DistributedDataParallel keeps them equal on
    # every rank) and the dense optimizer; each rank writes everything else it holds:
    # its blocks and their optimizer state, of the embedding tables and of any other
    # sharded collection in the model (a first-order term's rows, whose Adagrad state
    # its module saves beside them), and its RNGs.
    replicated = {f"model.{n}" for n, _ in parts.model.named_parameters()}
    own = {
        k: v
        for k, v in tensors.items()
        if k.startswith(("embedding.", "sparse_optim."))
        or (k.startswith("model.") and k not in replicated)
    }
    dense = {k: v for k, v in tensors.items() if k not in own}
    bad = comm.all_reduce(torch.tensor([float(bool(_non_finite(tensors)))]), label="checkpoint")
    _check_finite(tensors, step, int(bad.wait()[0]))
    own.update(rng[0])
    shards = [e for c in model_collections(parts.model) for e in c.shard_layout()]
    # The blocks this rank's optimizer state is keyed by (each rank's own: rank 0's meta
    # is the one written, and an SGD block has no tensor to name it).
    keys = meta["sparse_optim"]["keys"]
    ranks = comm.all_gather_json(
        {"rng": rng[1], "shards": shards, "sparse_optim_keys": keys}, label="checkpoint"
    )
    meta["sharding"] = {
        "world_size": env.world_size,
        "local_world_size": env.local_world_size,
        "plan": plan.to_dict(),
        "fingerprint": plan.fingerprint(),
        "ranks": ranks,
    }
    data = CheckpointData(step=step, tensors=dense if comm.rank == 0 else {}, meta=meta)
    path = write_sharded_checkpoint(root, data, own, comm)
    if comm.rank == 0:
        prune_checkpoints(root, keep)
    comm.barrier(label="checkpoint")
    return path


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def check_same_cache(
    path: str | Path, saved: dict[str, Any], mine: ModelConfig, *, doing: str, advice: str
) -> None:
    """Refuse to load checkpoint ``path`` with caches of another policy or size.

    A checkpoint holds each cache's slots and policy state as that policy and size left
    them: restored under another policy they would be kept as they are (an LRU cache's
    rows "pinned" by ``static``, while the log named other rows), and under another size
    they do not fit. A checkpoint of uncached tables has no caches to restore (its
    tables may start caching).

    Args:
        path: the checkpoint.
        saved: its ``model`` config, as its ``meta.json`` holds it.
        mine: the model config that would load it.
        doing: what loads it, the message's first word (``"resume"``, ``"eval"``).
        advice: what to do instead, the message's end.

    Raises:
        ValueError: naming both caches' settings, if they differ.
    """
    placed = saved.get("placement", "host")
    placed = placed if isinstance(placed, list) else [placed]
    if not mine.cached or not any(p in ("cached", "ssd") for p in placed):
        return
    was = {k: saved.get("cache", {}).get(k) for k in ("policy", "fraction", "bytes")}
    cache = mine.cache
    now = {"policy": cache.policy.value, "fraction": cache.fraction, "bytes": cache.bytes}
    if was != now:
        raise ValueError(
            f"{doing}: {path} cached its tables with model.cache {_settings(was)}, not "
            f"{_settings(now)}: its caches' contents are saved for that policy and size, "
            f"so {advice}"
        )


def _settings(values: dict[str, Any]) -> str:
    """``"policy=lru fraction=0.2"``: the settings that are set."""
    return " ".join(f"{k}={v}" for k, v in values.items() if v is not None)


def load_model_state(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load only the model (dense layers and embeddings) from a checkpoint; return meta.

    Raises:
        ValueError: if the checkpoint's tensors do not fit the model.
    """
    data = read_checkpoint(path, prefixes=("model.", "embedding."))
    if "sharding" in data.meta:
        raise ValueError(
            f"{path} holds tables sharded over {data.meta['sharding']['world_size']} ranks; "
            "tetrarec eval cannot load a sharded checkpoint yet (in one process or under "
            "torchrun): its evaluations are the sharded run's own (train.eval_every; the "
            "summary's best and final metrics)"
        )
    _load_model(data, model, path)
    return data.meta


def _load_model(data: CheckpointData, model: torch.nn.Module, path: str | Path) -> None:
    dense = _strip(data.tensors, "model.")
    emb = _strip(data.tensors, "embedding.")
    saved_cached = {k for k in emb if k.startswith("cache.")}
    held = model.get_submodule("embeddings").state_dict() if saved_cached else {}
    uncached = sorted({k.split(".")[1] for k in saved_cached if k not in held})
    if uncached:
        raise ValueError(
            f"{path}: tables {', '.join(uncached[:5])} were saved cached (model.placement "
            "cached or ssd, with their cache's state) and this run does not cache them: "
            "give model.placement the checkpoint's value for them"
        )
    try:
        result = model.load_state_dict(dense, strict=False)
        model.get_submodule("embeddings").load_state_dict(emb)
    except RuntimeError as e:  # torch reports size mismatches and missing keys so
        why = " ".join(str(e).split())  # torch's message spans lines; errors are one line
        raise ValueError(f"{path}: checkpoint does not fit the model: {why}") from e
    missing = [k for k in result.missing_keys if not k.startswith(_EMB)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path}: checkpoint does not fit the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def verify_run_checkpoint(path: str | Path, parts: RunParts) -> None:
    """Verify checkpoint ``path`` against its manifest before ``parts`` loads it.

    In a sharded run every rank calls it (it is collective): each hashes the files it
    will read, and a missing or damaged file is the same error on every rank.

    Raises:
        ValueError: naming the first missing or damaged file.
    """
    sharded = parts.env is not None and parts.env.world_size > 1
    verify_for_load(path, parts.env.comm if sharded and parts.env is not None else None)


def load_run_state(path: str | Path, parts: RunParts, *, verify: bool = True) -> tuple[int, int]:
    """Restore model, optimizers and RNG states from a checkpoint.

    The optimizers keep the hyperparameters ``parts`` was built with (this run's
    config); only their state comes from the checkpoint (``_load_optimizer_state``).

    Args:
        path: the checkpoint.
        parts: the run's model and optimizers, loaded in place.
        verify: first verify the checkpoint (``verify_run_checkpoint``, collective in a
            sharded run); ``False`` where the caller did.

    Returns:
        ``(step, data_position)``: steps done and the next global batch number.

    Raises:
        ValueError: if a file is missing or damaged (naming it), the checkpoint does not
            fit the run (model or optimizers), or its ``meta.json`` is damaged (a key
            missing, a value of another type).
    """
    if verify:
        verify_run_checkpoint(path, parts)
    data = read_checkpoint(path, verify=False)
    with _damaged_meta(path):
        return _load_run_state(path, parts, data)


def _load_run_state(path: str | Path, parts: RunParts, data: CheckpointData) -> tuple[int, int]:
    """``load_run_state`` once ``data`` is read."""
    _check_same_layout(data, parts, path)
    rank_meta: dict[str, Any] | None = None
    if "sharding" in data.meta:
        assert parts.env is not None
        rank = parts.env.rank
        data = CheckpointData(
            step=data.step,
            tensors={**data.tensors, **read_rank_tensors(path, rank, verify=False)},
            meta=data.meta,
        )
        rank_meta = data.meta["sharding"]["ranks"][rank]
    _load_model(data, parts.model, path)
    _load_optimizer_state(
        parts.dense_optimizer,
        unflatten_optimizer_state(data.tensors, data.meta["dense_optim"], "dense_optim"),
    )
    sparse_json = data.meta["sparse_optim"]
    if rank_meta is not None and "sparse_optim_keys" in rank_meta:
        sparse_json = {**sparse_json, "keys": rank_meta["sparse_optim_keys"]}
    try:
        _load_optimizer_state(
            parts.sparse_optimizer,
            unflatten_optimizer_state(data.tensors, sparse_json, "sparse_optim"),
        )
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"{path}: the tables' optimizer state does not fit this run (was it written with "
            f"another embedding module or optimizer?): {e}"
        ) from e
    restore_rng_state(
        data.tensors, rank_meta["rng"] if rank_meta else data.meta["rng"], device=parts.device
    )
    return data.step, int(data.meta["data_position"])


def _load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load the ``saved`` state into ``optimizer``, keeping its own hyperparameters.

    The state (moments, accumulators, step counts) continues the checkpoint's; the
    hyperparameters (weight decay, eps, betas, ...) stay those ``optimizer`` was built
    with from this run's config, as the learning rate follows the config at every step
    (``set_learning_rate``). ``load_state_dict`` alone would put back the saved groups'
    values, and a resume would ignore a changed setting while its checkpoints recorded
    the new one. With an unchanged config the values are the same: a resumed run stays
    bitwise equal to one never interrupted.
    """
    own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        group.update(settings)


def load_dense_transform(path: str | Path) -> DenseTransform | None:
    """The dense transform saved in checkpoint ``path``; ``None`` if it holds none.

    Checkpoints written before dense transforms were saved hold none; their runs used
    the source's default transform, which needs no statistics.

    Raises:
        FileNotFoundError: if ``path`` is not a checkpoint.
        ValueError: if the saved transform is malformed.
    """
    saved = read_meta(path).get("dense_transform")
    if saved is None:
        return None
    try:
        return DenseTransform.from_dict(saved)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def restore_dense_transform(
    path: str | Path, train: TransformedDataset, held_out: TransformedDataset
) -> tuple[TransformedDataset, TransformedDataset]:
    """``(train, held_out)`` with the dense transform saved in checkpoint ``path``.

    A resumed run applies the statistics it trained with, not ones refitted on the
    data it finds now, so it continues bitwise as if never interrupted. A checkpoint
    without a saved transform leaves the datasets as they are.

    Raises:
        ValueError: if the saved transform does not fit the data's dense columns (their
            number, or the same names in another order).
        DataError: if the data cannot give the saved transform (old binary format).
    """
    saved = load_dense_transform(path)
    if saved is None:
        return train, held_out
    saved.check_columns(train.transform.columns, "the training data")
    now = train.transform
    if (saved.kinds, saved.clip) != (now.kinds, now.clip):
        logger.warning(
            "data.dense_transform or data.dense_clip differs from the run's in %s (%s, clip "
            "%s); resuming with the saved transform",
            path,
            ", ".join(f"{c} {k.value}" for c, k in zip(saved.columns, saved.kinds)),
            saved.clip,
        )
    elif saved != now:
        logger.warning(
            "the training data now gives other dense statistics than when %s was written; "
            "resuming with the saved ones",
            path,
        )
    return train.with_transform(saved), held_out.with_transform(saved)


def _check_same_layout(data: CheckpointData, parts: RunParts, path: str | Path) -> None:
    """Refuse to resume on another world or plan than the checkpoint's (a later issue).

    Raises:
        ValueError: naming what differs.
    """
    saved = data.meta.get("sharding")
    env, plan = parts.env, parts.plan
    sharded_now = env is not None and env.world_size > 1
    if saved is None and not sharded_now:
        return
    if saved is None or not sharded_now:
        was = f"{saved['world_size']} ranks" if saved else "one process"
        now = f"{env.world_size} ranks" if sharded_now and env is not None else "one process"
        raise ValueError(
            f"{path} was written by {was}, this run has {now}: resuming on another world "
            "size or plan is not supported yet (resharding a checkpoint is a later feature)"
        )
    assert env is not None
    assert plan is not None
    if saved["world_size"] != env.world_size or saved["fingerprint"] != plan.fingerprint():
        raise ValueError(
            f"{path} was written with {saved['world_size']} ranks and plan "
            f"{saved['fingerprint']}, this run has {env.world_size} ranks and plan "
            f"{plan.fingerprint()} ({_plan_difference(saved['plan'], plan.to_dict())}): "
            "resuming with another world size or plan is not supported yet (resharding a "
            "checkpoint is a later feature)"
        )


def _plan_difference(was: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between two plans' dicts, briefly.

    The first of: world size, ranks per node (``sharding.local_world_size``), the tables'
    names, the first table that differs.
    """
    for key, setting in (("world_size", "ranks"), ("local_world_size", "ranks per node")):
        if was.get(key) != now.get(key):
            return f"{setting}: {was.get(key)} then, {now.get(key)} now"
    tables_was = {t["table"]: t for t in was.get("tables", [])}
    tables_now = {t["table"]: t for t in now.get("tables", [])}
    if set(tables_was) != set(tables_now):
        return f"tables: {sorted(tables_was)} then, {sorted(tables_now)} now"
    for name, t in tables_now.items():
        old = tables_was[name]
        for key in ("sharding", "placement", "shards"):
            if old.get(key) != t.get(key):
                if key == "shards":
                    return f"table {name!r}: its shards differ"
                return f"table {name!r}: {key} {old.get(key)} then, {t.get(key)} now"
    return "the plans differ"
