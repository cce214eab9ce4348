"""``[train]``: how long a run trains, how often it evaluates and checkpoints, where.

Also where it trains (``DeviceKind``, resolved once by ``TrainConfig.resolve_device``)
and how many steps ``train.epochs`` makes (``TrainConfig.resolve_steps``).
"""

from __future__ import annotations

import enum
import fractions
import math
from dataclasses import dataclass

import torch

from tetrarec.data.config import expand_home

__all__ = ["DEFAULT_STEPS", "MAX_THREADS", "BestMetric", "DeviceKind", "TrainConfig"]


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
