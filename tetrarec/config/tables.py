"""The tables of a run's model, from its config: what the planner, a plan and training see.

``build_tables`` gives the embedding collection's tables (one per sparse feature);
``model_tables`` adds the model's own tables (a first-order term's,
``tetrarec.models.first_order_tables``), so that a plan places every table the model has
and the planner counts them all. ``fixed_placements`` gives the placements the config
fixes (its ``cached`` and ``ssd`` tables), which a sharded run and the planner both keep.

These live below both ``planner/`` and ``train/`` (each reads them), so neither imports
the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetrarec.config.model import ModelConfig
from tetrarec.embedding import TableConfig
from tetrarec.models import first_order_tables
from tetrarec.sharding.plan import TablePlacement
from tetrarec.sharding.strategy import STRATEGIES, Split, baseline
from tetrarec.types import OptimizerKind, Placement, ShardingType

__all__ = ["build_tables", "fixed_placements", "model_tables", "table_sharding_types"]


def build_tables(model: ModelConfig) -> tuple[TableConfig, ...]:
    """One table per sparse feature, named ``C1``, ``C2``, ... (the Criteo names).

    Data sources map their i-th categorical input to the i-th table. These are the
    embedding collection's tables; ``model_tables`` adds the model's own (first-order).
    """
    return tuple(
        TableConfig(
            name=f"C{i + 1}",
            num_embeddings=rows,
            dim=model.embedding_dim,
            pooling=model.pooling,
            precision=model.precision,
        )
        for i, rows in enumerate(model.table_rows)
    )


def model_tables(model: ModelConfig) -> tuple[TableConfig, ...]:
    """Every table of the run's model: ``build_tables``, then the first-order term's.

    With ``model.dlrm.first_order`` the term's dim-1 tables (``first_order_tables``, in
    the same order) follow the embedding tables: a plan places them, the planner counts
    them, a sharded run shards them (``shard_model``) like the others.
    """
    tables = build_tables(model)
    return tables + (first_order_tables(tables) if model.dlrm.first_order else ())


def table_sharding_types(
    model: ModelConfig, types: ShardingType | Sequence[ShardingType]
) -> tuple[ShardingType, ...]:
    """``sharding.type`` for every table of ``model_tables``, one type per table.

    One type is every embedding table's; a list gives one per embedding table. Each
    first-order table takes its embedding table's type, except that a type splitting
    columns (column-wise, table-column-wise) places it whole (the registry's baseline,
    table-wise): a dim-1 table has no columns to split, and ``sharding.column_block``
    would not divide it.
    """
    tables = build_tables(model)
    kinds = (types,) * len(tables) if isinstance(types, ShardingType) else tuple(types)
    if len(kinds) == 1:
        kinds *= len(tables)
    if not model.dlrm.first_order:
        return kinds
    whole = baseline().sharding_type
    return kinds + tuple(whole if STRATEGIES[k].cost.split is Split.COLUMNS else k for k in kinds)


def fixed_placements(model: ModelConfig, kind: OptimizerKind) -> dict[str, TablePlacement]:
    """The placements the config fixes: its ``cached`` and ``ssd`` tables, by name.

    A sharded run keeps them whatever its plan says, and the planner plans them so. The
    cache size is ``[model.cache]``'s fraction, or for a byte budget the slots one
    process would give each table (``CacheSpec.capacities``, with ``kind``'s optimizer
    state per slot) as a fraction of its rows: a whole table's shard gets exactly those
    slots, a row block its share (never more in all), so the budget holds for the tables
    together, not again per rank or per sharding group. (The fraction is
    ``(slots + 1/2) / rows``: ``floor(fraction * rows)`` is then exactly ``slots``, where
    ``slots / rows`` could round to one slot fewer.)
    """
    tables = build_tables(model)
    fixed = [
        (t, p)
        for t, p in zip(tables, model.table_placements, strict=True)
        if p in (Placement.CACHED, Placement.SSD)
    ]
    if not fixed:
        return {}
    if model.cache.fraction is not None:
        fractions = {t.name: model.cache.fraction for t, _ in fixed}
    else:
        slots = model.cache.spec().capacities([t for t, _ in fixed], kind)
        fractions = {
            t.name: min(1.0, (slots[t.name] + 0.5) / t.num_embeddings) if slots[t.name] else 0.0
            for t, _ in fixed
        }
    return {
        t.name: TablePlacement(placement=p, cache_fraction=fractions[t.name], precision=t.precision)
        for t, p in fixed
    }
