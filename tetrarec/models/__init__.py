"""DLRM and DLRM-DCNv2 models; parallelism-free, they never import ``sharding``."""

from tetrarec.models.config import DLRMConfig, InteractionImpl, ModelArch
from tetrarec.models.dcn import DCNInteraction, LowRankCrossNet
from tetrarec.models.dlrm import (
    DLRM,
    INTERACTIONS,
    EmbeddingModule,
    PendingPooling,
    StartsPooling,
    build_model,
)
from tetrarec.models.first_order import (
    FIRST_ORDER_SUFFIX,
    FirstOrder,
    first_order_optimizer,
    first_order_tables,
)
from tetrarec.models.interaction import DotInteraction, Interaction, dot_interaction_reference
from tetrarec.models.mlp import MLP

__all__ = [
    "DLRM",
    "FIRST_ORDER_SUFFIX",
    "INTERACTIONS",
    "MLP",
    "DCNInteraction",
    "DLRMConfig",
    "DotInteraction",
    "EmbeddingModule",
    "FirstOrder",
    "Interaction",
    "InteractionImpl",
    "LowRankCrossNet",
    "ModelArch",
    "PendingPooling",
    "StartsPooling",
    "build_model",
    "dot_interaction_reference",
    "first_order_optimizer",
    "first_order_tables",
]
