"""``RunConfig``: everything one training run needs, as frozen typed sections.

A run is described by a TOML file whose tables mirror the sections::

    [data]            # tetrarec.data.DataConfig
    batch_size = 2048
    [data.synthetic]
    num_samples = 1_000_000

    [model]           # embedding settings, with the network in [model.dlrm]
    num_sparse = 26
    num_embeddings = 100_000          # or one value per table: [1000, 20000, ...]
    [model.dlrm]      # tetrarec.models.DLRMConfig
    bottom_mlp = [512, 256, 64]       # the last size is the embedding dim
    top_mlp = [512, 256, 1]

    [optim]           # dense optimizer and schedule
    dense = "adagrad"
    [optim.sparse]    # tetrarec.embedding.SparseOptimizerSpec
    kind = "rowwise_adagrad"

    [train]
    steps = 1000

Loading is strict: an unknown key is a ``ValueError`` that lists the valid keys of its
section, and each value is converted to its field's declared type (``int`` fields reject
``1.5``, enum fields take their string value).

Dotted overrides (``tetrarec train --set KEY=VALUE``) are merged into the file's values
before anything is validated (``RunConfig.from_toml(path, overrides)``), so a key that
the file leaves out can come from an override alone (a Parquet run's
``data.train_path``). Each value is read as a TOML value first, for every type::

    train.steps=10                       int          optim.dense_lr=1e-3      float
    train.deterministic=true             bool         optim.sparse.kind=adam   enum
    train.checkpoint_dir="out/ck"        str: out/ck (the quotes are TOML's, not the path's)
    train.checkpoint_dir=none            None, for a field that may be unset (also null)
    model.dlrm.bottom_mlp=[64, 16]       tuple        model.num_embeddings=1000 (int | tuple)
    data.train_path=["a.parquet", "b.parquet"]

and only when the TOML reading does not fit the field, as plain text: a bare string
(``train.checkpoint_dir=out/ck``, ``train.checkpoint_dir=123`` stays the string
``"123"``), or, for a list field, comma-separated items (``model.dlrm.top_mlp=64,1``,
``data.train_path=a.tsv,b.tsv``, or one bare path). To set a ``str | None`` field to
the text "none", quote it (``="none"``).

A float field also takes the strings ``"inf"`` and ``"-inf"`` (in the file, an override
or a dict): ``to_dict`` writes an infinity so, since JSON has no number for it and a
checkpoint's ``meta.json`` must give the config back (``tetrarec.jsonio``).
"""

from __future__ import annotations

import dataclasses
import enum
import fractions
import math
import re
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tetrarec import jsonio
from tetrarec.cache import CachePolicy, CacheSpec
from tetrarec.data.config import DataConfig, expand_home
from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.kernels.quant import SUPPORTED_PRECISIONS
from tetrarec.models import DLRMConfig
from tetrarec.types import OpenEnum, Placement, PoolingMode, Precision, ShardingType

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "DEFAULT_STEPS",
    "BestMetric",
    "CacheConfig",
    "DecayKind",
    "DenseOptimizerKind",
    "DeviceKind",
    "EmbeddingKind",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "ShardingConfig",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
]


class EmbeddingKind(enum.Enum):
    """Which embedding module a run builds."""

    REFERENCE = "reference"  # tetrarec.embedding.EmbeddingBagCollection + sparse optimizer
    FUSED = "fused"  # tetrarec.kernels.FusedEmbeddingBagCollection (update in backward)


class DenseOptimizerKind(enum.Enum):
    """The ``torch.optim`` optimizer of the dense (MLP) parameters."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAM = "adam"


class DecayKind(enum.Enum):
    """The learning-rate decay after warm-up (see ``tetrarec.train.schedule``)."""

    NONE = "none"
    LINEAR = "linear"
    COSINE = "cosine"


# `device` is not one of them: `host` already keeps every uncached row on train.device
# (device memory on a GPU), and `cached` / `ssd` cache the hot rows there.
_RUN_PLACEMENTS = (Placement.HOST, Placement.CACHED, Placement.SSD)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """``[model.cache]``: the FP32 caches of the tables placed ``cached`` or ``ssd``.

    Args:
        policy: ``lru``, ``lfu`` or ``static``. ``static`` pins each cached table's most
            frequent rows in the first ``static_sample_batches`` training batches (the
            trainer counts them with ``tetrarec.cache.count_ids`` before building the
            model; a sharded run counts the same global batches, each shard pinning
            its own rows' counts) and never admits another.
        fraction: slots per cached table as a fraction of its rows.
        bytes: or a budget for the slots (FP32 row + optimizer state) of all cached
            tables together.
        dir: where ``ssd`` tables put their memory-mapped files (default: the system's
            temporary directory).
        static_sample_batches: training batches the ``static`` policy counts (>= 1).

    Raises:
        ValueError: if ``static_sample_batches`` is below 1.
    """

    policy: CachePolicy = CachePolicy.LRU
    fraction: float | None = None
    bytes: int | None = None
    dir: str | None = None
    static_sample_batches: int = 100

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", expand_home(self.dir))
        if self.static_sample_batches < 1:
            raise ValueError(
                "model.cache.static_sample_batches must be >= 1 (training batches whose ids the "
                f"static policy counts), got {self.static_sample_batches}"
            )

    def spec(self) -> CacheSpec:
        """The library's ``CacheSpec`` of this section.

        Raises:
            ValueError: unless exactly one of ``fraction`` and ``bytes`` is set, in
                range.
        """
        return CacheSpec(
            policy=self.policy, fraction=self.fraction, bytes=self.bytes, directory=self.dir
        )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The embedding tables and the network.

    Args:
        num_sparse: sparse features, one table each (named ``C1``, ``C2``, ...).
        num_embeddings: rows per table: one value for all, or one per table.
        embedding: which embedding module to build.
        precision: row storage of the tables (the reference module takes FP32 only).
        pooling: how a bag's embeddings combine.
        placement: where each table's rows live, one value for all or one per table:
            ``host`` (on ``train.device``, no cache), ``cached`` (an FP32 cache of hot
            rows on ``train.device`` in front of the rows in ``precision`` in host
            memory) or ``ssd`` (the same, the rows in a memory-mapped file); ``cached``
            and ``ssd`` need ``embedding = "fused"`` and a size in ``[model.cache]``.
        cache: the caches' policy and size (``CacheConfig``).
        dlrm: the network (bottom MLP, interaction, top MLP). Its bottom MLP's last
            size is the dim of every table (``embedding_dim``), stated once.

    Raises:
        ValueError: on a non-positive size or a per-table list of the wrong length.
    """

    num_sparse: int = 26
    num_embeddings: int | tuple[int, ...] = 100_000
    embedding: EmbeddingKind = EmbeddingKind.FUSED
    precision: Precision = Precision.FP32
    pooling: PoolingMode = PoolingMode.SUM
    placement: Placement | tuple[Placement, ...] = Placement.HOST
    cache: CacheConfig = field(default_factory=CacheConfig)
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)

    def __post_init__(self) -> None:
        if self.num_sparse <= 0:
            raise ValueError(f"model.num_sparse must be positive, got {self.num_sparse}")
        rows = self.table_rows
        if len(rows) != self.num_sparse or min(rows) <= 0:
            raise ValueError(
                f"model.num_embeddings must be a positive int or {self.num_sparse} positive "
                f"ints (one per table), got {self.num_embeddings}"
            )
        if self.precision not in SUPPORTED_PRECISIONS:
            valid = ", ".join(p.value for p in SUPPORTED_PRECISIONS)
            raise ValueError(
                f"model.precision {self.precision.value!r} is not a row precision; valid: {valid}"
            )
        self._check_placement()

    def _check_placement(self) -> None:
        placements = self.table_placements
        valid = ", ".join(p.value for p in _RUN_PLACEMENTS)
        if len(placements) != self.num_sparse:
            raise ValueError(
                f"model.placement must be one placement or {self.num_sparse} (one per "
                f"table), got {len(placements)}; valid: {valid}"
            )
        bad = sorted({p.value for p in placements if p not in _RUN_PLACEMENTS})
        if bad:
            raise ValueError(
                f"model.placement {bad[0]!r} is not a run placement: 'host' keeps a "
                "table's rows on train.device (device memory on a GPU), 'cached' and 'ssd' "
                f"cache its hot rows there; valid: {valid}"
            )
        if any(p is not Placement.HOST for p in placements):
            if self.embedding is not EmbeddingKind.FUSED:
                raise ValueError(
                    "model.placement 'cached' and 'ssd' need model.embedding = 'fused' "
                    f"(it is {self.embedding.value!r})"
                )
            try:
                self.cache.spec()
            except ValueError as e:
                raise ValueError(f"model.{e}") from None

    @property
    def table_placements(self) -> tuple[Placement, ...]:
        """Placement of each table."""
        if isinstance(self.placement, Placement):
            return (self.placement,) * self.num_sparse
        return tuple(self.placement)

    @property
    def cached(self) -> bool:
        """Whether any table is cached (placement ``cached`` or ``ssd``)."""
        return any(p is not Placement.HOST for p in self.table_placements)

    @property
    def embedding_dim(self) -> int:
        """The dim of every table: the bottom MLP's output size."""
        return self.dlrm.embedding_dim

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each table."""
        if isinstance(self.num_embeddings, int):
            return (self.num_embeddings,) * self.num_sparse
        return tuple(self.num_embeddings)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Dense and sparse optimizers and the learning-rate schedule.

    Args:
        dense: the dense optimizer.
        dense_lr: its base learning rate.
        dense_eps: its epsilon (Adagrad, Adam).
        dense_weight_decay: its L2 penalty.
        sparse: the embedding optimizer (its ``lr`` is the sparse base learning rate).
        warmup_steps: steps of linear warm-up from ``1/warmup_steps`` to 1.
        decay: the decay shape after ``decay_start``.
        decay_start: the 0-based step where decay starts from the full rate: its scale
            is still 1 (``lr_scale``), so the first step with a lower rate is
            ``decay_start + 1``.
        decay_steps: steps from ``decay_start`` to ``min_lr_scale`` (first reached at
            step ``decay_start + decay_steps``).
        min_lr_scale: the final fraction of the base learning rates.

    Raises:
        ValueError: on negative settings.
    """

    dense: DenseOptimizerKind = DenseOptimizerKind.ADAGRAD
    dense_lr: float = 0.01
    dense_eps: float = 1e-8
    dense_weight_decay: float = 0.0
    sparse: SparseOptimizerSpec = field(default_factory=SparseOptimizerSpec)
    warmup_steps: int = 0
    decay: DecayKind = DecayKind.NONE
    decay_start: int = 0
    decay_steps: int = 0
    min_lr_scale: float = 0.0

    def __post_init__(self) -> None:
        bad = {
            k: getattr(self, k)
            for k in ("dense_lr", "dense_weight_decay", "warmup_steps", "decay_start")
            if not 0 <= getattr(self, k) < math.inf  # nan and inf too
        }
        if not 0 < self.dense_eps < math.inf:
            bad["dense_eps"] = self.dense_eps
        if self.decay is not DecayKind.NONE and self.decay_steps <= 0:
            bad["decay_steps"] = self.decay_steps
        if not 0.0 <= self.min_lr_scale <= 1.0:
            bad["min_lr_scale"] = self.min_lr_scale
        if bad:
            rules = {
                "dense_eps": "dense_eps > 0 and finite",
                "decay_steps": f"decay = {self.decay.value} needs decay_steps > 0",
                "min_lr_scale": "min_lr_scale in [0, 1]",
            }
            why = "; ".join(dict.fromkeys(rules.get(k, f"{k} >= 0") for k in bad))
            raise ValueError(f"bad optim settings {bad} ({why})")


DEFAULT_STEPS = 1000  # train.steps when neither steps nor epochs is set


class DeviceKind(enum.Enum):
    """Where a run trains (``train.device``); resolved once by ``TrainConfig.resolve_device``."""

    AUTO = "auto"  # cuda:LOCAL_RANK when torch sees a CUDA device, else the CPU
    CPU = "cpu"
    CUDA = "cuda"  # cuda:LOCAL_RANK; an error where torch sees no CUDA device


class BestMetric(enum.Enum):
    """The metric ``train.keep_best`` ranks evaluations by."""

    AUC = "auc"  # higher is better
    LOG_LOSS = "log_loss"  # lower is better

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger value of the metric is an improvement."""
        return self is BestMetric.AUC


# More intra-op threads than any machine has cores; beyond it torch fails to start them.
MAX_THREADS = 4096


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop: how long, how often to evaluate and checkpoint, where to write.

    Args:
        steps: total training steps (one global batch each). Set ``steps`` or
            ``epochs``, not both; with neither, the run makes ``DEFAULT_STEPS`` (1000).
        epochs: train for this many passes over the training rows instead (may be
            fractional): ``steps = ceil(epochs * (train rows // data.batch_size))``,
            where ``train rows // batch_size`` is the loader's batches per epoch (its
            last, partial batch is dropped). Resolved once the training data is known
            (``resolve_steps``) and logged.
        eval_every: evaluate every this many steps (0: only at the end).
        checkpoint_every: checkpoint every this many steps (0: only at the end).
        checkpoint_dir: where checkpoints go; ``None`` writes none.
        keep_checkpoints: how many of the newest checkpoints to keep (the best one,
            with ``keep_best``, is kept besides these).
        overwrite_checkpoints: a run started without ``--resume`` in a
            ``checkpoint_dir`` that already holds checkpoints deletes them (and its
            ``best`` link) first. Default ``False``: such a run is refused, naming the
            newest checkpoint, as pruning would mix the two runs' checkpoints.
        keep_best: ``"auc"`` (higher is better) or ``"log_loss"`` (lower is better):
            track the best evaluation by that metric. The summary reports its step and
            metrics next to the final ones; with ``checkpoint_dir``, each new best is
            checkpointed at its step and ``<checkpoint_dir>/best`` links to it (never
            pruned). A tie does not improve; a ``nan`` metric never improves. With
            ``eval_every = 0`` the only evaluation is the final one, which is the best.
        early_stop_patience: stop once this many consecutive evaluations have not
            improved on the best (0: never). Needs ``keep_best`` and ``eval_every > 0``.
        seed: seeds model init, data order, dropout and every RNG; 0 to 2**32 - 1
            (numpy's range).
        device: ``auto`` (``cuda:LOCAL_RANK`` where torch sees a CUDA device, else the
            CPU), ``cpu`` or ``cuda`` (``cuda:LOCAL_RANK``; an error without CUDA). The
            model, every batch and the evaluation run there; a sharded run communicates
            with NCCL on CUDA and gloo on the CPU. Checkpoints hold CPU tensors either
            way, so a run trained on one device resumes or evaluates on another.
        deterministic: run under ``torch.use_deterministic_algorithms(True)``.
        threads: torch intra-op threads (0: leave torch's default; at most
            ``MAX_THREADS``).
        log_every: log the loss every this many steps.
        json: write the run summary to this path.
        tensorboard_dir: write TensorBoard scalars here (needs ``tensorboard``).
        progress: show a progress bar on stderr.

    Raises:
        ValueError: on negative counts, both ``steps`` and ``epochs``, or early stopping
            without ``keep_best`` and ``eval_every``.
    """

    steps: int | None = None
    epochs: float | None = None
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 3
    overwrite_checkpoints: bool = False
    keep_best: BestMetric | None = None
    early_stop_patience: int = 0
    seed: int = 0
    device: DeviceKind = DeviceKind.AUTO
    deterministic: bool = False
    threads: int = 0
    log_every: int = 100
    json: str | None = None
    tensorboard_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("checkpoint_dir", "json", "tensorboard_dir"):
            object.__setattr__(self, name, expand_home(getattr(self, name)))
        counts = ("eval_every", "checkpoint_every", "threads", "log_every", "early_stop_patience")
        bad = {k: getattr(self, k) for k in counts if getattr(self, k) < 0}
        if self.threads > MAX_THREADS:
            bad["threads"] = self.threads
        if self.steps is not None and self.steps < 0:
            bad["steps"] = self.steps
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            bad["epochs"] = self.epochs
        if self.keep_checkpoints < 1:
            bad["keep_checkpoints"] = self.keep_checkpoints
        if not 0 <= self.seed < 2**32:
            bad["seed"] = self.seed
        if bad:
            raise ValueError(
                f"bad train settings {bad} (counts >= 0, epochs > 0, keep_checkpoints >= 1, "
                f"0 <= seed < 2**32, threads <= {MAX_THREADS})"
            )
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"set train.steps ({self.steps}) or train.epochs ({self.epochs}), not both "
                "(to switch with --set, clear the other: train.steps=none)"
            )
        if self.early_stop_patience and (self.keep_best is None or not self.eval_every):
            raise ValueError(
                f"train.early_stop_patience = {self.early_stop_patience} needs train.keep_best "
                f"(auc or log_loss; got {_value_or_none(self.keep_best)}) and "
                f"train.eval_every > 0 (got {self.eval_every}): it counts evaluations that "
                "did not improve the kept metric"
            )

    def resolve_device(self, local_rank: int = 0) -> torch.device:
        """The device this process trains on, from ``device`` and its launch's local rank.

        Called once when a run starts (never in a step). Checking CUDA here, not when
        the config is read, lets a machine without CUDA still read, plan and evaluate a
        config written for a GPU run (``tetrarec eval --set train.device=cpu``).

        Args:
            local_rank: this process's rank within its node (``LaunchInfo.local_rank``,
                torchrun's ``LOCAL_RANK``; 0 for one process): its GPU.

        Returns:
            ``cpu``, or ``cuda:<local_rank>``.

        Raises:
            ValueError: for ``device = "cuda"`` where torch sees no CUDA device, or a
                local rank without a GPU of its own.
        """
        if self.device is DeviceKind.CPU:
            return torch.device("cpu")
        available = torch.cuda.is_available()
        if self.device is DeviceKind.AUTO and not available:
            return torch.device("cpu")
        if not available:
            build = torch.version.cuda or "none (a CPU-only build)"
            raise ValueError(
                "train.device = 'cuda' but torch.cuda.is_available() is false here "
                f"(torch {torch.__version__}, CUDA build: {build}): use train.device = "
                "'cpu' or 'auto' (valid: auto, cpu, cuda), or run on a machine with a "
                "GPU and a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(
                f"train.device = {self.device.value!r}: local rank {local_rank} has no GPU of "
                f"its own ({count} visible): launch at most {count} processes per node "
                "(torchrun --nproc-per-node), or set train.device = 'cpu'"
            )
        return torch.device("cuda", local_rank)

    def resolve_steps(self, train_rows: int, batch_size: int) -> int:
        """The run's total steps, for ``train_rows`` training rows in global batches.

        Args:
            train_rows: rows of the training split.
            batch_size: the global batch size (``data.batch_size``).

        Returns:
            ``steps`` if set; else ``ceil(epochs * (train_rows // batch_size))`` (at
            least 1) if ``epochs`` is set; else ``DEFAULT_STEPS``.

        Raises:
            ValueError: with ``epochs``, if the rows make no full batch.
        """
        if self.steps is not None:
            return self.steps
        if self.epochs is None:
            return DEFAULT_STEPS
        per_epoch = train_rows // batch_size
        if per_epoch == 0:
            raise ValueError(
                f"train.epochs = {self.epochs}: {train_rows} training rows make no full "
                f"batch of data.batch_size = {batch_size}"
            )
        # The decimal the user wrote (0.1), not its binary neighbour (0.1000...0055),
        # so that 0.1 epoch of 30 batches is 3 steps, not 4.
        exact = fractions.Fraction(self.epochs).limit_denominator(10**6) * per_epoch
        return max(1, math.ceil(exact))


def _value_or_none(member: enum.Enum | None) -> str:
    return "none" if member is None else str(member.value)


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How the tables are placed when the run is launched on several ranks (torchrun).

    Args:
        type: one sharding type for every table, or one per table (``table_wise``,
            ``row_wise``, ``column_wise``, ``data_parallel``, ``table_row_wise``,
            ``table_column_wise``); tables are placed by type with bytes balanced over
            ranks (``tetrarec.sharding.plan_by_type``). Default (neither ``type`` nor
            ``plan``): the planner chooses (``tetrarec.planner``, on ``topology``).
        plan: a plan file (JSON, ``ShardingPlan.save``), instead of ``type``.
        column_block: column-wise block width (it must divide the tables' dim; default:
            one block per rank).
        local_world_size: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``);
            table-row-wise and table-column-wise tables stay inside one node.
        timeout_s: how long a collective may take before every rank stops with an error.
        topology: what the planner plans for when neither ``type`` nor ``plan`` is set:
            a preset name (``this-machine``, ``gpu-node-8``, ``zionex-16x8``) or a
            topology TOML file (``tetrarec bench calibrate --out``).
        stats: optional per-feature statistics for the planner (``tetrarec stats
            --json``); without them every feature has pooling 1 and uniform access.

    Raises:
        ValueError: if both ``type`` and ``plan`` are set, or on a bad number.
    """

    type: ShardingType | tuple[ShardingType, ...] | None = None
    plan: str | None = None
    column_block: int | None = None
    local_world_size: int = 0
    timeout_s: float = 300.0
    topology: str = "this-machine"
    stats: str | None = None

    def __post_init__(self) -> None:
        for name in ("plan", "stats"):
            object.__setattr__(self, name, expand_home(getattr(self, name)))
        if self.type is not None and self.plan is not None:
            raise ValueError(
                "set sharding.type or sharding.plan, not both (to use a plan with a config "
                "that sets a type: --set sharding.type=none)"
            )
        if (self.column_block is not None and self.column_block <= 0) or not (
            0 < self.timeout_s < math.inf
        ):
            raise ValueError(
                f"bad sharding settings: column_block={self.column_block}, "
                f"timeout_s={self.timeout_s}"
            )
        if self.local_world_size < 0:
            raise ValueError(f"sharding.local_world_size must be >= 0, got {self.local_world_size}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run: ``data``, ``model``, ``optim``, ``train`` and ``sharding`` sections."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)

    def __post_init__(self) -> None:
        # Checked with the config, as model.placement's list is, not first under torchrun.
        types = self.sharding.type
        if isinstance(types, tuple) and len(types) != self.model.num_sparse:
            raise ValueError(
                f"sharding.type must be one sharding type or {self.model.num_sparse} (one "
                f"per table), got {len(types)}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (enums as strings, tuples as lists, ``None`` left out)."""
        return _fields_to_dict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from a nested dict; missing keys take their defaults.

        Raises:
            ValueError: on an unknown key (listing the valid ones) or a bad value.
        """
        return config_from_dict(cls, values, "")

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
        """Load a TOML file, with dotted ``overrides`` merged in (see the module docstring).

        The overrides are applied to the file's values before anything is validated,
        so the merged config is what must be valid: a key the file leaves out may come
        from an override alone.

        Args:
            path: the run's TOML file.
            overrides: ``"section.key=value"`` items, applied in order.

        Raises:
            ValueError: on a TOML syntax error, a malformed override, an unknown key or
                a bad value (the message names the file), or a directory for ``path``.
            FileNotFoundError: if the file does not exist.
        """
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{path} is a directory; give the run's TOML file")
        try:
            values = tomllib.loads(path.read_text())
            _apply_overrides(values, overrides)
            return cls.from_dict(values)
        except (ValueError, TypeError) as e:
            with_sets = " with the --set overrides" if overrides else ""
            raise ValueError(f"{path}{with_sets}: {e}") from e

    def with_overrides(self, overrides: Sequence[str]) -> RunConfig:
        """Apply dotted ``"section.key=value"`` overrides, in order, then validate once.

        Raises:
            ValueError: on a malformed override, an unknown key (listing the valid
                ones) or a value of the wrong type.
        """
        values = self.to_dict()
        _apply_overrides(values, overrides)
        return RunConfig.from_dict(values)


def _apply_overrides(values: dict[str, Any], overrides: Sequence[str]) -> None:
    """Set each ``"section.key=value"`` of ``overrides`` in the nested dict ``values``.

    The value's text is parsed for the key's declared type (``_parse_text``); nothing is
    validated here beyond the key's existence: the caller builds the config once.

    Raises:
        ValueError: on a malformed override or an unknown key (listing the valid ones).
    """
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not of the form section.key=value")
        path = key.strip().split(".")
        hint = _field_type(RunConfig, path)
        node = values
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"override {item!r}: {'.'.join(path[: i + 1])} must be a section, got {child!r}"
                )
            node = child
        node[path[-1]] = _parse_text(text.strip(), hint, key.strip())


# --- generic conversion between frozen dataclasses and plain dicts ---------------------


_T = TypeVar("_T", bound="DataclassInstance")


def config_to_dict(obj: Any) -> Any:
    """Convert a config dataclass (recursively) into TOML- and JSON-compatible plain values.

    An infinite float becomes ``"inf"``/``"-inf"`` (JSON has no number for it), which
    ``config_from_dict`` reads back as the float.
    """
    if isinstance(obj, float):
        return jsonio.inf_text(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _fields_to_dict(obj)
    if isinstance(obj, enum.Enum | OpenEnum):  # OpenEnum: ShardingType
        return obj.value
    if isinstance(obj, tuple | list):
        return [config_to_dict(v) for v in obj]
    return obj


def _fields_to_dict(obj: DataclassInstance) -> dict[str, Any]:
    """``config_to_dict`` of one dataclass instance: its fields, ``None`` left out."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is not None:
            out[f.name] = config_to_dict(value)
    return out


def config_from_dict(cls: type[_T], values: Any, where: str) -> _T:
    """Build dataclass ``cls`` from ``values``, strictly (``where`` names the section).

    Raises:
        ValueError: on an unknown key (listing the valid ones) or a bad value.
    """
    if not isinstance(values, dict):
        raise ValueError(f"{where or 'config'} must be a table, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(values) - set(names))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(
            f"unknown config key {prefix}{unknown[0]}; valid keys of "
            f"{where or 'the top level'}: {', '.join(names)}"
        )
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}" if where else k) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if where and str(e).startswith(f"{where}."):  # it names its key already
            raise ValueError(str(e)) from e
        raise ValueError(f"{where or 'config'}: {e}") from e


def _convert(hint: Any, value: Any, where: str) -> Any:
    """Convert ``value`` to the type ``hint`` (see ``config_from_dict``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        if value is None and type(None) in arms:
            return None
        errors: dict[Any, str] = {}
        for arm in (a for a in arms if a is not type(None)):
            try:
                return _convert(arm, value, where)
            except ValueError as e:
                errors[arm] = str(e)
        # Name only the arms of the value's shape: "'foo' is not one of host, ..." for
        # an ``enum | tuple[enum, ...]`` field given one bad name, not also "expected
        # a list".
        is_list = isinstance(value, list | tuple)
        shaped = [e for a, e in errors.items() if (typing.get_origin(a) is tuple) == is_list]
        raise ValueError(" / ".join(shaped or errors.values()))
    if origin is tuple:
        return _convert_tuple(typing.get_args(hint), value, where)
    section = _dataclass_of(hint)
    if section is not None:
        return config_from_dict(section, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum | OpenEnum):
        if isinstance(value, hint):
            return value
        valid = ", ".join(str(m.value) for m in hint)
        if isinstance(value, str):
            for member in hint:
                if str(member.value) == value.lower():
                    return member
        raise ValueError(f"{where}: {value!r} is not one of {valid}")
    return _convert_scalar(hint, value, where)


def _convert_tuple(args: tuple[Any, ...], value: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: expected a list, got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if len(args) != len(value):
        raise ValueError(f"{where}: expected {len(args)} values, got {list(value)}")
    return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


_SCALARS: dict[type, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (int, float),
    str: (str,),
}


def _convert_scalar(hint: Any, value: Any, where: str) -> Any:
    accepted = _SCALARS.get(hint)
    if hint is float:  # "inf"/"-inf": an infinity as config_to_dict writes it for JSON
        value = jsonio.parse_inf(value)
    if accepted is None:
        raise TypeError(f"{where}: unsupported config field type {hint!r}")
    # bool is an int subclass: an int field must not take True, nor a bool field 1.
    if isinstance(value, bool) != (hint is bool) or not isinstance(value, accepted):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    return hint(value)


def _field_type(cls: type, path: list[str]) -> Any:
    """The declared type of dotted ``path`` under dataclass ``cls``.

    Raises:
        ValueError: on an unknown key (listing the valid ones) or a path that stops at
            a section.
    """
    hint: Any = cls
    for i, part in enumerate(path):
        sub = _dataclass_of(hint)
        where = ".".join(path[:i]) or "the top level"
        if sub is None:
            raise ValueError(f"{'.'.join(path[:i])} is a value, not a section")
        names = [f.name for f in dataclasses.fields(sub) if f.init]
        if part not in names:
            raise ValueError(
                f"unknown config key {'.'.join(path[: i + 1])}; valid keys of {where}: "
                f"{', '.join(names)}"
            )
        hint = typing.get_type_hints(sub)[part]
    if _dataclass_of(hint) is not None:
        raise ValueError(f"{'.'.join(path)} is a section; set one of its keys")
    return hint


def _dataclass_of(hint: Any) -> type[DataclassInstance] | None:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    return None


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _parse_text(text: str, hint: Any, where: str) -> Any:
    """Parse an override's text for the field ``where`` of type ``hint``.

    The first reading that converts to the field's type wins, in this order:

    1. ``none`` or ``null`` (any case) for a field that may be ``None``, and for a list
       field the empty list (so does an empty text: ``data.eval_path=none``,
       ``data.dense_columns=``);
    2. the text as a TOML value (``10``, ``1e-3``, ``true``, ``[64, 16]``, ``"out/ck"``);
       a TOML string for a list field is a one-item list;
    3. for a float field, a decimal TOML refuses (``.5``, ``5.``); then the bare text
       (``out/ck``, ``adam``, or ``123`` for a ``str`` field);
    4. for a list field, comma-separated items (``64,16``), each parsed the same way.

    When none converts, the TOML reading (else the bare text; for a list field written
    ``[a, b]``, its items) is returned, so that the conversion's error names the value
    as TOML read it, or the bad item.
    """
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    arms = typing.get_args(hint) if union else (hint,)
    if text.lower() in ("none", "null"):
        if type(None) in arms:
            return None
        if typing.get_origin(hint) is tuple:  # a list field: none is the empty list
            return []
    if not text.strip() and typing.get_origin(hint) is tuple:  # data.dense_columns=
        return []
    candidates: list[Any] = []
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    else:
        candidates.append(value)
        if isinstance(value, str):
            candidates.append([value])
    if float in arms and _DECIMAL.fullmatch(text):  # ".5" and "5." are not TOML floats
        candidates.append(float(text))
    candidates.append(text)
    listed = None
    for arm in arms:
        if typing.get_origin(arm) is tuple:
            item = typing.get_args(arm)[0]
            bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            items = [t.strip() for t in bare.split(",")]
            listed = [_parse_text(t, item, f"{where}[{i}]") for i, t in enumerate(items)]
            candidates.append(listed)
            break
    for candidate in candidates:
        try:
            _convert(hint, candidate, where)
        except (ValueError, TypeError):
            continue
        return candidate
    if listed is not None and text.startswith("["):  # "[host, foo]": name the bad item
        return listed
    return candidates[0]
