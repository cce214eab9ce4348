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
``1.5``, enum fields take their string value, a float field also ``"inf"``).

Dotted overrides (``tetrarec train --set KEY=VALUE``) are merged into the file's values
before anything is validated (``RunConfig.from_toml(path, overrides)``), so a key that
the file leaves out can come from an override alone (a Parquet run's
``data.train_path``). Each value is read as TOML first, then as plain text
(``train.steps=10``, ``train.checkpoint_dir=out/ck``, ``model.dlrm.top_mlp=64,1``,
``train.checkpoint_dir=none``; the rules are in ``tetrarec.config.overrides``).

The modules, one concept each (``[data]`` is ``tetrarec.data.config``)::

    model.py       [model], [model.cache]: the embedding tables and the network
    optim.py       [optim]: the dense and sparse optimizers, the learning-rate schedule
    train.py       [train]: steps or epochs, evaluation, checkpoints, keep-best, device
    sharding.py    [sharding]: placement over ranks when launched by torchrun
    run.py         RunConfig: the tree of sections, from TOML with --set overrides
    convert.py     strict conversion between the sections and plain dicts
    overrides.py   how an override's text is read for its field's type
"""

from __future__ import annotations

from tetrarec.config.convert import config_from_dict, config_to_dict
from tetrarec.config.model import CacheConfig, EmbeddingKind, ModelConfig
from tetrarec.config.optim import DecayKind, DenseOptimizerKind, OptimConfig
from tetrarec.config.run import RunConfig
from tetrarec.config.sharding import ShardingConfig
from tetrarec.config.train import DEFAULT_STEPS, BestMetric, DeviceKind, TrainConfig

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
