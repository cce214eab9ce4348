"""Inference: export a trained model, quantize it, score files with it, serve it.

``load`` reads an exported model directory (safetensors plus a JSON manifest, checked
before use) without the training code, optimizer state or a process group. The other
stages live in their own modules, which the ``tetrarec`` command calls:
``export`` (a checkpoint to a model), ``quantize`` (per-table precisions and the
accuracy tool chain), ``predict`` (batch scoring), ``serve`` (HTTP).
"""

from tetrarec.inference.embeddings import BACKENDS, InferenceEmbeddingBags
from tetrarec.inference.format import Manifest, ModelFileError
from tetrarec.inference.model import InferenceModel, load, save

__all__ = [
    "BACKENDS",
    "InferenceEmbeddingBags",
    "InferenceModel",
    "Manifest",
    "ModelFileError",
    "load",
    "save",
]
