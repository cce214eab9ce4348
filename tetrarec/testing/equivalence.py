"""Sharded equals unsharded: the equivalence recipe of every sharding test.

1. The reference is the one-process ``FusedEmbeddingBagCollection`` with the same seed
   (its rows start as every layout's do: ``init_rows``).
2. Each rank builds the ``ShardedEmbeddingBagCollection`` of a *given* plan.
3. Every step draws one global batch (and the gradient of its pooled output); each rank
   takes its slice of the samples, the reference takes all.
4. K >= 2 steps run on both; each rank returns its pooled rows, its blocks' rows
   (decoded to FP32) and optimizer state, and where each block sits.
5. ``compare`` puts the blocks back together (``unshard``) and checks outputs, rows and
   optimizer state against the reference: exactly where only data moves, within
   ``tolerance`` where partial sums are added in another order; a rank's whole cached
   tables (table-wise, data-parallel) must also count as the reference's caches.

``EquivalenceCase`` is one frozen value, so a worker takes one argument per case and a
spawn can run a list of cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.sharding import (
    LookupOptions,
    ShardedEmbeddingBagCollection,
    ShardingEnv,
    ShardingPlan,
    TablePlacement,
    plan_by_type,
    shard_collection,
)
from tetrarec.sharding.state_dict import local_blocks, unshard
from tetrarec.sparse import SparseFeatures
from tetrarec.testing.multiprocess import RankContext
from tetrarec.types import OptimizerKind, Placement, ShardingType

__all__ = [
    "EquivalenceCase",
    "bad_id_worker",
    "compare",
    "global_batch",
    "rank_slice",
    "reference_run",
    "sharded_cases_worker",
]


@dataclass(frozen=True, kw_only=True)
class EquivalenceCase:
    """One sharded-versus-unsharded check.

    Args:
        name: what the case is (shown in failures).
        tables: the tables.
        types: one sharding type value per table (or one for all); ignored with ``plan``.
        plan: a plan as JSON-compatible data, instead of ``types``.
        optimizer: the fused rule.
        batch_size: the global batch (any size: rank ``r`` takes samples
            ``[r*B//W, (r+1)*B//W)``).
        steps: training steps (K >= 2: optimizer-state bugs show from step 2).
        weighted: per-id weights on the sum-pooled features.
        max_len: the longest bag.
        column_block: the column-wise block width.
        seed: the collection's seed; the batches use ``seed + step``.
        stochastic_rounding: for low-precision rows.
        exact: expect bitwise-equal outputs and rows (pure data movement).
        weight_grad: the per-id weights require grad; their gradient is compared too.
        warm_start_steps: train a one-process collection for this many steps first, then
            shard it (``shard_collection``: rows, optimizer state and rounding copied).
        placement: ``"host"``, or ``"cached"`` / ``"ssd"``: every table's rows behind an
            FP32 cache of ``cache_fraction`` of its rows (LRU); the reference is then the
            one-process ``CachedEmbeddingBagCollection`` and each rank caches its shards.
        cache_fraction: the cached share of each table's (and each shard's) rows.
    """

    name: str
    tables: tuple[TableConfig, ...]
    types: tuple[str, ...] = ()
    plan: dict[str, Any] | None = None
    optimizer: SparseOptimizerSpec = field(default_factory=SparseOptimizerSpec)
    batch_size: int = 12
    steps: int = 2
    weighted: bool = False
    max_len: int = 3
    column_block: int | None = None
    seed: int = 3
    stochastic_rounding: bool = True
    exact: bool = False
    weight_grad: bool = False
    warm_start_steps: int = 0
    placement: str = "host"
    cache_fraction: float = 0.0

    def sharding_plan(self, world_size: int, local_world_size: int) -> ShardingPlan:
        """The case's plan for this world (with the case's placement on every table)."""
        if self.plan is not None:
            plan = ShardingPlan.from_dict(self.plan)
        else:
            kinds = [ShardingType.parse(t) for t in self.types]
            types: ShardingType | list[ShardingType] = kinds[0] if len(kinds) == 1 else kinds
            plan = plan_by_type(
                self.tables,
                types,
                world_size=world_size,
                local_world_size=local_world_size,
                column_block=self.column_block,
            )
        if self.placement == "host":
            return plan
        precision = {t.name: t.precision for t in self.tables}
        placed = tuple(
            replace(
                tp,
                placement=TablePlacement(
                    placement=Placement.parse(self.placement),
                    cache_fraction=self.cache_fraction,
                    precision=precision[tp.table],
                ),
            )
            for tp in plan.tables
        )
        return replace(plan, tables=placed)

    def one_process(self) -> FusedEmbeddingBagCollection | CachedEmbeddingBagCollection:
        """The reference collection (the same seed as every layout)."""
        if self.placement == "host":
            return FusedEmbeddingBagCollection(
                self.tables,
                self.optimizer,
                seed=self.seed,
                stochastic_rounding=self.stochastic_rounding,
            )
        return CachedEmbeddingBagCollection(
            self.tables,
            self.optimizer,
            CacheSpec(fraction=self.cache_fraction),
            placements={t.name: self.placement for t in self.tables},
            seed=self.seed,
            stochastic_rounding=self.stochastic_rounding,
        )


Bags = dict[str, list[list[int]]]


def global_batch(case: EquivalenceCase, step: int) -> tuple[Bags, Bags | None, torch.Tensor]:
    """The bags (and weights) of step ``step`` and the gradient of its pooled output."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + step)
    bags: Bags = {}
    weights: Bags = {}
    for t in case.tables:
        for f in t.feature_names:
            lens = torch.randint(0, case.max_len + 1, (case.batch_size,), generator=gen).tolist()
            # Draw from the first half of the rows so that some rows are never touched.
            high = min(t.num_embeddings, (t.num_embeddings + 1) // 2 + step)
            bags[f] = [torch.randint(0, high, (n,), generator=gen).tolist() for n in lens]
            weights[f] = [torch.rand(n, generator=gen).tolist() for n in lens]
    dim = sum(t.dim for t in case.tables for _ in t.feature_names)
    grad = torch.randn(case.batch_size, dim, generator=gen)
    weighted = case.weighted and all(t.pooling.value == "sum" for t in case.tables)
    return bags, (weights if weighted else None), grad


def rank_slice(bags: Bags, weights: Bags | None, rank: int, world_size: int) -> SparseFeatures:
    """Rank ``rank``'s contiguous slice of the samples, as ``SparseFeatures``."""
    b = len(next(iter(bags.values())))
    lo, hi = rank * b // world_size, (rank + 1) * b // world_size
    mine = {k: v[lo:hi] for k, v in bags.items()}
    w = {k: v[lo:hi] for k, v in weights.items()} if weights is not None else None
    return SparseFeatures.from_lists(mine, weights=w)


def _run_case(ctx: RankContext, case: EquivalenceCase) -> dict[str, Any]:
    env = ShardingEnv(ctx.comm, ctx.local_world_size)
    plan = case.sharding_plan(ctx.world_size, ctx.local_world_size)
    options = LookupOptions(
        optimizer=case.optimizer,
        seed=case.seed,
        stochastic_rounding=case.stochastic_rounding,
        cache=CacheSpec(fraction=case.cache_fraction) if case.placement != "host" else None,
    )
    outputs: list[torch.Tensor] = []
    weight_grads: list[torch.Tensor] = []
    if case.warm_start_steps:
        # Train a one-process collection on the whole batches first (every rank alike),
        # then shard it: its rows, optimizer state and rounding stream must carry over.
        whole = FusedEmbeddingBagCollection(
            case.tables,
            case.optimizer,
            seed=case.seed,
            stochastic_rounding=case.stochastic_rounding,
        )
        b = case.batch_size
        lo, hi = ctx.rank * b // ctx.world_size, (ctx.rank + 1) * b // ctx.world_size
        for step in range(case.warm_start_steps):
            bags, weights, grad = global_batch(case, step)
            out = whole(SparseFeatures.from_lists(bags, weights=weights)).values
            outputs.append(out.detach()[lo:hi].clone())
            torch.autograd.backward(out, grad)
        module = shard_collection(whole, plan, env)
    else:
        module = ShardedEmbeddingBagCollection(case.tables, plan, env, options)
    for step in range(case.warm_start_steps, case.steps):
        bags, weights, grad = global_batch(case, step)
        sf = _with_weight_grad(rank_slice(bags, weights, ctx.rank, ctx.world_size), case)
        b = grad.shape[0]
        lo, hi = ctx.rank * b // ctx.world_size, (ctx.rank + 1) * b // ctx.world_size
        out = module(sf).values
        outputs.append(out.detach().clone())
        torch.autograd.backward(out, grad[lo:hi])
        if sf.weights is not None and sf.weights.grad is not None:
            weight_grads.append(sf.weights.grad.clone())
    with torch.no_grad():  # an evaluation pass after training: the updated rows
        bags, weights, _ = global_batch(case, case.steps)
        outputs.append(module(rank_slice(bags, weights, ctx.rank, ctx.world_size)).values)
    stats = {k: (v.calls, v.bytes_sent) for k, v in ctx.comm.stats.items()}
    return {
        "outputs": outputs,
        "weight_grads": weight_grads,
        **local_blocks(module),
        "stats": stats,
        "cache_stats": module.cache_stats(),
    }


def _with_weight_grad(sf: SparseFeatures, case: EquivalenceCase) -> SparseFeatures:
    if not case.weight_grad or sf.weights is None:
        return sf
    w = sf.weights.clone().requires_grad_()
    return SparseFeatures(sf.keys, sf.values, sf.lengths, sf.batch_size, w, sf.value_counts)


def sharded_cases_worker(ctx: RankContext, cases: Sequence[EquivalenceCase]) -> list[Any]:
    """Run every case on this rank; one result (or the error text) per case."""
    results: list[Any] = []
    for case in cases:
        results.append(_run_case(ctx, case))
        ctx.comm.reset_stats()
    return results


def reference_run(case: EquivalenceCase) -> dict[str, Any]:
    """The one-process run of ``case``: outputs, rows and optimizer state."""
    module = case.one_process()
    outputs, weight_grads = [], []
    for step in range(case.steps):
        bags, weights, grad = global_batch(case, step)
        sf = _with_weight_grad(SparseFeatures.from_lists(bags, weights=weights), case)
        out = module(sf).values
        outputs.append(out.detach().clone())
        torch.autograd.backward(out, grad)
        if sf.weights is not None and sf.weights.grad is not None:
            weight_grads.append((bags, sf.weights.grad.clone()))
    with torch.no_grad():
        bags, weights, _ = global_batch(case, case.steps)
        outputs.append(module(SparseFeatures.from_lists(bags, weights=weights)).values)
    state = module.fused_optimizer.state_dict()["state"]
    return {
        "outputs": outputs,
        "weight_grads": weight_grads,
        "cache_stats": module.cache_stats(),  # {} from a module without a cache
        "weights": module.table_weights(),
        "state": {t: {k: v.clone() for k, v in s.items()} for t, s in state.items()},
    }


def _key_major(bags: Bags, per_rank: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Per-id values of every rank's slice, laid out key-major over the global batch."""
    pieces: list[list[torch.Tensor]] = []
    for r, values in enumerate(per_rank):
        sizes = []
        for bag_list in bags.values():
            b = len(bag_list)
            lo, hi = r * b // world, (r + 1) * b // world
            sizes.append(sum(len(x) for x in bag_list[lo:hi]))
        pieces.append(list(torch.split(values, sizes)))
    return torch.cat([pieces[r][f] for f in range(len(bags)) for r in range(world)])


def compare(
    case: EquivalenceCase,
    per_rank: Sequence[dict[str, Any]],
    reference: dict[str, Any],
    *,
    rtol: float,
    atol: float,
) -> list[str]:
    """Differences between the sharded run (every rank's result) and the reference.

    Returns:
        One line per mismatch (empty when equal within the tolerance, or bitwise when
        ``case.exact``).
    """
    world = len(per_rank)
    bad: list[str] = []

    def close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if case.exact:
            if not torch.equal(got, want):
                diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
                bad.append(f"{case.name}: {what} differs (max abs diff {diff})")
            return
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as e:
            bad.append(f"{case.name}: {what}: {str(e).splitlines()[0]} {str(e).splitlines()[2:4]}")

    for step, want in enumerate(reference["outputs"]):
        got = torch.cat([per_rank[r]["outputs"][step] for r in range(world)])
        close(f"pooled output of step {step}", got, want)
    for step, (bags, want) in enumerate(reference["weight_grads"]):
        got_parts = [per_rank[r]["weight_grads"][step] for r in range(world)]
        # A weight's gradient is a dot product over the row's columns: for column blocks
        # the blocks' partial dots are added, so it is compared within the tolerance.
        got = _key_major(bags, got_parts, world)
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as e:
            bad.append(f"{case.name}: per-id weight gradient of step {step}: {e}")
    if case.weight_grad and not reference["weight_grads"]:
        bad.append(f"{case.name}: the reference computed no per-id weight gradient")
    for r, res in enumerate(per_rank):
        # A rank's whole table (table-wise, a data-parallel replica) or column block
        # ("<table>@c<col>": every row, every id) decides and counts as the one-process
        # cache; row blocks ("@r") count their own rows' lookups and are not compared.
        for name, stats in res.get("cache_stats", {}).items():
            want_stats = reference.get("cache_stats", {}).get(name.split("@c")[0])
            if want_stats is not None and stats != replace(want_stats, table=name):
                bad.append(
                    f"{case.name}: cache counters of {name} on rank {r}: {stats}, "
                    f"one process: {want_stats}"
                )
    weights, state, problems = unshard(case.tables, per_rank)
    bad.extend(f"{case.name}: {p}" for p in problems)
    for name, want in reference["weights"].items():
        close(f"rows of {name}", weights[name], want)
    for name, names in reference["state"].items():
        for key, want in names.items():
            found = state.get(name, {}).get(key)
            if found is None:
                bad.append(f"{case.name}: no optimizer state {name}.{key}")
                continue
            close(f"optimizer state {name}.{key}", found, want)
    return bad


def bad_id_worker(ctx: RankContext, cases: Sequence[tuple[str, int]]) -> list[str]:
    """Per ``(sharding type, bad id)``: the error this rank raised (``""`` if none).

    Rank 1 looks up the bad id of feature ``b`` through a collection sharded so.
    """
    tables = (
        TableConfig(name="a", num_embeddings=10, dim=4),
        TableConfig(name="b", num_embeddings=7, dim=4),
    )
    env = ShardingEnv(ctx.comm, ctx.local_world_size)
    options = LookupOptions(optimizer=SparseOptimizerSpec(kind=OptimizerKind.SGD, lr=0.1), seed=0)
    out = []
    for kind, bad in cases:
        plan = plan_by_type(tables, ShardingType.parse(kind), world_size=ctx.world_size)
        module = ShardedEmbeddingBagCollection(tables, plan, env, options)
        ids_b = [[1, bad], [2]] if ctx.rank == 1 else [[1], [2, 3]]
        try:
            module(SparseFeatures.from_lists({"a": [[0], [9]], "b": ids_b}))
            out.append("")
        except ValueError as e:
            out.append(str(e))
    return out
