"""A training run ends with the same checkpoint, bit for bit, on 1 and on 2 threads.

The batch is large enough that the compiled embedding kernel splits its work across
threads (see tests/unit/kernels/test_kernels_determinism.py for the thresholds): 4
features x 1024 samples = 4096 bags (forward splits above 256 bags, the backward's key
building above 2048) of 4 ids on average, so each backward sorts and updates about
16k ids (the update splits in row-aligned ranges above 8192 ids) from the gathered
gradient rows (n >= 2 bags). Bugs it catches: any sum whose order follows the thread
split (embedding kernel, dense MLP, interaction, loss), and a stochastic-rounding stream
keyed by thread.
"""

import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.train import latest_checkpoint, read_checkpoint, train

BATCH = 1024
RUN = [
    "data.source=synthetic",
    f"data.batch_size={BATCH}",
    "data.eval_batch_size=256",
    "data.prefetch=1",
    f"data.synthetic.num_samples={3 * BATCH}",
    "data.synthetic.eval_samples=256",
    "data.synthetic.pooling=4",
    "model.num_sparse=4",
    "model.num_embeddings=[3000, 800, 50, 5000]",
    "model.embedding=fused",
    "model.dlrm.bottom_mlp=[16, 8]",
    "model.dlrm.top_mlp=[16, 1]",
    "optim.dense=adam",
    "optim.sparse.kind=rowwise_adagrad",
    "optim.sparse.lr=0.1",
    "train.steps=3",
    "train.progress=false",
    "train.deterministic=true",
    "train.log_every=0",
]


@pytest.mark.slow
def test_one_and_two_threads_end_with_bitwise_equal_checkpoints(tmp_path) -> None:
    threads_before = torch.get_num_threads()
    checkpoints = {}
    for threads in (1, 2):
        out = tmp_path / f"threads{threads}"
        config = RunConfig().with_overrides(
            [*RUN, f"train.threads={threads}", f"train.checkpoint_dir={out}"]
        )
        result = train(config)
        assert result.steps == 3
        checkpoints[threads] = read_checkpoint(latest_checkpoint(out))
    assert torch.get_num_threads() == threads_before  # the run restores the thread count
    one, two = checkpoints[1], checkpoints[2]
    assert one.step == two.step == 3
    assert sorted(one.tensors) == sorted(two.tensors)
    assert any(k.startswith("sparse_optim.") for k in one.tensors)  # the fused optimizer's
    for name, tensor in one.tensors.items():
        assert torch.equal(tensor, two.tensors[name]), name
