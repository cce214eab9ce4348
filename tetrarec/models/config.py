"""``DLRMConfig``: the shape of a DLRM or DLRM-DCNv2 model's dense part.

The embedding tables are not part of this config: their shapes live in their
``TableConfig``s, and the model reads ``feature_names``/``feature_dims`` from the
embedding module it is given (one source of truth per concept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tetrarec.models.precision import BF16Matmul
from tetrarec.types import NamedEnum, Precision

__all__ = ["DLRMConfig", "InteractionImpl", "ModelArch"]

# Dense precisions the model knows how to run (FP32 master weights throughout).
_DENSE_PRECISIONS = (Precision.FP32, Precision.BF16)


class ModelArch(NamedEnum):
    """Which interaction sits between the bottom and the top MLP."""

    __noun__ = "model arch"

    DLRM = "dlrm"  # pairwise dot products (DLRM paper)
    DCN = "dcn"  # low-rank DCNv2 cross layers (MLPerf DLRM-DCNv2)


class InteractionImpl(NamedEnum):
    """Which implementation of the dot interaction runs.

    Both give the same outputs and gradients (tested); ``REFERENCE`` is the readable
    formulation, ``FAST`` saves a concatenation, a gather backward and one of the two
    backward batched products.
    """

    __noun__ = "interaction impl"

    REFERENCE = "reference"
    FAST = "fast"


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """The dense architecture of a DLRM.

    Defaults are the Criteo-Kaggle DLRM (13 dense features, bottom MLP 512-256-64,
    dot interaction, top MLP 512-256-1). ``DLRMConfig.dcn_v2()`` gives MLPerf's
    DLRM-DCNv2 sizes.

    Args:
        num_dense: dense input features per sample. 0 (data with categorical features
            only, such as Avazu) feeds the bottom MLP a constant 1 instead, so its
            output is a learned vector and the dot interaction's ``<x, e_i>`` terms
            still give every id a first-order weight.
        bottom_mlp: bottom MLP layer sizes; the last must equal the embedding dim.
        top_mlp: top MLP layer sizes; the last must be 1 (one logit per sample).
        arch: the interaction (``"dlrm"`` dot or ``"dcn"`` cross layers).
        interaction_impl: dot-interaction implementation (ignored by DCN).
        dcn_layers: number of low-rank cross layers (DCN only).
        dcn_low_rank: rank of each cross layer's ``W V`` factorization (DCN only).
        dense_precision: compute precision of the dense path: ``fp32`` or ``bf16``
            (BF16 products; weights and optimizer state stay FP32).
        bf16_matmul: how BF16 products run: ``native`` (``torch.autocast``),
            ``emulated`` (BF16-rounded operands and results on FP32 kernels) or
            ``auto``: native where the device has BF16 units, else emulated (see
            ``tetrarec.models.precision``). Ignored for FP32.
        seed: seed of the dense layers' initialization; ``None`` uses the global RNG.
        dropout: dropout probability after each hidden activation of the bottom and
            top MLPs, in training mode only (see ``MLP``): never after the logit layer,
            nor on the bottom MLP's output (the dense vector the interaction combines
            with the embeddings), nor inside DCN's cross layers (their residual,
            multiplicative form crosses every input with ``x_0``: a dropped unit of
            ``x_0`` would zero every cross term it takes part in). 0 (default) is off.
        first_order: add a first-order (linear) term to the logit: one weight per row
            of every table and per dense input, all starting at 0
            (``tetrarec.models.FirstOrder``). A logistic regression on the same
            features, trained beside the interactions. Off by default. Needs an
            unsharded embedding module that lists its ``tables``.
        first_order_lr: learning rate of the per-row weights (Adagrad, fused in
            backward); constant: the run's warm-up and decay do not scale it. The
            dense inputs' weights train with the dense optimizer.
        first_order_weight_decay: L2 on the per-row weights a step touches (lazy, as
            ``optim.sparse.weight_decay``); the dense inputs' weights take
            ``optim.dense_weight_decay``.

    Raises:
        ValueError: on empty or non-positive layer sizes, a top MLP not ending in 1,
            a bad DCN setting, an unsupported dense precision, a ``dropout``
            outside [0, 1) or a negative first-order setting.
    """

    num_dense: int = 13
    bottom_mlp: tuple[int, ...] = (512, 256, 64)
    top_mlp: tuple[int, ...] = (512, 256, 1)
    arch: ModelArch = ModelArch.DLRM
    interaction_impl: InteractionImpl = InteractionImpl.FAST
    dcn_layers: int = 3
    dcn_low_rank: int = 512
    dense_precision: Precision = Precision.FP32
    bf16_matmul: BF16Matmul = BF16Matmul.AUTO
    seed: int | None = None
    dropout: float = 0.0
    first_order: bool = False
    first_order_lr: float = 0.02
    first_order_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "bottom_mlp", tuple(self.bottom_mlp))
        object.__setattr__(self, "top_mlp", tuple(self.top_mlp))
        object.__setattr__(self, "arch", ModelArch.parse(self.arch))
        object.__setattr__(self, "interaction_impl", InteractionImpl.parse(self.interaction_impl))
        object.__setattr__(self, "dense_precision", Precision.parse(self.dense_precision))
        object.__setattr__(self, "bf16_matmul", BF16Matmul.parse(self.bf16_matmul))
        if self.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {self.num_dense}")
        for name, sizes in (("bottom_mlp", self.bottom_mlp), ("top_mlp", self.top_mlp)):
            if not sizes or any(s <= 0 for s in sizes):
                raise ValueError(f"{name} needs positive layer sizes, got {sizes}")
        if self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp must end in 1 (one logit), got {self.top_mlp}")
        if self.dcn_layers < 0 or self.dcn_low_rank <= 0:
            raise ValueError(
                f"dcn_layers must be >= 0 and dcn_low_rank > 0, "
                f"got {self.dcn_layers} and {self.dcn_low_rank}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (
            0 <= self.first_order_lr < math.inf and 0 <= self.first_order_weight_decay < math.inf
        ):
            raise ValueError(
                f"first_order_lr and first_order_weight_decay must be >= 0 and finite, got "
                f"{self.first_order_lr} and {self.first_order_weight_decay}"
            )
        if self.dense_precision not in _DENSE_PRECISIONS:
            valid = ", ".join(p.value for p in _DENSE_PRECISIONS)
            raise ValueError(
                f"dense_precision {self.dense_precision.value!r} is not supported; valid: {valid}"
            )

    @property
    def embedding_dim(self) -> int:
        """The embedding dim the bottom MLP's output must match."""
        return self.bottom_mlp[-1]

    @classmethod
    def dcn_v2(cls, **overrides: object) -> DLRMConfig:
        """Return MLPerf DLRM-DCNv2 sizes, with ``overrides`` replacing fields.

        Bottom MLP 512-256-128, 3 cross layers of rank 512, top MLP 1024-1024-512-256-1
        (embedding dim 128).
        """
        fields: dict[str, object] = {
            "bottom_mlp": (512, 256, 128),
            "top_mlp": (1024, 1024, 512, 256, 1),
            "arch": ModelArch.DCN,
            "dcn_layers": 3,
            "dcn_low_rank": 512,
        }
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]  # fields are checked in __post_init__
