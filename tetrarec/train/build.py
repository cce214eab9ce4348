"""Build a run's parts from its ``RunConfig``: tables, embedding module, model, optimizers.

Each step is a small function so that tests, benchmarks and ``tetrarec eval`` build
exactly what training builds.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from tetrarec.config import EmbeddingKind, ModelConfig, RunConfig
from tetrarec.config.tables import build_tables
from tetrarec.embedding import EmbeddingBagCollection, HeldTables, SparseOptimizerSpec, TableConfig
from tetrarec.models import DLRM, EmbeddingModule, build_model
from tetrarec.sharding import ShardingEnv, ShardingPlan
from tetrarec.train.optim import build_dense_optimizer, build_sparse_optimizer
from tetrarec.types import Placement, Precision

__all__ = [
    "EMBEDDINGS",
    "EmbeddingBuilder",
    "RunParts",
    "SparseGradientEmbeddings",
    "build_embeddings",
    "build_parts",
    "check_cache_dir",
    "embedding_optimizer",
    "held_tables",
    "model_collections",
    "model_embeddings",
]

logger = logging.getLogger(__name__)


def _reference(
    tables: tuple[TableConfig, ...], spec: SparseOptimizerSpec, seed: int, device: torch.device
) -> nn.Module:
    bad = [t.name for t in tables if t.precision is not Precision.FP32]
    if bad:
        raise ValueError(
            f"the reference embedding stores FP32 rows only; tables {bad} ask for "
            f"{tables[0].precision.value}: set model.embedding = 'fused'"
        )
    # Initialized on the CPU (the same rows on every device), then moved.
    return EmbeddingBagCollection(tables, seed=seed).to(device)


def _fused(
    tables: tuple[TableConfig, ...], spec: SparseOptimizerSpec, seed: int, device: torch.device
) -> nn.Module:
    # Imported here: the kernels package compiles its CPU kernel on first use only.
    from tetrarec.kernels import FusedEmbeddingBagCollection

    # Built on the device (rows drawn on the CPU chunk by chunk, the same on every device).
    return FusedEmbeddingBagCollection(tables, spec, seed=seed, device=device)


EmbeddingBuilder = Callable[
    [tuple[TableConfig, ...], SparseOptimizerSpec, int, torch.device], nn.Module
]

# (tables, sparse optimizer, seed, device) -> the embedding module, on that device.
EMBEDDINGS: dict[EmbeddingKind, EmbeddingBuilder] = {
    EmbeddingKind.REFERENCE: _reference,
    EmbeddingKind.FUSED: _fused,
}


def build_embeddings(
    config: RunConfig,
    tables: tuple[TableConfig, ...],
    static_counts: Mapping[str, torch.Tensor] | None = None,
    *,
    device: torch.device | None = None,
) -> nn.Module:
    """The embedding module ``config.model.embedding`` names, seeded by ``train.seed``.

    Where a table's ``model.placement`` is ``cached`` or ``ssd``, the fused collection
    is a ``tetrarec.cache.CachedEmbeddingBagCollection`` (``[model.cache]``).

    Args:
        config: the run.
        tables: its tables (``build_tables``).
        static_counts: ``{table: (rows,) counts}`` of the ``static`` policy's sample
            (``tetrarec.train.static_cache.sample_counts``). Without them a static
            cache pins rows ``0..slots-1``: only for a model whose state a checkpoint
            replaces next (``tetrarec eval`` loads the pinned rows it saved).
        device: where the rows live (default CPU); for ``cached`` and ``ssd`` tables,
            where their cache slots live (their backing rows stay in host memory). The
            initial rows are the same on every device.
    """
    model = config.model
    device = torch.device("cpu") if device is None else device
    if model.cached:  # ModelConfig has checked that the embedding is fused
        from tetrarec.cache import CachedEmbeddingBagCollection, CachePolicy

        # On a GPU the slots live in device memory, the backing rows in host memory,
        # and `host` tables stay on the device as in the uncached module ("device").
        on_device = device.type != "cpu"
        placements = {
            t.name: Placement.DEVICE if on_device and p is Placement.HOST else p
            for t, p in zip(tables, model.table_placements)
        }
        if static_counts is None and model.cache.policy is CachePolicy.STATIC:
            static_counts = {
                t.name: torch.zeros(t.num_embeddings, dtype=torch.int64) for t in tables
            }
        return CachedEmbeddingBagCollection(
            tables,
            config.optim.sparse,
            model.cache.spec(),
            placements=placements,
            static_counts=static_counts,
            seed=config.train.seed,
            device=device,
        )
    return EMBEDDINGS[model.embedding](tables, config.optim.sparse, config.train.seed, device)


# The embedding module is an nn.Module attribute of the model, so its static type says
# nothing of the protocol; training narrows it with isinstance on this protocol.
@runtime_checkable
class SparseGradientEmbeddings(EmbeddingModule, Protocol):
    """An embedding module whose tables get sparse gradients (the reference collection)."""

    def sparse_parameters(self) -> list[nn.Parameter]:
        """Return the parameters a separate sparse optimizer updates."""


def embedding_optimizer(embeddings: nn.Module, spec: SparseOptimizerSpec) -> torch.optim.Optimizer:
    """The optimizer of the tables of ``embeddings``.

    A fused module (unsharded or sharded) brings its own (``fused_optimizer``: the rows
    are updated in its backward); for the reference collection a sparse-gradient
    ``torch.optim`` optimizer is built from ``spec``. Either way the trainer drives it
    like the dense one.

    Raises:
        TypeError: if the module has neither a fused optimizer nor sparse parameters.
    """
    fused = getattr(embeddings, "fused_optimizer", None)
    if isinstance(fused, torch.optim.Optimizer):
        return fused
    if not isinstance(embeddings, SparseGradientEmbeddings):
        raise TypeError(
            f"{type(embeddings).__name__} has no fused_optimizer and no sparse_parameters() "
            "for a separate one"
        )
    return build_sparse_optimizer(spec, list(embeddings.sparse_parameters()))


def model_embeddings(model: DLRM) -> EmbeddingModule:
    """Return ``model.embeddings``, typed by the embedding protocol.

    Raises:
        TypeError: if the module lacks a member of ``EmbeddingModule``.
    """
    embeddings = model.get_submodule("embeddings")
    if not isinstance(embeddings, EmbeddingModule):
        raise TypeError(
            f"{type(embeddings).__name__} does not follow tetrarec.models.EmbeddingModule"
        )
    return embeddings


def model_collections(model: nn.Module) -> list[HeldTables]:
    """Every embedding collection of ``model``, outermost first found.

    The model's embeddings and a first-order term's rows (sharded or not), never the
    local kernels inside a sharded collection.
    """
    found: list[HeldTables] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        if isinstance(module, HeldTables):
            found.append(module)
            inside.append(f"{name}.")
    return found


def held_tables(embeddings: object) -> HeldTables:
    """Return ``embeddings``, typed by what the trainer reads of every collection.

    Its shard layout and cache counters (``tetrarec.embedding.HeldTables``): the
    reference, fused, cached and sharded collections all answer them, so the trainer
    never asks which it holds.

    Raises:
        TypeError: if the module lacks a member of ``HeldTables``.
    """
    if not isinstance(embeddings, HeldTables):
        raise TypeError(
            f"{type(embeddings).__name__} does not follow tetrarec.embedding.HeldTables"
        )
    return embeddings


def check_cache_dir(config: ModelConfig) -> None:
    """Refuse, by its key, a ``model.cache.dir`` the run could only fail on later.

    A file, or (for tables placed ``ssd``, whose files go there) a directory that cannot
    be made or written, is bad input: training and ``tetrarec eval`` both check it
    before building anything.

    Raises:
        ValueError: naming ``model.cache.dir`` and what is wrong with it.
    """
    where = config.cache.dir
    if not where:
        return
    if Path(where).exists() and not Path(where).is_dir():
        raise ValueError(f"model.cache.dir={where!r} is a file; give a directory")
    if Placement.SSD in config.table_placements:
        try:
            Path(where).mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".tetrarec-probe-", dir=where)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ValueError(
                f"model.cache.dir={where!r}: the ssd placement cannot write its files there "
                f"({e.strerror or e})"
            ) from e


@dataclass(frozen=True, kw_only=True)
class RunParts:
    """What a training run trains.

    Args:
        model: the DLRM (its embedding module is ``model.embeddings``).
        dense_optimizer: updates the parameters outside the embedding module.
        sparse_optimizer: updates the tables (``embedding_optimizer``): a fused module's
            own optimizer object, or a sparse-gradient one.
        forward: what the training step calls: the model itself, or the model wrapped
            for data-parallel dense layers (``DistributedDataParallel``) when sharded.
            ``None`` means ``model``.
        plan: the sharding plan, for a sharded run.
        env: the process groups of a sharded run.
    """

    model: DLRM
    dense_optimizer: torch.optim.Optimizer
    sparse_optimizer: torch.optim.Optimizer
    forward: nn.Module | None = None
    plan: ShardingPlan | None = None
    env: ShardingEnv | None = None

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        """``(dense, sparse)``."""
        return self.dense_optimizer, self.sparse_optimizer

    @property
    def device(self) -> torch.device:
        """Where the model trains: the device of its dense layers."""
        first = next(self.model.dense_parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def step_model(self) -> nn.Module:
        """The module a training step calls (``forward``, or the model)."""
        return self.forward if self.forward is not None else self.model

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` and step both optimizers.

        A fused embedding module updates its rows during the backward pass itself (its
        optimizer's ``step`` has nothing left to do).
        """
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
        for opt in self.optimizers:
            opt.step()


def build_parts(
    config: RunConfig,
    *,
    num_dense: int,
    device: torch.device | None = None,
    describe_only: bool = False,
    static_counts: Mapping[str, torch.Tensor] | None = None,
) -> RunParts:
    """Build the model and its optimizers, all initialized from ``config.train.seed``.

    Every weight is drawn on the CPU and then placed on ``device``, so a run starts
    from the same weights on every device.

    Args:
        config: the run.
        num_dense: dense features the data provides (checked against the model).
        device: where the model lives (``TrainConfig.resolve_device``; default CPU):
            the dense layers and the embedding rows (unless ``describe_only``).
        describe_only: put the fused embedding module on the meta device: it only
            describes the tables, for ``shard_model`` to build each rank's blocks (on
            the sharding env's device).
        static_counts: the ``static`` cache policy's sample counts
            (``build_embeddings``).

    Raises:
        ValueError: if the data's dense width differs from ``model.dlrm.num_dense``.
    """
    device = torch.device("cpu") if device is None else device
    if num_dense != config.model.dlrm.num_dense:
        raise ValueError(
            f"the data has {num_dense} dense features but model.dlrm.num_dense is "
            f"{config.model.dlrm.num_dense}"
        )
    torch.manual_seed(config.train.seed)  # the dense layers draw from the global RNG
    if describe_only:
        if config.model.embedding is not EmbeddingKind.FUSED:
            raise ValueError(
                f"sharded training needs model.embedding = 'fused' (it is "
                f"{config.model.embedding.value!r})"
            )
        from tetrarec.kernels import FusedEmbeddingBagCollection

        embeddings: nn.Module = FusedEmbeddingBagCollection(
            build_tables(config.model), config.optim.sparse, seed=config.train.seed, device="meta"
        )
    else:
        embeddings = build_embeddings(
            config, build_tables(config.model), static_counts, device=device
        )
    model = build_model(config.model.dlrm, embeddings)
    _dense_to(model, device)  # before the optimizers: their state follows the parameters
    dense_opt = build_dense_optimizer(config.optim, list(model.dense_parameters()))
    sparse_opt = embedding_optimizer(embeddings, config.optim.sparse)
    return RunParts(model=model, dense_optimizer=dense_opt, sparse_optimizer=sparse_opt)


def _dense_to(model: DLRM, device: torch.device) -> None:
    """Move every submodule of ``model`` but its embeddings to ``device``, in place.

    The embedding module is built where its rows belong (or on the meta device, to be
    sharded), so it is left alone, and so is any other module on the meta device (the
    first-order term's tables, to be sharded too): a meta module cannot be copied; the
    dense parts around it are moved.
    """

    def on_meta(module: nn.Module) -> bool:
        return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))

    def move(module: nn.Module) -> None:
        assert not list(module.parameters(recurse=False)), "weights live in submodules"
        assert not list(module.buffers(recurse=False)), "buffers live in submodules"
        for name, child in module.named_children():
            if module is model and name == "embeddings":
                continue
            if not on_meta(child):
                child.to(device)
            elif any(not t.is_meta for t in child.parameters()):
                move(child)  # dense parameters beside a meta collection (FirstOrder)

    move(model)
