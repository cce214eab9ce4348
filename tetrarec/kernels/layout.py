"""Where each table lives in the flat row stores of a fused collection.

Tables are grouped by row precision; each group is one ``RowStore``: one flat storage
tensor holding its tables back to back, plus one flat FP32 tensor per optimizer state::

    store "fp32", tables t0 (E0 x D0) and t2 (E2 x D2):
      weights  [ t0 row 0 .. t0 row E0-1 | t2 row 0 .. t2 row E2-1 ]
      w_offsets  = [0, E0*D0]         (storage elements)
      row_offsets = [0, E0]           (rows; numbering of the fused backward)
      state "sum" (row-wise Adagrad)  [ E0 values | E2 values ],  offsets [0, E0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tetrarec.embedding import TableConfig, TableSlice
from tetrarec.kernels.optim_rules import state_layout
from tetrarec.kernels.quant import row_width
from tetrarec.types import OptimizerKind, Precision

__all__ = ["RowStore", "plan_stores"]


@dataclass(frozen=True, kw_only=True)
class RowStore:
    """The layout of one store (host data; tensors are built by ``meta``).

    Args:
        precision: row precision of every table in the store.
        tables: indices of the store's tables in the collection.
        w_offsets: first storage element of each table.
        row_offsets: first row of each table.
        state_names: optimizer state names, in ``state_layout`` order.
        state_offsets: per state name, the first element of each table.
        numel: storage elements in all.
        state_numel: elements of each state tensor.
    """

    precision: Precision
    tables: tuple[int, ...]
    w_offsets: tuple[int, ...]
    row_offsets: tuple[int, ...]
    state_names: tuple[str, ...]
    state_offsets: tuple[tuple[int, ...], ...]
    numel: int
    state_numel: tuple[int, ...]

    def meta(
        self,
        all_tables: Sequence[TableConfig],
        slices: Sequence[TableSlice],
        device: torch.device | None,
    ) -> list[torch.Tensor]:
        """The 9 int64 meta tensors of ``ops.py`` for this store.

        Args:
            all_tables: every (local) table of the collection.
            slices: where each of them sits in its global table.
            device: where the tensors go.
        """
        mine = [all_tables[i] for i in self.tables]
        placed = [slices[i] for i in self.tables]
        local = {i: k for k, i in enumerate(self.tables)}
        feat_table, feat_cols, feat_mean, col = [], [], [], 0
        for i, t in enumerate(all_tables):
            for _ in t.feature_names:
                feat_table.append(local.get(i, -1))
                feat_cols.append(col)
                feat_mean.append(int(t.pooling.value == "mean"))
                col += t.dim
        rows = [
            list(self.w_offsets),
            [t.dim for t in mine],
            [t.num_embeddings for t in mine],
            list(self.row_offsets),
            feat_table,
            feat_cols,
            feat_mean,
            [s.row_key() for s in placed],
            [s.col_start for s in placed],
        ]
        return [torch.tensor(r, dtype=torch.int64, device=device) for r in rows]


def _plan_one(
    precision: Precision, indices: list[int], tables: Sequence[TableConfig], kind: OptimizerKind
) -> RowStore:
    w_off, r_off, numel, nrows = [], [], 0, 0
    names = tuple(state_layout(kind, 1))
    st_off: list[list[int]] = [[] for _ in names]
    st_numel = [0 for _ in names]
    for i in indices:
        t = tables[i]
        w_off.append(numel)
        r_off.append(nrows)
        numel += t.num_embeddings * row_width(precision, t.dim)
        nrows += t.num_embeddings
        for k, width in enumerate(state_layout(kind, t.dim).values()):
            st_off[k].append(st_numel[k])
            st_numel[k] += t.num_embeddings * width
    return RowStore(
        precision=precision,
        tables=tuple(indices),
        w_offsets=tuple(w_off),
        row_offsets=tuple(r_off),
        state_names=names,
        state_offsets=tuple(tuple(o) for o in st_off),
        numel=numel,
        state_numel=tuple(st_numel),
    )


def plan_stores(tables: Sequence[TableConfig], kind: OptimizerKind) -> tuple[RowStore, ...]:
    """One ``RowStore`` per distinct precision, in order of first appearance.

    Raises:
        ValueError: for a precision the row store does not support (FP8).
    """
    groups: dict[Precision, list[int]] = {}
    for i, t in enumerate(tables):
        row_width(t.precision, t.dim)  # validates the precision
        groups.setdefault(t.precision, []).append(i)
    return tuple(_plan_one(p, idx, tables, kind) for p, idx in groups.items())
