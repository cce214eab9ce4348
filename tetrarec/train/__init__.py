"""Training: the loop, metrics, optimizers, schedules, checkpoints and the demo run."""

from tetrarec.config.tables import build_tables
from tetrarec.train.build import RunParts, build_parts
from tetrarec.train.checkpoint import latest_checkpoint, read_checkpoint
from tetrarec.train.demo import demo_config
from tetrarec.train.evaluate import checkpoint_config, evaluate, evaluate_checkpoint
from tetrarec.train.loop import NonFiniteLossError, TrainingStoppedError, TrainResult, train
from tetrarec.train.metrics import BestEval, MetricAccumulator, Metrics, compute_metrics
from tetrarec.train.optim import RowWiseAdagrad, build_dense_optimizer, build_sparse_optimizer
from tetrarec.train.schedule import lr_scale
from tetrarec.train.state import (
    NonFiniteStateError,
    load_dense_transform,
    load_model_state,
    load_run_state,
    save_run_state,
)

__all__ = [
    "BestEval",
    "MetricAccumulator",
    "Metrics",
    "NonFiniteLossError",
    "NonFiniteStateError",
    "RowWiseAdagrad",
    "RunParts",
    "TrainResult",
    "TrainingStoppedError",
    "build_dense_optimizer",
    "build_parts",
    "build_sparse_optimizer",
    "build_tables",
    "checkpoint_config",
    "compute_metrics",
    "demo_config",
    "evaluate",
    "evaluate_checkpoint",
    "latest_checkpoint",
    "load_dense_transform",
    "load_model_state",
    "load_run_state",
    "lr_scale",
    "read_checkpoint",
    "save_run_state",
    "train",
]
