"""A tiny exported model built in memory, and batches for it (the quantization tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tetrarec.config import RunConfig
from tetrarec.config.tables import build_tables, model_tables
from tetrarec.data import build_datasets
from tetrarec.inference.dense import DENSE_FORMATS
from tetrarec.inference.embeddings import InferenceEmbeddingBags
from tetrarec.inference.format import Manifest
from tetrarec.inference.model import InferenceModel
from tetrarec.inference.scoring import batches
from tetrarec.models import FIRST_ORDER_SUFFIX, build_model
from tetrarec.sparse import Batch

ROWS = (100, 60, 40, 30)


def tiny_config(*, first_order: bool = False, arch: str = "dlrm", pooling: int = 3) -> RunConfig:
    """4 tables (dim 8), bottom 13 -> 32 -> 8, top -> 32 -> 16 -> 1, synthetic rows."""
    values: dict[str, Any] = {
        "data": {
            "source": "synthetic",
            "batch_size": 256,
            "synthetic": {"num_samples": 2048, "eval_samples": 512, "pooling": pooling},
        },
        "model": {
            "num_sparse": len(ROWS),
            "num_embeddings": list(ROWS),
            "dlrm": {
                "arch": arch,
                "bottom_mlp": [32, 8],
                "top_mlp": [32, 16, 1],
                "first_order": first_order,
            },
        },
    }
    return RunConfig.from_dict(values)


def tiny_model(*, first_order: bool = False, arch: str = "dlrm", seed: int = 1) -> InferenceModel:
    """An FP32 model of ``tiny_config`` with random tables and the dense layers' init."""
    config = tiny_config(first_order=first_order, arch=arch)
    tables = model_tables(config.model)
    gen = torch.Generator().manual_seed(seed)
    rows = {t.name: torch.randn(t.num_embeddings, t.dim, generator=gen) * 0.5 for t in tables}
    emb = [t for t in tables if not t.name.endswith(FIRST_ORDER_SUFFIX)]
    fo = [t for t in tables if t.name.endswith(FIRST_ORDER_SUFFIX)]
    module = build_model(
        config.model.dlrm,
        InferenceEmbeddingBags(emb, {t.name: rows[t.name] for t in emb}),
        first_order_rows=InferenceEmbeddingBags(fo, {t.name: rows[t.name] for t in fo})
        if fo
        else None,
    )
    tensors = {f"tables.{n}.rows": r for n, r in rows.items()}
    tensors.update(DENSE_FORMATS["fp32"].save(module, {"precision": "fp32"}))
    entries = [
        {
            "name": t.name,
            "rows": t.num_embeddings,
            "stored_rows": t.num_embeddings,
            "dim": t.dim,
            "precision": "fp32",
            "trained_precision": "fp32",
            "pooling": t.pooling.value,
            "features": list(t.feature_names),
        }
        for t in tables
    ]
    manifest = Manifest(
        config=config.to_dict(), dense_transform=None, tables=entries, dense={"precision": "fp32"}
    )
    return InferenceModel.from_parts(manifest, tensors)


def training_batches(model: InferenceModel, num: int = 2, batch_size: int = 256) -> list[Batch]:
    """The first ``num`` batches of the model's synthetic training rows."""
    train, _ = build_datasets(model.config.data, build_tables(model.config.model))
    out: list[Batch] = []
    for batch in batches(train, batch_size=batch_size):
        out.append(batch)
        if len(out) == num:
            break
    return out


def held_out_batches(model: InferenceModel, batch_size: int = 512) -> Sequence[Batch]:
    """The model's synthetic held-out rows, one batch."""
    _, held_out = build_datasets(model.config.data, build_tables(model.config.model))
    return list(batches(held_out, batch_size=batch_size))[:1]
