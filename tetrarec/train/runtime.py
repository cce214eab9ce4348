"""The process around a training run, set and checked before anything is built.

Its device (``_run_device``), torch's thread count and deterministic mode for the run
(``_runtime``), TensorBoard's writer (``_summary_writer_class``), and its output paths:
a file where a directory goes, a fresh run in a directory of an earlier run's
checkpoints (``_check_paths``, ``_clear_for_fresh_run``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tetrarec import jsonio
from tetrarec.comm import LaunchInfo, joined_backend
from tetrarec.config import DeviceKind, RunConfig, TrainConfig
from tetrarec.train.build import check_cache_dir
from tetrarec.train.checkpoint import BEST_LINK, list_checkpoints

__all__: list[str] = []

# One logger for the whole run's log, named for the loop (users and tests filter on it).
logger = logging.getLogger("tetrarec.train.loop")


def _run_device(config: TrainConfig, launch: LaunchInfo) -> torch.device:
    """The device of this process's run (``TrainConfig.resolve_device``).

    A caller that joined the process group itself chose its backend, and ``auto``
    follows it: the CPU under gloo (a gloo group cannot move CUDA tensors all-to-all),
    this rank's GPU under NCCL. An explicit ``cpu`` or ``cuda`` is kept (and checked
    against the group when the run joins it).
    """
    backend = joined_backend() if launch.distributed else None
    if backend is not None and config.device is DeviceKind.AUTO and "nccl" not in backend:
        return torch.device("cpu")
    return config.resolve_device(launch.local_rank)


@contextlib.contextmanager
def _runtime(config: TrainConfig) -> Iterator[None]:
    """Thread count and deterministic mode for the run; restored afterwards."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    if config.threads:
        torch.set_num_threads(config.threads)
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    if config.deterministic:
        torch.use_deterministic_algorithms(True)
        # Deterministic mode would also fill every new empty tensor with NaN (a debugging
        # aid that costs a pass over memory per allocation, ~10% of a sharded step);
        # tetrarec never reads memory it did not write, so results are the same without.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def _summary_writer_class(config: TrainConfig) -> Any:
    """TensorBoard's ``SummaryWriter`` when ``train.tensorboard_dir`` is set, else ``None``.

    Called by every rank before anything is built, so that a missing TensorBoard fails
    all of them at once with this message (not rank 0 alone, after the others joined
    the group and went on to wait in a collective).

    Raises:
        ValueError: if TensorBoard is not installed.
    """
    if config.tensorboard_dir is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(
            f"train.tensorboard_dir is set but TensorBoard is not installed ({e}); "
            "install it with `pip install tetrarec[tensorboard]` or unset the option"
        ) from e
    return SummaryWriter


def _check_paths(config: RunConfig) -> None:
    """Refuse, by their keys, paths the run could only fail on after training."""
    if config.train.json:
        jsonio.check_output_path(config.train.json, f"train.json={config.train.json!r}")
    where = config.train.checkpoint_dir
    if where and Path(where).exists() and not Path(where).is_dir():
        raise ValueError(f"train.checkpoint_dir={where!r} is a file; give a directory")
    check_cache_dir(config.model)


def _clear_for_fresh_run(config: TrainConfig, rank: int) -> None:
    """Keep a fresh run from mixing its checkpoints with an earlier run's.

    Pruning keeps the newest checkpoints of the directory: an earlier, longer run's
    would outlive (and delete) the new run's own. So a fresh run in a directory with
    checkpoints is refused, or, with ``train.overwrite_checkpoints``, rank 0 deletes
    them first (before any collective, so no rank writes into the directory sooner).
    """
    root = config.checkpoint_dir
    found = list_checkpoints(root) if root else []
    if not found:
        return
    if not config.overwrite_checkpoints:
        raise ValueError(
            f"train.checkpoint_dir={root!r} holds an earlier run's checkpoints (newest: "
            f"{found[-1].name}): pass --resume to continue that run, or set "
            "train.overwrite_checkpoints=true to delete them, or give another "
            "train.checkpoint_dir"
        )
    if rank == 0:
        assert root is not None
        link = Path(root) / BEST_LINK
        if link.is_symlink():
            link.unlink()
        for path in found:
            shutil.rmtree(path)
        logger.info(
            "train.overwrite_checkpoints: deleted %d checkpoint(s) of an earlier run in %s",
            len(found),
            root,
        )
