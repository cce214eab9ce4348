"""``InferenceModel``: an exported model, loaded for scoring; ``load`` and ``save``.

An exported model is the trained ``DLRM`` with its tables held by
``InferenceEmbeddingBags`` (each table in its own precision, no optimizer state) and its
dense layers in the format the manifest names (``tetrarec.inference.dense``). Loading
needs neither the training code nor a process group nor the checkpoint it came from::

    >>> model = tetrarec.inference.load("model/")            # doctest: +SKIP
    >>> model.predict(batch.dense, batch.sparse)              # doctest: +SKIP
    tensor([0.1032, 0.0871, ...])

``InferenceModel.features`` says what a sample holds (dense column names, sparse feature
names), and ``dense_transform`` is the training rows' transform, which
``tetrarec.inference.predict`` and the server apply to raw rows before scoring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tetrarec.config import RunConfig
from tetrarec.data import DenseTransform
from tetrarec.embedding import TableConfig
from tetrarec.inference.dense import DENSE_FORMATS
from tetrarec.inference.embeddings import BACKENDS, DEFAULT_BACKEND, InferenceEmbeddingBags
from tetrarec.inference.format import Manifest, ModelFileError, read_model_dir, write_model_dir
from tetrarec.models import DLRM, FIRST_ORDER_SUFFIX, build_model
from tetrarec.sparse import SparseFeatures
from tetrarec.types import PoolingMode, Precision

__all__ = ["InferenceModel", "load", "save", "table_configs"]


def table_configs(manifest: Manifest) -> tuple[TableConfig, ...]:
    """The tables a manifest lists, as stored (``num_embeddings``: the stored rows).

    Raises:
        ModelFileError: for an entry without a name, sizes, precision or features.
    """
    out = []
    for entry in manifest.tables:
        try:
            out.append(
                TableConfig(
                    name=str(entry["name"]),
                    num_embeddings=int(entry["stored_rows"]),
                    dim=int(entry["dim"]),
                    feature_names=tuple(str(f) for f in entry["features"]),
                    pooling=PoolingMode(entry["pooling"]),
                    precision=Precision.parse(entry["precision"]),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFileError(f"manifest table entry {entry!r} is not valid ({e})") from None
    return tuple(out)


def _tables_from(
    tables: tuple[TableConfig, ...], tensors: Mapping[str, torch.Tensor], backend: str
) -> InferenceEmbeddingBags:
    missing = [f"tables.{t.name}.rows" for t in tables if f"tables.{t.name}.rows" not in tensors]
    if missing:
        raise ModelFileError(f"the model file has no tensor {missing[0]!r}")
    rows = {t.name: tensors[f"tables.{t.name}.rows"] for t in tables}
    remaps = {
        t.name: tensors[f"tables.{t.name}.remap"]
        for t in tables
        if f"tables.{t.name}.remap" in tensors
    }
    try:
        return InferenceEmbeddingBags(tables, rows, remaps=remaps, backend=backend)
    except ValueError as e:
        raise ModelFileError(f"the model file's tables do not fit its manifest: {e}") from None


@dataclass(frozen=True, kw_only=True)
class InferenceModel:
    """A model ready to score: the network, its manifest and its data settings.

    Args:
        manifest: what the model is (``tetrarec.inference.format.Manifest``).
        module: the network, in eval mode, on the CPU (``to`` moves it).
        config: the training run's config (its data and model sections apply).
        dense_transform: the training rows' dense transform, or ``None``.
        path: the directory it was loaded from, if any.
    """

    manifest: Manifest
    module: DLRM
    config: RunConfig
    dense_transform: DenseTransform | None
    path: Path | None = None

    @property
    def embeddings(self) -> InferenceEmbeddingBags:
        """The model's embedding tables."""
        emb = self.module.embeddings
        assert isinstance(emb, InferenceEmbeddingBags)  # built so by from_parts
        return emb

    @property
    def first_order_rows(self) -> InferenceEmbeddingBags | None:
        """The first-order term's tables, if the model has the term."""
        if self.module.first_order is None:
            return None
        rows = self.module.first_order.rows
        assert isinstance(rows, InferenceEmbeddingBags)
        return rows

    @property
    def sparse_features(self) -> tuple[str, ...]:
        """The sparse features a sample holds, in the model's order."""
        return self.embeddings.feature_names

    @property
    def num_dense(self) -> int:
        """Dense inputs per sample."""
        return self.config.model.dlrm.num_dense

    @property
    def device(self) -> torch.device:
        """Where the network is."""
        return next(iter(self.module.parameters())).device

    def to(self, device: torch.device | str) -> InferenceModel:
        """The model on ``device`` (the module moves in place)."""
        self.module.to(device)
        return self

    def logits(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        """``(B,)`` FP32 logits of a batch (dense features already transformed)."""
        with torch.inference_mode():
            out: torch.Tensor = self.module(dense, sparse)
        return out

    def predict(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        """``(B,)`` FP32 click probabilities of a batch (``sigmoid(logits)``)."""
        return torch.sigmoid(self.logits(dense, sparse))

    def table_precisions(self) -> dict[str, Precision]:
        """``{table: precision}`` of every table (embedding, then first-order)."""
        tables = self.embeddings.tables
        if self.first_order_rows is not None:
            tables = tables + self.first_order_rows.tables
        return {t.name: t.precision for t in tables}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a model file holds for this model."""
        out = self.embeddings.stored_tensors()
        if self.first_order_rows is not None:
            out.update(self.first_order_rows.stored_tensors())
        dense_format = DENSE_FORMATS[str(self.manifest.dense["precision"])]
        out.update(dense_format.save(self.module, self.manifest.dense))
        return out

    def nbytes(self) -> int:
        """Bytes of every tensor the model holds (tables, id maps, dense layers)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @classmethod
    def from_parts(
        cls,
        manifest: Manifest,
        tensors: Mapping[str, torch.Tensor],
        *,
        backend: str = DEFAULT_BACKEND,
        path: Path | None = None,
    ) -> InferenceModel:
        """Build the network a manifest describes around its tensors.

        Raises:
            ModelFileError: for a config, table or tensor that does not fit, or a dense
                format or backend this tetrarec does not know.
        """
        if backend not in BACKENDS:
            raise ModelFileError(f"unknown lookup backend {backend!r}; valid: {sorted(BACKENDS)}")
        try:
            config = RunConfig.from_dict(manifest.config)
        except (TypeError, ValueError) as e:
            raise ModelFileError(f"the manifest's config is not valid: {e}") from None
        tables = table_configs(manifest)
        emb = tuple(t for t in tables if not t.name.endswith(FIRST_ORDER_SUFFIX))
        fo = tuple(t for t in tables if t.name.endswith(FIRST_ORDER_SUFFIX))
        if bool(fo) != config.model.dlrm.first_order:
            raise ModelFileError(
                "the manifest's first-order tables do not match model.dlrm.first_order"
            )
        dense_precision = str(manifest.dense.get("precision"))
        if dense_precision not in DENSE_FORMATS:
            raise ModelFileError(
                f"dense precision {dense_precision!r} is not one this tetrarec runs; "
                f"valid: {sorted(DENSE_FORMATS)}"
            )
        embeddings = _tables_from(emb, tensors, backend)
        fo_rows = _tables_from(fo, tensors, backend) if fo else None
        try:
            # The dense layers' initial draw (overwritten next) must not move the caller's
            # global RNG: loading a model is no reason for a user's random stream to change.
            with torch.random.fork_rng(devices=[]):
                module = build_model(config.model.dlrm, embeddings, first_order_rows=fo_rows)
            DENSE_FORMATS[dense_precision].load(module, tensors, manifest.dense)
        except ValueError as e:
            raise ModelFileError(f"the model file does not fit its manifest: {e}") from None
        module.eval()
        module.requires_grad_(False)
        transform = (
            DenseTransform.from_dict(manifest.dense_transform)
            if manifest.dense_transform is not None
            else None
        )
        return cls(
            manifest=manifest, module=module, config=config, dense_transform=transform, path=path
        )

    def with_manifest(self, **changes: Any) -> InferenceModel:
        """This model with manifest fields replaced (its module shared)."""
        return dataclasses.replace(self, manifest=dataclasses.replace(self.manifest, **changes))


def load(path: str | Path, *, backend: str = DEFAULT_BACKEND) -> InferenceModel:
    """Load an exported model directory, checked (``read_model_dir``) before use.

    Args:
        path: the directory ``tetrarec export`` or ``tetrarec quantize`` wrote.
        backend: the lookup backend of its tables (``BACKENDS``).

    Raises:
        ModelFileError: one line naming what is wrong (a missing or changed file, a
            newer format version, tensors that do not fit the manifest).
    """
    manifest, tensors = read_model_dir(path)
    return InferenceModel.from_parts(manifest, tensors, backend=backend, path=Path(path))


def save(model: InferenceModel, path: str | Path) -> Manifest:
    """Write ``model`` as a model directory at ``path`` (atomically; see ``format``)."""
    return write_model_dir(path, model.manifest, model.tensors())
