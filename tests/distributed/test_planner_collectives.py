"""The cost model counts the collectives the sharded runtime really calls.

Each collective costs a fixed latency in the model (``latency_collectives``); a strategy
that gains or loses a collective without the model knowing skews every prediction.
"""

from __future__ import annotations

import pytest

from tetrarec.embedding import TableConfig
from tetrarec.planner import TableSpec
from tetrarec.planner.cost import Option, latency_collectives, option_groups
from tetrarec.planner.topology import Tier
from tetrarec.sharding import plan_by_type
from tetrarec.testing import run_ranks
from tetrarec.testing.planner_workers import collectives_per_step_worker
from tetrarec.types import OptimizerKind, Precision, ShardingType

pytestmark = pytest.mark.distributed

TW, RW, CW, DP = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.DATA_PARALLEL,
)
PLANS = {
    "tw": [TW] * 4,
    "rw": [RW] * 4,
    "cw": [CW] * 4,
    "dp": [DP] * 4,
    "mixed": [TW, RW, CW, DP],
    "tw_dp": [TW, TW, DP, DP],
}


@pytest.mark.timeout(600)
def test_collectives_per_step_match_the_cost_model():
    """Catches a sharding type whose runtime collectives differ from what the cost model
    charges latency for (e.g. the column blocks' row-wise state exchange)."""
    tables = [TableConfig(name=f"t{i}", num_embeddings=20 + i, dim=8) for i in range(4)]
    plans = {
        name: plan_by_type(tables, types, world_size=2).to_dict() for name, types in PLANS.items()
    }
    kinds = (OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.SGD)
    got = run_ranks(
        collectives_per_step_worker, world_size=2, args=(tables, kinds, plans), timeout_s=540
    )
    for k, kind in enumerate(kinds):
        for name, types in PLANS.items():
            groups: set[str] = set()
            for t, s in zip(tables, types):
                spec = TableSpec(name=t.name, rows=t.num_embeddings, dim=t.dim,
                                 features=(t.name,), optimizer=kind)  # fmt: skip
                blocks = 2 if s in (CW, DP, RW) else 1
                opt = Option(sharding=s, blocks=blocks, tier=Tier.HOST, precision=Precision.FP32)
                groups |= option_groups(spec, opt)
            want = latency_collectives(groups)
            for rank, counts in enumerate(got):
                have = counts[k][name]
                assert have == want, f"{kind.value} {name} on rank {rank}: {have} != {want}"
