"""An exported model on CUDA scores as on the CPU (``scripts/gpu_check.sh`` runs these).

Tolerances: logits ``rtol=1e-5, atol=1e-5`` (FP32 sums and products reordered by the
device's kernels; the INT8/INT4 rows decode to the same FP32 values on both).
"""

from __future__ import annotations

import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.inference import load, save
from tetrarec.inference.export import export_checkpoint
from tetrarec.inference.quantize import QuantSpec, quantize_model
from tetrarec.inference.scoring import model_dataset, score_dataset
from tetrarec.train import train
from tetrarec.types import Precision

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY = [
    "data.source=synthetic",
    "data.batch_size=64",
    "data.eval_batch_size=128",
    "data.prefetch=1",
    "data.synthetic.num_samples=512",
    "data.synthetic.eval_samples=300",
    "model.num_sparse=3",
    "model.num_embeddings=[200, 50, 400]",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "model.dlrm.first_order=true",
    "train.steps=4",
    "train.eval_every=0",
    "train.progress=false",
    "train.device=cpu",
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "precision", [Precision.FP32, Precision.FP16, Precision.INT8, Precision.INT4]
)
def test_a_model_scores_on_cuda_as_on_the_cpu(tmp_path, precision) -> None:
    """Bugs caught: a table, id map or layout tensor left on the host when the model
    moves (a device error), the compiled CPU kernel called with CUDA tensors, or a CUDA
    lookup of packed rows that decodes them otherwise than the CPU's."""
    result = train(
        RunConfig().with_overrides(
            [*TINY, f"train.checkpoint_dir={tmp_path / 'ck'}", "train.checkpoint_every=4"]
        )
    )
    assert result.checkpoint is not None
    model = export_checkpoint(result.checkpoint, tmp_path / "fp32")
    tables = {name: precision for name in model.table_precisions()}
    save(quantize_model(model, QuantSpec(tables=tables)), tmp_path / "q")
    cpu = load(tmp_path / "q")
    dataset = model_dataset(cpu)
    want, labels = score_dataset(cpu, dataset)
    gpu = load(tmp_path / "q").to("cuda")
    assert gpu.device.type == "cuda"
    got, got_labels = score_dataset(gpu, dataset)
    assert torch.equal(got_labels, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
