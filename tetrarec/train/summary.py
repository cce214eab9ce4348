"""``TrainResult``: the summary of a run, as ``train`` returns, logs and writes it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetrarec import jsonio
from tetrarec.cache import CacheStats
from tetrarec.config import RunConfig
from tetrarec.data import BadLineSummary
from tetrarec.train.metrics import BestEval, Metrics

__all__ = ["TrainResult"]

# One logger for the whole run's log, named for the loop (users and tests filter on it).
logger = logging.getLogger("tetrarec.train.loop")


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """The summary of a run.

    Args:
        steps: steps done in total (including those before a resume).
        start_step: the step this process started from (0 unless resumed).
        samples_per_s: training samples per second in this process (evaluation and
            checkpoint time excluded).
        train_seconds: seconds spent in training steps in this process.
        final: metrics of the final evaluation (``None`` with no eval data).
        evals: ``(step, metrics)`` of every evaluation this process made, in order.
        checkpoint: the last checkpoint written, if any.
        best: with ``train.keep_best``, the best evaluation of the whole run (a
            resumed run's includes those before the resume; its ``metrics`` are
            ``None`` while no evaluation improved, every one ``nan``); ``None``
            without ``keep_best``.
        best_checkpoint: the checkpoint of the best evaluation (``<dir>/step_<n>``,
            also linked as ``<dir>/best``), if checkpoints are written.
        stopped_early: the run stopped at ``steps`` by ``train.early_stop_patience``,
            before the planned number of steps.
        cache: the cached tables' counters summed over this process's training steps
            (over every rank's shards when sharded); ``None`` without a cached table.
        bad_lines: the lines skipped (``data.on_bad_line = "skip"``) in the input files
            read, train and eval (``input_bad_lines``); ``None`` for a source that reads
            no lines (synthetic, parquet).
    """

    steps: int
    start_step: int
    samples_per_s: float
    train_seconds: float
    final: Metrics | None
    evals: tuple[tuple[int, Metrics], ...]
    checkpoint: str | None
    best: BestEval | None = None
    best_checkpoint: str | None = None
    stopped_early: bool = False
    cache: CacheStats | None = None
    bad_lines: BadLineSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the JSON summary."""
        best = self.best
        return {
            "steps": self.steps,
            "start_step": self.start_step,
            "samples_per_s": self.samples_per_s,
            "train_seconds": self.train_seconds,
            "final": self.final.to_dict() if self.final else None,
            "evals": [{"step": s, **m.to_dict()} for s, m in self.evals],
            "checkpoint": self.checkpoint,
            "best": None
            if best is None or best.metrics is None
            else {"metric": best.metric.value, "step": best.step, **best.metrics.to_dict()},
            "best_checkpoint": self.best_checkpoint,
            "stopped_early": self.stopped_early,
            "cache": None
            if self.cache is None
            else {
                "hit_rate": self.cache.hit_rate,
                "hits": self.cache.hits,
                "misses": self.cache.misses,
                "evictions": self.cache.evictions,
                "write_backs": self.cache.write_backs,
                "capacity": self.cache.capacity,
                "occupied": self.cache.occupied,
            },
            "bad_lines": None if self.bad_lines is None else self.bad_lines.to_dict(),
        }

    def best_summary(self) -> str | None:
        """One line on the best evaluation (``None`` without one)."""
        best = self.best
        if best is None or best.metrics is None:
            return None
        return f"best {best.metric.value} at step {best.step}: {best.metrics.summary()}"


def _log_summary(result: TrainResult, planned: int, patience: int) -> None:
    """The end of the run in the log: final and best metrics, an early stop, bad lines."""
    if result.final is not None:
        logger.info("final at step %d: %s", result.steps, result.final.summary())
    best = result.best_summary()
    if best is not None:
        where = f" ({result.best_checkpoint})" if result.best_checkpoint else ""
        logger.info("%s%s", best, where)
    elif result.best is not None and result.evals:
        logger.warning(
            "train.keep_best: no evaluation had a finite %s (an AUC needs both labels in "
            "the evaluation rows), so there is no best checkpoint",
            result.best.metric.value,
        )
    if result.stopped_early:
        logger.info(
            "stopped early at step %d of %d (train.early_stop_patience = %d)",
            result.steps,
            planned,
            patience,
        )
    if result.bad_lines is not None and result.bad_lines.skipped:
        logger.warning("input files: %s", result.bad_lines.summary())


def _write_json(path: str, result: TrainResult, config: RunConfig) -> None:
    payload = {**result.to_dict(), "config": config.to_dict()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(jsonio.dumps(payload, indent=2) + "\n")
    logger.info("wrote %s", path)
