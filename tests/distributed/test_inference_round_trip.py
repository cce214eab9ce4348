"""A model trained sharded at 3 ranks, exported and loaded in one process without
torch.distributed, scores the evaluation rows as the training run's own evaluation did.

The run uses examples/sharded_mixed.toml's plan (row-wise, table-wise, column-wise and
data-parallel tables) at small sizes, INT8 rows and a cached table; the export puts each
table back together from the 3 ranks' blocks (row ranges, column blocks, one replica)
and the cache's rows.
"""

from __future__ import annotations

import pytest
import torch

from tetrarec.inference import load
from tetrarec.inference.export import export_checkpoint
from tetrarec.inference.scoring import evaluate_model, model_dataset
from tetrarec.testing import run_ranks
from tetrarec.testing.train_workers import Scenario, train_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# examples/sharded_mixed.toml's tables and their types, at small sizes.
MIXED_RECIPE = (
    "data.source=synthetic",
    "data.batch_size=48",
    "data.eval_batch_size=96",
    "data.prefetch=1",
    "data.synthetic.num_samples=480",
    "data.synthetic.eval_samples=289",  # the last eval batch: 1 row, none for 2 ranks
    "model.num_sparse=8",
    "model.num_embeddings=[200, 50, 20, 10, 100, 5, 3, 30]",
    "model.dlrm.bottom_mlp=[16, 8]",
    "model.dlrm.top_mlp=[16, 1]",
    "model.dlrm.first_order=true",
    "optim.sparse.kind=rowwise_adagrad",
    "optim.sparse.lr=0.1",
    "train.steps=6",
    "train.deterministic=true",
    "train.progress=false",
    "train.log_every=0",
    "sharding.timeout_s=60",
    "sharding.type=[row_wise, table_wise, column_wise, data_parallel, "
    "row_wise, table_wise, data_parallel, column_wise]",
    "sharding.column_block=4",
    # INT8 rows, and the table-wise C2's hot rows in an FP32 cache
    "model.precision=int8",
    "model.placement=[host, cached, host, host, host, host, host, host]",
    "model.cache.fraction=0.25",
)


@pytest.mark.timeout(600)
def test_a_model_trained_at_3_ranks_scores_as_its_runs_evaluation(tmp_path):
    """AUC and log loss of the exported model on the run's evaluation split equal the
    run's final evaluation to 1e-6. Catches an export that loses a rank's row range or
    column block, takes a replica's rows from the wrong rank, leaves the cache's rows
    out, or needs a process group to load."""
    ck = tmp_path / "ck"
    scenario = Scenario(
        "mixed", (*MIXED_RECIPE, f"train.checkpoint_dir={ck}", "train.checkpoint_every=6")
    )
    results = run_ranks(train_worker, world_size=3, args=([scenario],), timeout_s=540)
    for rank in results:
        assert rank[0]["ok"], rank
    run = results[0][0]
    assert run["checkpoint"] == str(ck / "step_00000006")

    export_checkpoint(run["checkpoint"], tmp_path / "model")
    model = load(tmp_path / "model")
    assert not torch.distributed.is_initialized()
    assert model.manifest.source["world_size"] == 3
    got = evaluate_model(model, model_dataset(model))
    want = run["final"]
    assert got.num_samples == want["num_samples"] == 289
    assert got.auc == pytest.approx(want["auc"], abs=1e-6)
    assert got.log_loss == pytest.approx(want["log_loss"], abs=1e-6)
