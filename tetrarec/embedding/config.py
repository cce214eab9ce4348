"""``TableConfig``: the one source of truth for an embedding table's shape."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from tetrarec.types import OptimizerKind, PoolingMode, Precision

__all__ = [
    "SPARSE_HPARAM_RULES",
    "SparseOptimizerSpec",
    "TableConfig",
    "TableSlice",
    "bad_sparse_hparams",
    "feature_order",
]


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table and the features that look it up.

    Args:
        name: table name, unique in a collection.
        num_embeddings: rows (the hash size).
        dim: embedding dim.
        feature_names: features that look this table up; several may share a table.
            Defaults to ``(name,)``.
        pooling: how a bag's embeddings combine (sum or mean).
        precision: how rows are stored (FP32 in the reference collection).
        init_bound: rows start uniform in ``[-init_bound, init_bound]``; ``None`` means
            ``1/sqrt(num_embeddings)`` as in the DLRM reference.

    Raises:
        ValueError: on a non-positive size, an empty name, or an ``init_bound`` that is
            negative, not finite, or past FP16's range for an FP16 table.
    """

    name: str
    num_embeddings: int
    dim: int
    feature_names: tuple[str, ...] = ()
    pooling: PoolingMode = PoolingMode.SUM
    precision: Precision = Precision.FP32
    init_bound: float | None = None

    def __post_init__(self) -> None:
        if not self.name or "." in self.name:
            raise ValueError(
                f"a table needs a name without '.' (it separates the parts of checkpoint "
                f"keys), got {self.name!r}"
            )
        if self.num_embeddings <= 0 or self.dim <= 0:
            raise ValueError(
                f"table {self.name!r}: num_embeddings and dim must be positive, "
                f"got {self.num_embeddings} x {self.dim}"
            )
        if not self.feature_names:
            object.__setattr__(self, "feature_names", (self.name,))
        else:
            object.__setattr__(self, "feature_names", tuple(self.feature_names))
        object.__setattr__(self, "pooling", PoolingMode.parse(self.pooling))
        object.__setattr__(self, "precision", Precision.parse(self.precision))
        if self.init_bound is not None:
            # FP16 rows start rounded to nearest: past its largest value they would be inf;
            # INT8/INT4 rows keep their scale and bias in FP16 and saturate there.
            fp16_range = self.precision in (Precision.FP16, Precision.INT8, Precision.INT4)
            top = 65504.0 if fp16_range else math.inf
            if not 0 <= self.init_bound < math.inf or self.init_bound > top:
                raise ValueError(
                    f"table {self.name!r}: init_bound must be finite, >= 0 and, for FP16, "
                    f"INT8 and INT4 rows, <= 65504; got {self.init_bound}"
                )

    @property
    def bound(self) -> float:
        """The half-width of the uniform initialization."""
        if self.init_bound is not None:
            return self.init_bound
        return 1.0 / math.sqrt(self.num_embeddings)


@dataclass(frozen=True, kw_only=True)
class TableSlice:
    """Where a local table (a shard) sits in the global table it was cut from.

    A sharded layout holds each table as blocks of rows and columns; the local table
    of a block is ``TableConfig(rows=row_stop - row_start, dim=col_stop - col_start)``
    and its ``TableSlice`` says which block it is. Initial weights and the random
    stream of stochastic rounding are functions of the *global* row and column, so a
    block starts and rounds exactly as the same cells of the unsharded table.

    Args:
        table: the global (unsharded) table.
        row_start: the global row of the local table's row 0.
        col_start: the global column of the local table's column 0.

    Raises:
        ValueError: for a negative offset.
    """

    table: TableConfig
    row_start: int = 0
    col_start: int = 0

    def __post_init__(self) -> None:
        if self.row_start < 0 or self.col_start < 0:
            raise ValueError(f"negative shard offsets in {self}")

    def row_key(self) -> int:
        """Stochastic-rounding key of the local row 0: ``key(table name) + row_start``.

        Row ``r`` of the local table rounds with key ``row_key() + r``, the key of the
        same global row in the unsharded table. The name's key is a stable 61-bit hash,
        so sums stay below 2^63 for any row count.
        """
        digest = hashlib.blake2b(self.table.name.encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 3) + self.row_start


def feature_order(tables: tuple[TableConfig, ...] | list[TableConfig]) -> tuple[str, ...]:
    """Feature names in output order: tables in order, each table's features in order.

    Raises:
        ValueError: if a feature or table name appears twice.
    """
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate table names in {names}")
    feats = [f for t in tables for f in t.feature_names]
    if len(set(feats)) != len(feats):
        raise ValueError(f"a feature looks up more than one table: {feats}")
    return tuple(feats)


@dataclass(frozen=True, kw_only=True)
class SparseOptimizerSpec:
    """The optimizer applied to embedding rows (fused in backward, or as a sparse step).

    Args:
        kind: the update rule.
        lr: learning rate (schedules scale it at run time).
        eps: the denominator's epsilon (Adagrad and Adam families).
        beta1: Adam's first-moment decay.
        beta2: Adam's second-moment decay.
        weight_decay: L2 penalty added to the gradient of the touched rows
            (``g' = g + weight_decay * w``, as in ``torch.optim``: coupled L2, not
            AdamW's decay) before the update rule, so ``g'`` is what every state
            accumulates: row-wise Adagrad's per-row sum adds ``mean(g'^2)``, Adam's
            moments take ``g'``. Lazy: rows a step does not touch are neither decayed
            nor have their state changed, so frequent ids are decayed more often
            (``docs/training.md``). The reference embedding applies it only with
            ``rowwise_adagrad``; the fused one with every kind.
        initial_accumulator: Adagrad's starting state value.
    """

    kind: OptimizerKind = OptimizerKind.ROWWISE_ADAGRAD
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OptimizerKind.parse(self.kind))
        bad = bad_sparse_hparams(
            lr=self.lr,
            eps=self.eps,
            betas=(self.beta1, self.beta2),
            weight_decay=self.weight_decay,
            initial_accumulator=self.initial_accumulator,
        )
        if bad:
            raise ValueError(f"bad sparse optimizer settings {bad} ({SPARSE_HPARAM_RULES})")


#: What ``bad_sparse_hparams`` checks, for messages.
SPARSE_HPARAM_RULES = (
    "lr >= 0, eps > 0, weight_decay >= 0, initial_accumulator >= 0, all finite; 0 <= betas < 1"
)


def bad_sparse_hparams(
    *,
    lr: float,
    eps: float,
    betas: tuple[float, float],
    weight_decay: float,
    initial_accumulator: float = 0.0,
) -> dict[str, Any]:
    """The settings that break ``SPARSE_HPARAM_RULES``, by name (empty when all hold).

    Written so that NaN fails every rule (``nan >= 0`` is false), and infinity the
    finite ones: either would write NaN or infinity into every row a step touches.
    """
    checks: tuple[tuple[str, Any, bool], ...] = (
        ("lr", lr, 0 <= lr < math.inf),
        ("eps", eps, 0 < eps < math.inf),
        ("weight_decay", weight_decay, 0 <= weight_decay < math.inf),
        ("initial_accumulator", initial_accumulator, 0 <= initial_accumulator < math.inf),
        ("betas", betas, all(0 <= b < 1 for b in betas)),
    )
    return {name: value for name, value, ok in checks if not ok}
