"""The built-in demo run: a small DLRM on the synthetic data, sized for a 2-core CPU."""

from __future__ import annotations

from tetrarec.config import (
    DenseOptimizerKind,
    EmbeddingKind,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from tetrarec.data.config import DataConfig, SyntheticConfig
from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.models import DLRMConfig
from tetrarec.types import OptimizerKind

__all__ = ["demo_config"]


def demo_config() -> RunConfig:
    """The ``tetrarec demo`` run: 26 tables, dim 16, on power-law synthetic data.

    Sized to train in about a minute on 2 CPU cores and reach a held-out AUC above
    0.70 (the synthetic teacher's Bayes AUC is about 0.8).
    """
    return RunConfig(
        data=DataConfig(
            source="synthetic",
            batch_size=1024,
            eval_batch_size=8192,
            synthetic=SyntheticConfig(num_samples=2_000_000, eval_samples=50_000, seed=0),
        ),
        model=ModelConfig(
            num_sparse=26,
            num_embeddings=20_000,
            embedding=EmbeddingKind.FUSED,
            dlrm=DLRMConfig(num_dense=13, bottom_mlp=(64, 16), top_mlp=(64, 32, 1)),
        ),
        optim=OptimConfig(
            dense=DenseOptimizerKind.ADAGRAD,
            dense_lr=0.02,
            warmup_steps=50,
            sparse=SparseOptimizerSpec(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1),
        ),
        train=TrainConfig(steps=300, eval_every=0, log_every=50, seed=0),
    )
