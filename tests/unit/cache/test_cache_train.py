"""A training run with cached and SSD-placed tables: logs, checkpoints, resume."""

import logging

import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.train import latest_checkpoint, read_checkpoint, train

TINY = [
    "data.source=synthetic",
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.prefetch=1",
    "data.synthetic.num_samples=128",
    "data.synthetic.eval_samples=64",
    "model.num_sparse=3",
    "model.num_embeddings=[50, 20, 100]",
    "model.precision=int8",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.sparse.kind=rowwise_adagrad",
    "optim.sparse.lr=0.1",
    "train.progress=false",
    "train.deterministic=true",
    "train.log_every=2",
]


def tiny(tmp_path, run, *extra):
    return RunConfig().with_overrides(
        [
            *TINY,
            "model.placement=[cached, ssd, host]",
            "model.cache.fraction=0.2",
            f"model.cache.dir={tmp_path / 'ssd'}",
            f"train.checkpoint_dir={tmp_path / run}",
            *extra,
        ]
    )


@pytest.mark.slow
def test_cached_run_logs_hit_rate_and_resumes_bitwise(tmp_path, caplog):
    """6 steps straight equal 3 steps, a resume and 3 more, with a cache and an SSD table.

    Catches: a builder that ignores ``model.placement`` (no cache keys in the
    checkpoint), a checkpoint without the cache contents or taken before the flush, a
    trainer that does not log the hit rate.
    """
    caplog.set_level(logging.INFO, logger="tetrarec.train.loop")
    straight = train(tiny(tmp_path, "a", "train.steps=6"))
    assert any("cache hit rate" in r.getMessage() for r in caplog.records)
    train(tiny(tmp_path, "b", "train.steps=3"))
    resumed = train(tiny(tmp_path, "b", "train.steps=6"), resume=True)
    assert resumed.start_step == 3
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert "embedding.cache.C1.slot_rows" in a.tensors
    assert "embedding.cache.C3.slot_rows" not in a.tensors  # host: no cache
    assert a.tensors["embedding.weights.C2"].dtype == torch.uint8  # the stored rows
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name
    assert resumed.final == straight.final
