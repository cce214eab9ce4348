"""``TableConfig``: the one source of truth for an embedding table's shape."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from tetrarec.types import OptimizerKind, PoolingMode, Precision

__all__ = ["SparseOptimizerSpec", "TableConfig", "TableSlice", "feature_order"]


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
        ValueError: on a non-positive size or an empty name.
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
        bad = {
            name: value
            for name, value, ok in (
                ("lr", self.lr, self.lr >= 0),
                ("eps", self.eps, self.eps > 0),
                ("weight_decay", self.weight_decay, self.weight_decay >= 0),
            )
            if not ok
        }
        if bad:
            raise ValueError(
                f"bad sparse optimizer settings {bad} (lr >= 0, eps > 0, weight_decay >= 0)"
            )
