"""DLRM and DLRM-DCNv2: bottom MLP, embeddings, interaction, top MLP -> one logit.

::

    dense (B, 13)                          sparse: SparseFeatures (F features)
         |                                           |
         v                                           v
    DenseArch: bottom MLP, ReLU            embeddings module (given, never built here:
    13 -> 512 -> 256 -> D                  reference EmbeddingBagCollection, fused
         |  x (B, D)                       kernels, or a sharded collection)
         |                                           |  e (B, F*D), FP32
         +-------------------+-----------------------+
                             v
            InteractionArch (by ModelArch):
              DLRM: [x | tril(C C^T)], C = [x, e_0..e_{F-1}]   -> (B, D + F(F+1)/2)
              DCN:  low-rank cross layers over [x | e]         -> (B, (F+1)*D)
                             |
                             v
            OverArch: top MLP, ReLU between layers, last layer -> 1
                             |
                             v
                      logits (B,)   (no sigmoid: train with BCE-with-logits)

The model is parallelism-free: it only calls ``embeddings(sparse)`` and reads the
module's ``feature_names`` and ``feature_dims``. With ``dense_precision=bf16`` the
matrix products of the bottom MLP, the DCN layers and the top MLP run in BF16 (natively
under ``torch.autocast``, or emulated on FP32 kernels where the device has no BF16
units: ``tetrarec.models.precision``) while the weights (and so the optimizer state)
stay FP32; embeddings, the dot interaction and the logit layer (the top MLP's last,
-> 1) stay FP32.

With ``first_order`` a ``FirstOrder`` term (a weight per table row and per dense
input, a logistic regression on the same features) is added to the logit::

    logits = OverArch(...) + sum_f w_f[id_f] + <v, dense>

With ``dropout > 0`` the hidden activations of both MLPs are dropped in training mode
(``model.train()``), never in evaluation mode; see ``DLRMConfig.dropout`` for where.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.profiler import record_function

from tetrarec.embedding import TableConfig
from tetrarec.models.config import DLRMConfig, ModelArch
from tetrarec.models.dcn import DCNInteraction
from tetrarec.models.first_order import FirstOrder
from tetrarec.models.interaction import DotInteraction, Interaction
from tetrarec.models.mlp import MLP, generator_for
from tetrarec.models.precision import BF16Matmul, dense_precision_context, has_native_bf16
from tetrarec.sparse import PooledEmbeddings, SparseFeatures
from tetrarec.types import Precision

__all__ = [
    "DLRM",
    "INTERACTIONS",
    "EmbeddingModule",
    "PendingPooling",
    "StartsPooling",
    "build_model",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class EmbeddingModule(Protocol):
    """What a model needs of its embedding module (reference, fused or sharded)."""

    feature_names: tuple[str, ...]
    feature_dims: tuple[int, ...]

    def __call__(self, features: SparseFeatures) -> PooledEmbeddings:
        """Pool every feature of ``features``."""
        ...


class PendingPooling(Protocol):
    """Pooled embeddings that may still be in flight."""

    def wait(self) -> PooledEmbeddings:
        """The pooled embeddings, once they are there."""
        ...


@runtime_checkable
class StartsPooling(Protocol):
    """An embedding module that can pool in two steps (optional, beside ``__call__``).

    ``start`` returns at once with the result in flight, and the model runs its bottom
    MLP before it waits (a sharded collection's rows travel meanwhile).
    """

    def start(self, features: SparseFeatures) -> PendingPooling:
        """Start pooling every feature of ``features``."""
        ...


class _Pooled:
    def __init__(self, pooled: PooledEmbeddings) -> None:
        self.pooled = pooled

    def wait(self) -> PooledEmbeddings:
        return self.pooled


InteractionBuilder = Callable[[DLRMConfig, int, int, torch.Generator | None], Interaction]


def _build_dot(
    config: DLRMConfig, num_features: int, dim: int, _gen: torch.Generator | None
) -> Interaction:
    return DotInteraction(num_features=num_features, dim=dim, impl=config.interaction_impl)


def _build_dcn(
    config: DLRMConfig, num_features: int, dim: int, gen: torch.Generator | None
) -> Interaction:
    return DCNInteraction(
        num_features=num_features,
        dim=dim,
        num_layers=config.dcn_layers,
        low_rank=config.dcn_low_rank,
        generator=gen,
    )


# Adding an interaction means writing its module (an Interaction) and one line here. Each maps
# (B, D), (B, F*D) -> (B, out_features).
INTERACTIONS: dict[ModelArch, InteractionBuilder] = {
    ModelArch.DLRM: _build_dot,
    ModelArch.DCN: _build_dcn,
}


class DLRM(nn.Module):
    """A DLRM (dot interaction) or DLRM-DCNv2 (cross layers) around an embedding module.

    Args:
        config: the dense architecture (see ``DLRMConfig``).
        embeddings: the embedding module; every feature's dim must equal
            ``config.bottom_mlp[-1]``. It is registered as ``self.embeddings``.
        first_order_rows: with ``config.first_order``, the module that pools the term's
            tables (``FirstOrder``'s ``rows``); ``None`` builds the fused collection that
            trains them. An exported model passes its inference collection.

    Raises:
        TypeError: if ``embeddings`` does not follow ``EmbeddingModule``, or, with
            ``config.first_order``, does not list its ``tables``.
        ValueError: if the embedding dims differ from each other or from the bottom
            MLP's output, or ``config.first_order`` is set around an already sharded
            module (build on meta tables and shard the model: both collections shard).

    Example:
        >>> from tetrarec.embedding import EmbeddingBagCollection, TableConfig
        >>> ebc = EmbeddingBagCollection([TableConfig(name="t", num_embeddings=10, dim=4)])
        >>> model = DLRM(DLRMConfig(num_dense=3, bottom_mlp=(8, 4), top_mlp=(8, 1)), ebc)
        >>> sf = SparseFeatures.from_lists({"t": [[1, 2], [3]]})
        >>> model(torch.zeros(2, 3), sf).shape
        torch.Size([2])
    """

    def __init__(
        self,
        config: DLRMConfig,
        embeddings: nn.Module,
        *,
        first_order_rows: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(embeddings, EmbeddingModule):
            raise TypeError(
                f"{type(embeddings).__name__} does not follow tetrarec.models.EmbeddingModule "
                "(feature_names, feature_dims, called on SparseFeatures)"
            )
        dims = tuple(embeddings.feature_dims)
        names = tuple(embeddings.feature_names)
        if not dims or len(set(dims)) != 1 or dims[0] != config.embedding_dim:
            raise ValueError(
                f"every embedding dim must equal the bottom MLP's output "
                f"{config.embedding_dim}; got dims {dict(zip(names, dims))}"
            )
        if (
            config.dense_precision is Precision.BF16
            and config.bf16_matmul is BF16Matmul.NATIVE
            and not has_native_bf16("cpu")
        ):
            logger.warning(
                "dense_precision=bf16 with bf16_matmul=native on a CPU without BF16 units "
                "(no AVX-512 BF16 or AMX): its BF16 products run ~8x slower than FP32 here; "
                "bf16_matmul=auto emulates them at about FP32 speed, with the same numerics"
            )
        self.config = config
        self.num_features = len(names)
        gen = generator_for(config.seed)
        # Without dense features the bottom MLP reads a constant 1 (see DLRMConfig).
        self.dense_arch = MLP(
            max(config.num_dense, 1),
            config.bottom_mlp,
            final_activation=True,
            generator=gen,
            dropout=config.dropout,
        )
        self.embeddings = embeddings
        self.inter_arch = INTERACTIONS[config.arch](
            config, self.num_features, config.embedding_dim, gen
        )
        self.over_arch = MLP(
            self.inter_arch.out_features,
            config.top_mlp,
            final_activation=False,
            fp32_last_layer=True,
            generator=gen,
            dropout=config.dropout,
        )
        # Built last: it draws nothing from the RNGs, and a model without it is as before.
        self.first_order: FirstOrder | None = None
        if config.first_order:
            tables, device = _first_order_tables(embeddings)
            self.first_order = FirstOrder(
                tables,
                num_dense=config.num_dense,
                lr=config.first_order_lr,
                weight_decay=config.first_order_weight_decay,
                device=device,
                rows=first_order_rows,
            )

    def forward(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        """Logits for a batch.

        Args:
            dense: ``(B, num_dense)`` float dense features (``(B, 0)`` for a model
                without dense features).
            sparse: the categorical features, ``B`` samples, keys as the embeddings'.

        Returns:
            ``(B,)`` FP32 logits.

        Raises:
            ValueError: for ``dense`` of another width than ``config.num_dense``, or
                another batch size than ``sparse``'s (before any lookup starts).
        """
        if dense.dim() != 2 or dense.shape != (sparse.batch_size, self.config.num_dense):
            raise ValueError(
                f"dense features {tuple(dense.shape)}: expected (batch, num_dense) = "
                f"({sparse.batch_size}, {self.config.num_dense}) (the sparse features' batch "
                "size, and the model's num_dense)"
            )
        with record_function("tetrarec/embeddings"):
            if isinstance(self.embeddings, StartsPooling):  # e.g. sharded: rows in flight
                pending: PendingPooling = self.embeddings.start(sparse)
            else:
                pending = _Pooled(self.embeddings(sparse))
        inputs = dense
        if self.config.num_dense == 0:  # (B, 0): the bottom MLP reads a constant 1
            dense = dense.new_ones(sparse.batch_size, 1)
        with record_function("tetrarec/dense_arch"), self._autocast(dense):
            x = self.dense_arch(dense)  # (B, D)
        pooled = pending.wait()  # values (B, F*D), FP32
        with record_function("tetrarec/interaction"), self._autocast(dense):
            z = self.inter_arch(x, pooled.values)  # (B, out_features)
        with record_function("tetrarec/over_arch"), self._autocast(dense):
            logits = self.over_arch(z)  # (B, 1)
        out: torch.Tensor = logits.squeeze(1).float()  # (B,)
        if self.first_order is not None:
            with record_function("tetrarec/first_order"):
                out = out + self.first_order(inputs, sparse)  # FP32 (B,)
        return out

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter outside the embedding module (what a dense optimizer updates)."""
        for name, p in self.named_parameters():
            if not name.startswith("embeddings."):
                yield p

    def _autocast(self, like: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
        return dense_precision_context(
            self.config.dense_precision, self.config.bf16_matmul, like.device.type
        )


def _first_order_tables(embeddings: nn.Module) -> tuple[tuple[TableConfig, ...], str | None]:
    """The tables a ``FirstOrder`` term copies, and where its rows go.

    The rows are built where the tables are: on the meta device when ``embeddings`` only
    describes its tables (to be sharded next: ``shard_model`` then shards the term's
    tables by the same plan), else on the CPU (the model is moved later).

    Raises:
        TypeError: if ``embeddings`` does not list its tables (``tables``).
        ValueError: if ``embeddings`` is already sharded (the term's tables would miss
            the plan: build the model unsharded, or on the meta device, then shard it).
    """
    if isinstance(embeddings, StartsPooling):
        raise ValueError(
            "model.dlrm.first_order around an already sharded embedding module: its tables "
            "would not be in the plan; build the model on unsharded (or meta) tables, then "
            "shard it (shard_model shards the first-order tables too)"
        )
    tables = getattr(embeddings, "tables", None)
    if not isinstance(tables, tuple) or not all(isinstance(t, TableConfig) for t in tables):
        raise TypeError(
            f"model.dlrm.first_order needs an embedding module that lists its tables "
            f"(a tuple of TableConfig in .tables); {type(embeddings).__name__} does not"
        )
    on_meta = any(b.is_meta for b in itertools.chain(embeddings.buffers(), embeddings.parameters()))
    return tables, "meta" if on_meta else None


def build_model(
    config: DLRMConfig, embeddings: nn.Module, *, first_order_rows: nn.Module | None = None
) -> DLRM:
    """Build the model ``config`` describes around ``embeddings``.

    Args:
        config: the dense architecture.
        embeddings: any module following the embedding protocol (reference, fused,
            sharded, an exported model's inference collection).
        first_order_rows: the first-order term's rows module (``DLRM``).

    Returns:
        The ``DLRM``.
    """
    model = DLRM(config, embeddings, first_order_rows=first_order_rows)
    n_dense = sum(p.numel() for p in model.dense_parameters())
    logger.info(
        "built %s model: %d features, %d dense parameters, dense precision %s",
        config.arch.value,
        model.num_features,
        n_dense,
        config.dense_precision.value,
    )
    return model
