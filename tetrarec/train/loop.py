"""The training loop: steps, schedule, evaluation, checkpoints, progress and summary.

One call, ``train(config)``, does a whole run::

    1. build data, model and optimizers from the config (seeded by train.seed)
    2. with resume: restore the newest checkpoint (weights, optimizer states, RNGs,
       the data position) so the run continues bitwise as if never interrupted
    3. for each step: set the scheduled learning rates, forward, BCE loss, stop on a
       non-finite loss (before backward, so no bad update is ever applied), backward,
       optimizer steps (a fused embedding module updates itself in backward)
    4. every eval_every steps and at the end: exact metrics on the eval split (a
       warning when calibration is outside ``CALIBRATION_BOUNDS``); with
       train.keep_best, the best evaluation so far is tracked (``BestEval``), each new
       best is checkpointed and linked as ``<checkpoint_dir>/best``, and with
       train.early_stop_patience the run stops after that many evaluations in a row
       without improvement (the evaluation that decides is the run's final one)
    5. every checkpoint_every steps and at the end: an atomic checkpoint (its meta
       holds the best-so-far state, so a resumed run keeps the same best)
    6. a summary (``TrainResult``: final and best metrics, whether it stopped early),
       also written as JSON when train.json is set

The number of steps is ``train.steps``, or ``train.epochs`` passes over the training
rows (``TrainConfig.resolve_steps``), resolved once the training data is built.

The summary (``TrainResult``, its log lines and JSON) is ``train.summary``; the
process settings and path checks around a run (device, threads, deterministic mode,
TensorBoard, a fresh run's checkpoint directory) are ``train.runtime``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # torch's convention
from tqdm import tqdm

from tetrarec.cache import CacheStats
from tetrarec.comm import LaunchInfo, destroy, is_joined
from tetrarec.config import RunConfig
from tetrarec.data import BatchLoader, input_bad_lines
from tetrarec.kernels import build_cpu_kernels
from tetrarec.sparse import Batch
from tetrarec.train.build import (
    RunParts,
    build_parts,
    held_tables,
    model_embeddings,
)
from tetrarec.train.checkpoint import (
    best_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    mark_best,
    prune_checkpoints,
    read_meta,
)
from tetrarec.train.distributed import (
    check_sharding_settings,
    run_datasets,
    sharded_parts,
    sharding_env,
)
from tetrarec.train.evaluate import evaluate
from tetrarec.train.metrics import BestEval, Metrics, miscalibration
from tetrarec.train.optim import set_learning_rate
from tetrarec.train.runtime import (
    _check_paths,
    _clear_for_fresh_run,
    _run_device,
    _runtime,
    _summary_writer_class,
)
from tetrarec.train.schedule import lr_scale
from tetrarec.train.state import (
    check_same_cache,
    load_run_state,
    restore_dense_transform,
    save_run_state,
    verify_run_checkpoint,
)
from tetrarec.train.static_cache import log_pinned, pinned_rows, sample_counts
from tetrarec.train.summary import TrainResult, _log_summary, _write_json

__all__ = ["NonFiniteLossError", "TrainResult", "TrainingStoppedError", "train"]

logger = logging.getLogger(__name__)


class TrainingStoppedError(Exception):
    """The run was asked to stop (``train``'s ``stop``: SIGTERM in the CLI).

    It stopped after a whole step, which every rank agreed on, and checkpointed it.

    Attributes:
        step: the last step trained.
        checkpoint: the checkpoint of that step (``None`` without ``checkpoint_dir``).
    """

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint_dir: nothing saved"
        super().__init__(f"stopped after step {step}; {where}")
        self.step = step
        self.checkpoint = checkpoint


class NonFiniteLossError(RuntimeError):
    """The loss of a step was nan or inf; training stopped before applying it.

    Attributes:
        step: the 1-based number of the failed step.
        checkpoint: the newest checkpoint (written before the failure), if any.
    """

    def __init__(self, step: int, loss: float, checkpoint: Path | None) -> None:
        where = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(f"non-finite loss ({loss}) at step {step}; training stopped; {where}")
        self.step = step
        self.checkpoint = checkpoint


def train(
    config: RunConfig,
    *,
    resume: bool = False,
    launch: LaunchInfo | None = None,
    stop: threading.Event | None = None,
) -> TrainResult:
    """Run the training ``config`` describes (see the module docstring).

    Args:
        config: the run.
        resume: continue from the newest complete checkpoint in
            ``train.checkpoint_dir`` (verified against its manifest first); with none
            there yet (a run that died before its first checkpoint), start from step 0
            and log so.
        launch: where this process sits in a ``torchrun`` launch (read from the
            environment once, by the caller); several ranks train sharded
            (``tetrarec.train.distributed``). Default: one process.
        stop: set (from a signal handler, another thread) to stop the run after the
            step it is in, with a checkpoint of that step: under torchrun the ranks
            agree on the step through the loss's all-reduce (no extra collective).

    Returns:
        The run's summary.

    Raises:
        NonFiniteLossError: if a step's loss is not finite (naming the step).
        TrainingStoppedError: after ``stop`` was set, once the step's checkpoint is written.
        ValueError: on a bad configuration, ``resume`` without a
            ``train.checkpoint_dir``, a missing or damaged checkpoint file (naming it),
            or a fresh run whose ``checkpoint_dir`` holds checkpoints (unless
            ``train.overwrite_checkpoints``).
    """
    launch = launch or LaunchInfo()
    _check_paths(config)
    if not resume:
        _clear_for_fresh_run(config.train, launch.rank)
    # A process group this call joins, it leaves; one its caller joined, it leaves alone.
    owns_group = launch.distributed and not is_joined()
    with _runtime(config.train):
        try:
            run = _Run(config, launch, stop)
        except BaseException:
            if owns_group:
                destroy()
            raise
        run.owns_group = owns_group
        try:
            if resume:
                run.resume()
            result = run.run()
        except BaseException:
            run.close(completed=False)  # other ranks may be gone: no barrier
            raise
        run.close(completed=True)
        return result


class _Run:
    """The state of one ``train`` call; one method per phase of the loop."""

    def __init__(
        self, config: RunConfig, launch: LaunchInfo, stop: threading.Event | None = None
    ) -> None:
        self.config = config
        self.stop = stop
        self.stopping = False  # every rank agreed to stop after this step
        writer = _summary_writer_class(config.train)  # every rank: fails them all alike
        # Every RNG starts from train.seed; a resume then restores the saved states.
        random.seed(config.train.seed)
        np.random.seed(config.train.seed)
        torch.manual_seed(config.train.seed)
        # Where everything trains, resolved once (LOCAL_RANK picks this process's GPU).
        self.device = _run_device(config.train, launch)
        if launch.rank == 0:
            logger.info("training on %s", self.device)
        if self.device.type == "cuda":
            # Work torch places on "the current GPU" (cuBLAS handles, generators) goes
            # to this process's GPU, not GPU 0.
            torch.cuda.set_device(self.device)
        if self.device.type == "cuda" and config.train.deterministic:
            # cuBLAS is deterministic only with a fixed workspace, read when its first
            # handle is made (torch's deterministic mode raises otherwise): set it before
            # the first product, unless the user chose one.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.env = sharding_env(config, launch, self.device) if launch.distributed else None
        if self.env is None and (config.sharding.type or config.sharding.plan):
            check_sharding_settings(config)
            logger.info("one process: the [sharding] section applies to torchrun launches")
        self.rank, self.world = (self.env.rank, self.env.world_size) if self.env else (0, 1)
        self.train_ds, self.eval_ds = run_datasets(config, self.env)
        self.bad_lines = input_bad_lines(config.data, self.train_ds, self.eval_ds)
        counts = sample_counts(config, self.train_ds, self.env)  # static cache policy only
        if self.env is not None:
            self.parts: RunParts = sharded_parts(
                config, self.env, num_dense=self.train_ds.num_dense, static_counts=counts
            )
        else:
            self.parts = build_parts(
                config, num_dense=self.train_ds.num_dense, device=self.device, static_counts=counts
            )
        if counts is not None:
            self._log_pinned(counts)
        names = tuple(model_embeddings(self.parts.model).feature_names)
        if tuple(self.train_ds.keys) != names:
            raise ValueError(
                f"the data's features {self.train_ds.keys} differ from the model's {names}"
            )
        tc = config.train
        self.total_steps = tc.resolve_steps(self.train_ds.num_samples, config.data.batch_size)
        if tc.epochs is not None and self.rank == 0:
            logger.info(
                "train.epochs = %g: %d steps of %d rows over %d training rows",
                tc.epochs,
                self.total_steps,
                config.data.batch_size,
                self.train_ds.num_samples,
            )
        self.step = 0
        self.start_step = 0
        self.last_checkpoint: Path | None = None
        self.evals: list[tuple[int, Metrics]] = []
        self.best = BestEval(metric=tc.keep_best) if tc.keep_best is not None else None
        self.best_path: Path | None = None
        self.stopped_early = False
        self.cache_seen: CacheStats | None = None  # cache counters at the last log
        self.cache_start: CacheStats | None = None  # ... when this process started
        self._cached_anywhere: bool | None = None  # any rank's cached tables (_cache_total)
        self.loader: BatchLoader | None = None
        self.owns_group = False  # set by train()
        self.writer = (  # last
            writer(config.train.tensorboard_dir) if writer is not None and self.rank == 0 else None
        )

    def _log_pinned(self, counts: dict[str, torch.Tensor]) -> None:
        """Each cached table's (shard's) pinned rows and the sample share they serve."""
        pinned = pinned_rows(self.parts.model.get_submodule("embeddings"), counts)
        sample = self.config.model.cache.static_sample_batches
        log_pinned(pinned, sample, self.rank if self.env is not None else None)

    def resume(self) -> None:
        root = self.config.train.checkpoint_dir
        if not root:
            raise ValueError("resume: train.checkpoint_dir is not set: there is nothing to resume")
        path = latest_checkpoint(root)
        if path is None:
            # A run that died before its first checkpoint (or in the middle of writing
            # it: a temporary directory is no checkpoint) restarts; the next checkpoint
            # written removes what the crash left.
            if self.rank == 0:
                logger.info("resume: no complete checkpoint in %s yet; starting from step 0", root)
            return
        verify_run_checkpoint(path, self.parts)  # every rank, before anything is read
        meta = read_meta(path)
        saved = meta.get("config", {}).get("data", {}).get("batch_size")
        if saved is not None and saved != self.config.data.batch_size:
            raise ValueError(
                f"resume: {path} was trained with data.batch_size={saved}, this run has "
                f"{self.config.data.batch_size}: its data position counts batches of {saved}, "
                "so resume with that batch size (or start a new run)"
            )
        check_same_cache(
            path,
            meta.get("config", {}).get("model", {}),
            self.config.model,
            doing="resume",
            advice="resume with the same [model.cache] settings (or start a new run)",
        )
        self._check_same_optimizers(path, meta.get("config", {}).get("optim", {}))
        self.step, position = load_run_state(path, self.parts, verify=False)
        self.train_ds, self.eval_ds = restore_dense_transform(path, self.train_ds, self.eval_ds)
        if position != self.step:
            raise ValueError(f"{path}: data position {position} differs from step {self.step}")
        if self.step > self.total_steps:
            tc = self.config.train
            via = f" (train.epochs={tc.epochs})" if tc.epochs is not None else ""
            raise ValueError(
                f"resume: {path} is at step {self.step}, past train.steps={self.total_steps}{via}"
            )
        self.start_step = self.step
        self.last_checkpoint = path
        self._resume_best(path, meta.get("best"))
        logger.info("resumed from %s at step %d", path, self.step)

    def _check_same_optimizers(self, path: Path, saved: dict[str, Any]) -> None:
        """Refuse a resume whose optimizers are of other kinds than the saved ones.

        A checkpoint holds each optimizer's state in its kind's layout (Adagrad's sums,
        Adam's moments, none for SGD): loaded into another kind it failed at the first
        step (``KeyError: 'exp_avg'``) or was silently dropped. Settings (learning
        rates, weight decay, eps) may change. ``saved``: the checkpoint's optim config.
        """
        mine = self.config.optim
        for key, was, now in (
            ("optim.dense", saved.get("dense"), mine.dense.value),
            ("optim.sparse.kind", saved.get("sparse", {}).get("kind"), mine.sparse.kind.value),
        ):
            if was is not None and was != now:
                raise ValueError(
                    f"resume: {path} was trained with {key}={was!r}, this run has {now!r}: "
                    f"its optimizer state is that optimizer's, so resume with {key}={was!r} "
                    "(or start a new run)"
                )

    def _resume_best(self, path: Path, saved: dict[str, Any] | None) -> None:
        """Take the best-so-far state ``saved`` in the checkpoint's meta (same metric only)."""
        if self.best is None:
            return
        if saved is None or saved["metric"] != self.best.metric.value:
            logger.info(
                "resume: %s holds no best %s so far; tracking it from here",
                path,
                self.best.metric.value,
            )
            return
        self.best = BestEval.from_dict(saved)
        root = path.parent
        # No evaluation had a finite metric yet (every one nan): no best step to find.
        name = None if self.best.step is None else f"step_{self.best.step:08d}"
        kept = [p for p in list_checkpoints(root) if p.name == name]
        if kept:
            self.best_path = kept[0]
            linked = best_checkpoint(root)
            # A crash between a best's checkpoint and its link leaves the link behind.
            if self.rank == 0 and (linked is None or linked.name != kept[0].name):
                mark_best(kept[0])
        if self._out_of_patience():
            self.stopped_early = True  # the interrupted run had stopped here
            logger.info("resume: the run stopped early at step %d; no step to make", self.step)

    def run(self) -> TrainResult:
        tc, dc = self.config.train, self.config.data
        self.cache_seen = self._cache_total()  # counters restored by a resume excluded
        self.cache_start = self.cache_seen
        self._warn_empty_caches()
        self.loader = BatchLoader(
            self.train_ds,
            batch_size=dc.batch_size,
            rank=self.rank,
            world_size=self.world,
            shuffle=dc.shuffle,
            seed=tc.seed,
            prefetch=dc.prefetch,
            start_batch=self.step,
        )
        batches = iter(self.loader)
        bar = tqdm(
            total=self.total_steps * dc.batch_size,
            initial=min(self.step, self.total_steps) * dc.batch_size,
            unit="sample",
            unit_scale=True,
            file=sys.stderr,
            disable=not tc.progress or self.rank != 0,
            dynamic_ncols=True,
        )
        # The compiled kernels build (or load from the cache) on first use: do it here,
        # before the clock starts, so that samples_per_s never includes a compile. A
        # CUDA run never calls them (its tensors take the portable path).
        if self.device.type == "cpu":
            build_cpu_kernels()
        seconds = 0.0
        with bar:
            while self.step < self.total_steps and not self.stopped_early:
                t0 = time.perf_counter()
                loss = self._train_step(next(batches))
                seconds += time.perf_counter() - t0
                bar.update(dc.batch_size)
                self._after_step(loss, bar)
                if self.stopping:
                    if tc.checkpoint_dir and not self._saved_now():
                        self._checkpoint()
                    raise TrainingStoppedError(
                        self.step, self.last_checkpoint if tc.checkpoint_dir else None
                    )
        if not self.evals or self.evals[-1][0] != self.step:
            self._evaluate()
        if tc.checkpoint_dir and not self._saved_now():
            self._checkpoint()
        done = (self.step - self.start_step) * dc.batch_size
        result = TrainResult(
            steps=self.step,
            start_step=self.start_step,
            samples_per_s=done / seconds if seconds > 0 else 0.0,
            train_seconds=seconds,
            final=self.evals[-1][1] if self.evals else None,
            evals=tuple(self.evals),
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            best=self.best,
            best_checkpoint=str(self.best_path) if self.best_path else None,
            stopped_early=self.stopped_early,
            cache=self._cache_since(self.cache_start, self._cache_total()),
            bad_lines=self.bad_lines,
        )
        if self.rank == 0:
            _log_summary(result, self.total_steps, tc.early_stop_patience)
        if tc.json and self.rank == 0:
            _write_json(tc.json, result, self.config)
        return result

    def _saved_now(self) -> bool:
        """Whether the last checkpoint written is of the current step."""
        if self.last_checkpoint is None:
            return False
        return int(self.last_checkpoint.name.split("_")[-1]) == self.step

    def _train_step(self, batch: Batch) -> float:
        parts, optim = self.parts, self.config.optim
        scale = lr_scale(self.step, optim)
        set_learning_rate(parts.dense_optimizer, optim.dense_lr * scale)
        set_learning_rate(parts.sparse_optimizer, optim.sparse.lr * scale)
        batch = batch.to(self.device)  # the same tensors when the run is on the CPU
        logits = parts.step_model(batch.dense, batch.sparse)  # (B,)
        # This rank's share of the global batch's mean loss: summed over ranks (the
        # dense gradients are summed, the tables' gradients go to their owners), it is
        # exactly one process's loss over the global batch.
        loss = (
            F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
            / self.config.data.batch_size
        )
        value = self._global_loss(loss.detach())
        if not math.isfinite(value):
            # Checked before backward: a fused module would apply the bad update there.
            raise NonFiniteLossError(self.step + 1, value, self.last_checkpoint)
        parts.backward_and_step(loss)
        self.step += 1
        return value

    def _global_loss(self, share: torch.Tensor) -> float:
        """The global batch's loss (the same on every rank, so all stop on a bad one).

        It carries each rank's stop request too (``stop``), summed in the same
        all-reduce: every rank learns in the same step that one was asked to stop
        (``stopping``), so they all checkpoint that step.
        """
        asked = self.stop is not None and self.stop.is_set()
        if self.env is None:
            self.stopping = asked
            return float(share)
        flag = share.new_tensor([1.0 if asked else 0.0])
        both = self.env.comm.all_reduce(torch.cat([share.reshape(1), flag]), label="loss")
        loss, requests = both.wait().tolist()
        self.stopping = requests > 0
        return float(loss)

    def _after_step(self, loss: float, bar: tqdm[Any]) -> None:
        tc = self.config.train
        if self.writer is not None:
            self.writer.add_scalar("train/loss", loss, self.step)
            self.writer.add_scalar(
                "train/lr_scale", lr_scale(self.step - 1, self.config.optim), self.step
            )
        if tc.log_every and self.step % tc.log_every == 0:
            cache = self._cache_interval()  # every rank: summed over the ranks' caches
            if self.rank == 0:
                if cache is None:
                    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                    logger.info("step %d/%d loss %.5f", self.step, self.total_steps, loss)
                else:
                    bar.set_postfix(loss=f"{loss:.4f}", hit=f"{cache.hit_rate:.3f}", refresh=False)
                    logger.info(
                        "step %d/%d loss %.5f cache hit rate %.4f evictions %d write-backs %d",
                        self.step,
                        self.total_steps,
                        loss,
                        cache.hit_rate,
                        cache.evictions,
                        cache.write_backs,
                    )
                    if self.writer is not None:
                        self.writer.add_scalar("cache/hit_rate", cache.hit_rate, self.step)
                        self.writer.add_scalar("cache/evictions", cache.evictions, self.step)
        # The last step's evaluation and checkpoint are the run's final ones (run()).
        if self.step >= self.total_steps:
            return
        if tc.eval_every and self.step % tc.eval_every == 0:
            self._evaluate()
            if self.stopped_early:
                return  # run() checkpoints this step as the final one
        if (
            tc.checkpoint_dir
            and tc.checkpoint_every
            and self.step % tc.checkpoint_every == 0
            and not self._saved_now()  # a new best was just checkpointed here
        ):
            self._checkpoint()

    def _cache_stats(self) -> dict[str, CacheStats]:
        """``{table: counters}`` of the cached tables (this rank's shards); ``{}`` if none."""
        stats = getattr(self.parts.model.get_submodule("embeddings"), "cache_stats", None)
        return stats() if callable(stats) else {}

    def _warn_empty_caches(self) -> None:
        """Say which cached tables got no slot (a fraction or budget too small for them)."""
        empty = sorted(n for n, s in self._cache_stats().items() if not s.capacity)
        if empty:
            mc = self.config.model.cache
            size = f"fraction={mc.fraction}" if mc.fraction is not None else f"bytes={mc.bytes}"
            where = "" if self.env is None else f"rank {self.rank}: "
            logger.warning(
                "%scached tables with no cache slot (model.cache.%s is under one slot for "
                "their rows): %s train as uncached tables",
                where,
                size,
                ", ".join(empty),
            )

    def _cache_total(self) -> CacheStats | None:
        """All cached tables' counters summed, or ``None`` without a cached table.

        Sharded: summed over every rank's cached shards (a collective: every rank calls
        it at the same steps), so that rank 0, which logs them, counts the shards it does
        not hold, each table's lookups once (``counted_cache_stats``: one replica of a
        data-parallel table, one column block); the first call finds out whether any
        rank has one, and later calls skip the collective when none does.
        """
        embeddings = held_tables(self.parts.model.get_submodule("embeddings"))
        tables = embeddings.counted_cache_stats()  # each table's lookups once
        mine = CacheStats.total(tables.values()) if tables else None
        if self.env is None or self.world == 1 or self._cached_anywhere is False:
            return mine
        fields = ("capacity", "occupied", "hits", "misses", "evictions", "write_backs")
        local = [int(mine is not None), *(getattr(mine, f) if mine else 0 for f in fields)]
        summed = self.env.comm.all_reduce(
            torch.tensor(local, dtype=torch.int64, device=self.device), label="cache_stats"
        ).wait()
        values = [int(v) for v in summed.tolist()]
        self._cached_anywhere = values[0] > 0
        if not self._cached_anywhere:
            return None
        return CacheStats(table="*", **dict(zip(fields, values[1:])))

    def _cache_interval(self) -> CacheStats | None:
        """The cache counters since the last log (hit rate of this interval)."""
        now, before = self._cache_total(), self.cache_seen
        self.cache_seen = now
        return self._cache_since(before, now)

    def _cache_since(self, before: CacheStats | None, now: CacheStats | None) -> CacheStats | None:
        """The counters ``now``, less ``before``'s (capacity and occupancy: now's)."""
        if now is None or before is None:
            return now
        return dataclasses.replace(
            now,
            hits=now.hits - before.hits,
            misses=now.misses - before.misses,
            evictions=now.evictions - before.evictions,
            write_backs=now.write_backs - before.write_backs,
        )

    def _evaluate(self) -> None:
        if self.eval_ds is None or self.eval_ds.num_samples == 0:
            if self.best is not None and self.rank == 0 and not self.evals:
                logger.warning("train.keep_best is set but the run has no evaluation data")
            return
        metrics = evaluate(
            self.parts.model,
            self.eval_ds,
            batch_size=self.config.data.eval_batch_size,
            comm=self.env.comm if self.env else None,
            device=self.device,
        )
        self.evals.append((self.step, metrics))
        if self.rank == 0:
            logger.info("eval at step %d: %s", self.step, metrics.summary())
            note = miscalibration(metrics)
            if note is not None:
                logger.warning("eval at step %d: miscalibrated: %s", self.step, note)
        if self.writer is not None:
            for name, value in metrics.to_dict().items():
                self.writer.add_scalar(f"eval/{name}", value, self.step)
        if self.best is not None:
            self._track_best(metrics)

    def _track_best(self, metrics: Metrics) -> None:
        """Update the best-so-far; checkpoint a new best; decide on early stopping.

        Every rank holds the same metrics, so every rank decides the same (the
        checkpoint is collective in a sharded run).
        """
        assert self.best is not None
        before = self.best
        self.best = before.update(self.step, metrics)
        if self.best is before:  # this step's evaluation was counted already
            return
        tc = self.config.train
        name = self.best.metric.value
        if self.best.step == self.step:
            if self.rank == 0:
                logger.info(
                    "new best %s %.5f at step %d", name, self.best.value(metrics), self.step
                )
            if tc.checkpoint_dir:
                self._checkpoint()
                assert self.last_checkpoint is not None
                if self.rank == 0:
                    mark_best(self.last_checkpoint)
                    # The previous best is no longer protected: prune it unless newest.
                    prune_checkpoints(tc.checkpoint_dir, tc.keep_checkpoints)
                self.best_path = self.last_checkpoint
            return
        if self.rank == 0 and self.best.step is None:
            logger.info("no evaluation with a finite %s yet (%d so far)", name, self.best.since)
        elif self.rank == 0:
            logger.info(
                "no improvement on the best %s (step %d) for %d evaluation(s)",
                name,
                self.best.step,
                self.best.since,
            )
        if self._out_of_patience():
            self.stopped_early = True
            if self.rank == 0:
                logger.info(
                    "stopping early at step %d: %d evaluations without improvement "
                    "(train.early_stop_patience)",
                    self.step,
                    self.best.since,
                )

    def _out_of_patience(self) -> bool:
        """Whether ``train.early_stop_patience`` stops the run here, before the last step.

        At the last planned step the run ends anyway: it did not stop early, even if
        that step's evaluation was the ``patience``-th without improvement.
        """
        patience = self.config.train.early_stop_patience
        assert self.best is not None
        return bool(patience) and self.best.since >= patience and self.step < self.total_steps

    def _checkpoint(self) -> None:
        tc = self.config.train
        assert tc.checkpoint_dir is not None
        extra = {"best": self.best.to_dict()} if self.best is not None else None
        self.last_checkpoint = save_run_state(
            tc.checkpoint_dir,
            self.parts,
            step=self.step,
            config=self.config,
            keep=tc.keep_checkpoints,
            dense=self.train_ds.transform,
            extra_meta=extra,
        )
        logger.info("checkpoint %s", self.last_checkpoint)

    def close(self, *, completed: bool) -> None:
        """Stop the loader and writer; leave the process group this run joined.

        After a completed run every rank waits for the others first (``completed``), so
        that none tears its connections down while a peer still uses them (a rank
        once aborted at exit, "terminate called without an active exception").
        """
        if self.loader is not None:
            self.loader.close()
        if self.writer is not None:
            self.writer.close()
        if self.owns_group:
            destroy(barrier=completed)
