"""``[model]``: the embedding tables (rows, precision, placement, cache) and the network.

The network itself is ``tetrarec.models.DLRMConfig`` (``[model.dlrm]``); its bottom
MLP's last size is the dim of every table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tetrarec.cache import CachePolicy, CacheSpec
from tetrarec.data.config import expand_home
from tetrarec.kernels.quant import SUPPORTED_PRECISIONS
from tetrarec.models import DLRMConfig
from tetrarec.types import Placement, PoolingMode, Precision

__all__ = ["CacheConfig", "EmbeddingKind", "ModelConfig"]


class EmbeddingKind(enum.Enum):
    """Which embedding module a run builds."""

    REFERENCE = "reference"  # tetrarec.embedding.EmbeddingBagCollection + sparse optimizer
    FUSED = "fused"  # tetrarec.kernels.FusedEmbeddingBagCollection (update in backward)


# `device` is not one of them: `host` already keeps every uncached row on train.device
# (device memory on a GPU), and `cached` / `ssd` cache the hot rows there.
_RUN_PLACEMENTS = (Placement.HOST, Placement.CACHED, Placement.SSD)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """``[model.cache]``: the FP32 caches of the tables placed ``cached`` or ``ssd``.

    Args:
        policy: ``lru``, ``lfu`` or ``static``. ``static`` pins each cached table's most
            frequent rows in the first ``static_sample_batches`` training batches (the
            trainer counts them with ``tetrarec.cache.count_ids`` before building the
            model; a sharded run counts the same global batches, each shard pinning
            its own rows' counts) and never admits another.
        fraction: slots per cached table as a fraction of its rows.
        bytes: or a budget for the slots (FP32 row + optimizer state) of all cached
            tables together.
        dir: where ``ssd`` tables put their memory-mapped files (default: the system's
            temporary directory).
        static_sample_batches: training batches the ``static`` policy counts (>= 1).

    Raises:
        ValueError: if ``static_sample_batches`` is below 1.
    """

    policy: CachePolicy = CachePolicy.LRU
    fraction: float | None = None
    bytes: int | None = None
    dir: str | None = None
    static_sample_batches: int = 100

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", expand_home(self.dir))
        if self.static_sample_batches < 1:
            raise ValueError(
                "model.cache.static_sample_batches must be >= 1 (training batches whose ids the "
                f"static policy counts), got {self.static_sample_batches}"
            )

    def spec(self) -> CacheSpec:
        """The library's ``CacheSpec`` of this section.

        Raises:
            ValueError: unless exactly one of ``fraction`` and ``bytes`` is set, in
                range.
        """
        return CacheSpec(
            policy=self.policy, fraction=self.fraction, bytes=self.bytes, directory=self.dir
        )


_MAX_SPARSE = 1 << 16  # features; far beyond any model (a typo, or a damaged file)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The embedding tables and the network.

    Args:
        num_sparse: sparse features, one table each (named ``C1``, ``C2``, ...).
        num_embeddings: rows per table: one value for all, or one per table.
        embedding: which embedding module to build.
        precision: row storage of the tables (the reference module takes FP32 only).
        pooling: how a bag's embeddings combine.
        placement: where each table's rows live, one value for all or one per table:
            ``host`` (on ``train.device``, no cache), ``cached`` (an FP32 cache of hot
            rows on ``train.device`` in front of the rows in ``precision`` in host
            memory) or ``ssd`` (the same, the rows in a memory-mapped file); ``cached``
            and ``ssd`` need ``embedding = "fused"`` and a size in ``[model.cache]``.
        cache: the caches' policy and size (``CacheConfig``).
        dlrm: the network (bottom MLP, interaction, top MLP). Its bottom MLP's last
            size is the dim of every table (``embedding_dim``), stated once.

    Raises:
        ValueError: on a non-positive size or a per-table list of the wrong length.
    """

    num_sparse: int = 26
    num_embeddings: int | tuple[int, ...] = 100_000
    embedding: EmbeddingKind = EmbeddingKind.FUSED
    precision: Precision = Precision.FP32
    pooling: PoolingMode = PoolingMode.SUM
    placement: Placement | tuple[Placement, ...] = Placement.HOST
    cache: CacheConfig = field(default_factory=CacheConfig)
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)

    def __post_init__(self) -> None:
        if self.num_sparse <= 0:
            raise ValueError(f"model.num_sparse must be positive, got {self.num_sparse}")
        if self.num_sparse > _MAX_SPARSE:  # the per-table lists below would fill the memory
            raise ValueError(
                f"model.num_sparse must be at most {_MAX_SPARSE}, got {self.num_sparse}"
            )
        rows = self.table_rows
        if len(rows) != self.num_sparse or min(rows) <= 0:
            raise ValueError(
                f"model.num_embeddings must be a positive int or {self.num_sparse} positive "
                f"ints (one per table), got {self.num_embeddings}"
            )
        if self.precision not in SUPPORTED_PRECISIONS:
            valid = ", ".join(p.value for p in SUPPORTED_PRECISIONS)
            raise ValueError(
                f"model.precision {self.precision.value!r} is not a row precision; valid: {valid}"
            )
        self._check_placement()

    def _check_placement(self) -> None:
        placements = self.table_placements
        valid = ", ".join(p.value for p in _RUN_PLACEMENTS)
        if len(placements) != self.num_sparse:
            raise ValueError(
                f"model.placement must be one placement or {self.num_sparse} (one per "
                f"table), got {len(placements)}; valid: {valid}"
            )
        bad = sorted({p.value for p in placements if p not in _RUN_PLACEMENTS})
        if bad:
            raise ValueError(
                f"model.placement {bad[0]!r} is not a run placement: 'host' keeps a "
                "table's rows on train.device (device memory on a GPU), 'cached' and 'ssd' "
                f"cache its hot rows there; valid: {valid}"
            )
        if any(p is not Placement.HOST for p in placements):
            if self.embedding is not EmbeddingKind.FUSED:
                raise ValueError(
                    "model.placement 'cached' and 'ssd' need model.embedding = 'fused' "
                    f"(it is {self.embedding.value!r})"
                )
            try:
                self.cache.spec()
            except ValueError as e:
                raise ValueError(f"model.{e}") from None

    @property
    def table_placements(self) -> tuple[Placement, ...]:
        """Placement of each table."""
        if isinstance(self.placement, Placement):
            return (self.placement,) * self.num_sparse
        return tuple(self.placement)

    @property
    def cached(self) -> bool:
        """Whether any table is cached (placement ``cached`` or ``ssd``)."""
        return any(p is not Placement.HOST for p in self.table_placements)

    @property
    def embedding_dim(self) -> int:
        """The dim of every table: the bottom MLP's output size."""
        return self.dlrm.embedding_dim

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each table."""
        if isinstance(self.num_embeddings, int):
            return (self.num_embeddings,) * self.num_sparse
        return tuple(self.num_embeddings)
