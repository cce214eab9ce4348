"""Sharded training end to end on gloo ranks: equal to one process, bitwise resume, and
clear errors on every rank for inputs that would otherwise hang or mislead.

One spawn of 2 ranks runs every scenario in turn (each is a whole ``train`` call).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tetrarec.config import RunConfig
from tetrarec.sharding import ShardingPlan, plan_by_type
from tetrarec.testing import run_ranks
from tetrarec.testing.train_workers import Scenario, train_worker
from tetrarec.train import build_tables, latest_checkpoint, read_checkpoint, train
from tetrarec.types import ShardingType

pytestmark = pytest.mark.distributed

TINY = (
    "data.source=synthetic",
    "data.batch_size=48",
    "data.eval_batch_size=96",
    "data.prefetch=1",
    "data.synthetic.num_samples=480",
    "data.synthetic.eval_samples=289",  # the last eval batch: 1 row, none for rank 1
    "model.num_sparse=4",
    "model.num_embeddings=[50, 21, 7, 101]",
    "model.dlrm.bottom_mlp=[16, 8]",
    "model.dlrm.top_mlp=[16, 1]",
    "optim.dense=sgd",  # SGD: Adagrad's step would hide a wrongly scaled gradient
    "optim.dense_lr=0.1",
    "optim.sparse.kind=rowwise_adagrad",
    "optim.sparse.lr=0.1",
    "train.steps=6",
    "train.deterministic=true",
    "train.progress=false",
    "train.log_every=0",
    "sharding.timeout_s=30",
)
MIXED = "sharding.type=[row_wise, column_wise, data_parallel, table_wise]"
# Rows behind FP32 caches of a quarter of each shard's rows (one table's in files), FP16
# backing (INT8 column blocks would quantize each block's columns apart); table-wise and
# column-wise only: their shards see every id of their table, so each rank's cache
# decides as one process's does.
CACHED = (
    "model.placement=[cached, ssd, host, cached]",
    "model.precision=fp16",
    "model.cache.fraction=0.25",
    "optim.sparse.kind=adagrad",
    "sharding.type=[table_wise, table_wise, column_wise, column_wise]",
)
# The same with a byte budget for the cached tables together: 2752 B of 64 B slots (FP32
# row of dim 8 and its Adagrad sums) over 50 + 21 + 101 rows, one process's C1 12 slots,
# C2 5, C4 25.
CACHED_BYTES = (*CACHED[:2], "model.cache.bytes=2752", *CACHED[3:])
# Cached data-parallel replicas (INT8 rows, one replicated table's rows in files) beside a
# cached table-wise table: every replica runs the global batch's policy step.
CACHED_DP = (
    "model.placement=[cached, cached, host, ssd]",
    "model.precision=int8",
    "model.cache.fraction=0.25",
    "sharding.type=[data_parallel, table_wise, data_parallel, data_parallel]",
)
# The static policy: every rank counts its slice of the first 3 global batches and the
# counts are summed, so whole tables (replicated, table-wise) pin one process's rows.
STATIC = (
    "model.placement=[cached, cached, host, ssd]",
    "model.precision=int8",
    "model.cache.fraction=0.25",
    "model.cache.policy=static",
    "model.cache.static_sample_batches=3",
    "sharding.type=[data_parallel, table_wise, row_wise, data_parallel]",
)
# The first-order term (a weight per row and per dense input, Adagrad): its dim-1 tables
# are planned and sharded as their embedding tables are (each takes its table's type).
FIRST_ORDER = ("model.dlrm.first_order=true", "model.dlrm.first_order_lr=0.1",
               "model.dlrm.first_order_weight_decay=0.01")  # fmt: skip
# Fitted statistics (every rank must apply rank 0's; a resume must reuse the saved ones).
DENSE = ("data.dense_transform=standardize", "data.dense_clip=[-1.5, 1.5]")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every scenario's result on each of 2 ranks, and the directory they wrote to."""
    tmp = tmp_path_factory.mktemp("sharded")
    bad_plan = plan_by_type(
        build_tables(RunConfig().with_overrides(list(TINY)).model),
        ShardingType.ROW_WISE,
        world_size=3,
    )
    bad_plan.save(tmp / "plan3.json")
    unknown = bad_plan.to_dict()
    unknown["world_size"] = unknown["local_world_size"] = 2
    unknown["tables"][0]["table"] = "nope"
    unknown["tables"][0]["shards"] = [unknown["tables"][0]["shards"][0]]
    (tmp / "unknown.json").write_text(json.dumps(unknown))
    ck = lambda name: f"train.checkpoint_dir={tmp / name}"  # noqa: E731
    scenarios = [
        Scenario("row_wise", (*TINY, "sharding.type=row_wise", "optim.sparse.kind=sgd")),
        Scenario("mixed", (*TINY, MIXED, *DENSE)),
        Scenario("odd_eval_batch", (*TINY, MIXED, "data.eval_batch_size=95")),
        Scenario("straight", (*TINY, MIXED, *DENSE, "optim.sparse.kind=adam",
                              "model.precision=fp16", "train.checkpoint_every=3", ck("straight"))),
        Scenario("first_half", (*TINY, MIXED, *DENSE, "optim.sparse.kind=adam",
                                "model.precision=fp16", "train.steps=3", ck("resumed"))),
        Scenario("second_half", (*TINY, MIXED, *DENSE, "optim.sparse.kind=adam",
                                 "model.precision=fp16", ck("resumed")), resume=True),
        Scenario("stopped_first", (*TINY, MIXED, *DENSE, "optim.sparse.kind=adam",
                                   "model.precision=fp16", ck("stopped")), stop_rank=1),
        Scenario("stopped_second", (*TINY, MIXED, *DENSE, "optim.sparse.kind=adam",
                                    "model.precision=fp16", ck("stopped")), resume=True),
        Scenario("other_plan_on_resume", (*TINY, "sharding.type=row_wise", "optim.sparse.kind=adam",
                                          "model.precision=fp16", ck("resumed")), resume=True),
        Scenario("keep_best", (*TINY, MIXED, "train.eval_every=1", "train.keep_best=log_loss",
                               "train.early_stop_patience=1", "train.checkpoint_every=1",
                               "train.keep_checkpoints=1", "optim.dense_lr=2.0", ck("best"))),
        Scenario("planned", (*TINY, "optim.sparse.kind=sgd", ck("planned"))),
        Scenario("sgd_first_half", (*TINY, "sharding.type=row_wise", "optim.sparse.kind=sgd",
                                    "train.steps=3", ck("sgd"))),
        Scenario("sgd_second_half", (*TINY, "sharding.type=row_wise", "optim.sparse.kind=sgd",
                                     ck("sgd")), resume=True),
        Scenario("cached", (*TINY, *CACHED, "train.checkpoint_every=3", ck("cached"))),
        Scenario("cached_first_half", (*TINY, *CACHED, "train.steps=3", ck("cresumed"))),
        Scenario("cached_second_half", (*TINY, *CACHED, ck("cresumed")), resume=True),
        Scenario("cached_bytes", (*TINY, *CACHED_BYTES, ck("cached_bytes"))),
        Scenario("cached_table_wise", (*TINY, *CACHED[:4], "sharding.type=table_wise",
                                       "train.log_every=2")),  # a collective in the log
        Scenario("cached_dp", (*TINY, *CACHED_DP, "train.checkpoint_every=3", ck("cached_dp"))),
        Scenario("cached_dp_first_half", (*TINY, *CACHED_DP, "train.steps=3", ck("dresumed"))),
        Scenario("cached_dp_second_half", (*TINY, *CACHED_DP, ck("dresumed")), resume=True),
        Scenario("static", (*TINY, *STATIC, ck("static"))),
        Scenario("first_order", (*TINY, MIXED, *FIRST_ORDER, "train.checkpoint_every=3",
                                 ck("fo"))),
        Scenario("first_order_first_half", (*TINY, MIXED, *FIRST_ORDER, "train.steps=3",
                                            ck("foresumed"))),
        Scenario("first_order_second_half", (*TINY, MIXED, *FIRST_ORDER, ck("foresumed")),
                 resume=True),
        Scenario("first_order_row_wise", (*TINY, "sharding.type=row_wise", *FIRST_ORDER)),
        Scenario("first_order_cached", (*TINY, *CACHED, *FIRST_ORDER)),
        Scenario("first_order_planned", (*TINY, *FIRST_ORDER, "optim.sparse.kind=sgd")),
        Scenario("uneven_batch", (*TINY, MIXED, *FIRST_ORDER, "data.batch_size=47")),
        Scenario("rank_1_other_config", TINY, rank_overrides=((1, ("optim.sparse.lr=0.2",)),)),
        Scenario("unknown_table", (*TINY, f"sharding.plan={tmp / 'unknown.json'}")),
        Scenario("block_not_dividing", (*TINY, "sharding.type=column_wise",
                                        "sharding.column_block=3")),
        Scenario("plan_for_3_ranks", (*TINY, f"sharding.plan={tmp / 'plan3.json'}")),
        Scenario("missing_stats", (*TINY, f"sharding.stats={tmp / 'nope.json'}")),
    ]  # fmt: skip
    results = run_ranks(train_worker, world_size=2, args=(scenarios,), timeout_s=540)
    return {sc.name: [r[i] for r in results] for i, sc in enumerate(scenarios)}, tmp


def one_process(*extra: str) -> dict:
    return train(RunConfig().with_overrides([*TINY, *extra])).to_dict()


def assert_one_process_metrics(per_rank: list[dict], extra: tuple[str, ...]) -> None:
    """Every rank's final evaluation is one process's (log loss 1e-5, AUC 1e-4)."""
    ref = one_process(*extra)["final"]
    for rank, res in enumerate(per_rank):
        assert res["ok"], res
        got = res["final"]
        assert got["num_samples"] == ref["num_samples"] == 289, rank
        assert abs(got["log_loss"] - ref["log_loss"]) < 1e-5, (rank, got, ref)
        assert abs(got["auc"] - ref["auc"]) < 1e-4, (rank, got, ref)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("name", "extra"), [("row_wise", ("optim.sparse.kind=sgd",)), ("mixed", DENSE)]
)
def test_sharded_training_ends_with_one_process_metrics(two_ranks, name, extra):
    """Bugs caught: a rank's samples trained twice or never, dense gradients averaged
    instead of summed (half the step), eval over rank 0's slice only, ranks fitting or
    applying other dense statistics than one process."""
    results, _ = two_ranks
    assert_one_process_metrics(results[name], extra)


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("first_order", (MIXED, *FIRST_ORDER)),
        ("first_order_row_wise", ("sharding.type=row_wise", *FIRST_ORDER)),
        ("first_order_cached", (*CACHED, *FIRST_ORDER)),
        ("first_order_planned", (*FIRST_ORDER, "optim.sparse.kind=sgd")),
    ],
)
def test_a_first_order_term_shards_and_trains_as_one_process(two_ranks, name, extra):
    """The first-order term's tables are sharded like the model's (a mixed plan, row-wise,
    beside cached tables, and the planner's plan). Bugs caught: the term's rows left
    replicated and updated with one rank's gradients only, its tables missing from the
    plan (refused), a rank's first-order rows looked up for another rank's samples, or
    a first-order table given another optimizer than one process's Adagrad."""
    results, _ = two_ranks
    assert_one_process_metrics(results[name], extra)


def test_a_global_batch_that_does_not_divide_by_the_ranks_trains_as_one_process(two_ranks):
    """A batch of 47 on 2 ranks (24 and 23 samples). Bugs caught: the batch refused (the
    recipes' batches could not train on 3 ranks), a rank's loss scaled by its own slice
    instead of the global batch, a collective sized for equal slices."""
    results, _ = two_ranks
    assert_one_process_metrics(results["uneven_batch"], (MIXED, *FIRST_ORDER, "data.batch_size=47"))


def test_a_sharded_first_order_term_resumes_bitwise_from_each_ranks_blocks(two_ranks):
    """Each rank writes its own first-order blocks and their Adagrad sums; rank 0 writes
    the term's dense weights once. Bugs caught: the term's rows saved by rank 0 only (the
    other rank's blocks lost), its Adagrad state not saved, a rank loading rank 0's
    blocks on resume."""
    results, tmp = two_ranks
    for name in ("first_order", "first_order_first_half", "first_order_second_half"):
        assert all(r["ok"] for r in results[name]), results[name]
    a, b = tmp / "fo" / "step_00000006", tmp / "foresumed" / "step_00000006"
    for f in ("rank_00000.safetensors", "rank_00001.safetensors", "tensors.safetensors"):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert ta.keys() == tb.keys(), f
        for k in ta:
            assert (ta[k] == tb[k]).all(), (f, k)
    dense = load_file(str(a / "tensors.safetensors"))
    assert "model.first_order.dense.weight" in dense
    assert not any(k.startswith("model.first_order.rows.") for k in dense)
    for r in (0, 1):
        mine = load_file(str(a / f"rank_0000{r}.safetensors"))
        assert any(k.startswith("model.first_order.rows.") for k in mine), r
        assert any(k.startswith("model.first_order.optim.") for k in mine), r
        assert "model.first_order.dense.weight" not in mine
    meta = json.loads((a / "meta.json").read_text())["sharding"]
    planned = {t["table"] for t in meta["plan"]["tables"]}
    assert {"C1_first_order", "C4_first_order"} <= planned
    held = {e["table"] for r in meta["ranks"] for e in r["shards"]}
    assert held == planned  # every table's blocks are somewhere, the term's too


def test_an_evaluation_batch_that_does_not_divide_by_the_ranks_evaluates_every_row(two_ranks):
    """``data.eval_batch_size`` had to divide by the ranks (the default 8192 refused 3
    ranks), though evaluation splits its last, partial batch anyway. Bugs caught: the
    refusal, or a split that drops or repeats a row (the metrics would differ)."""
    results, _ = two_ranks
    ref = one_process(MIXED, "data.eval_batch_size=95")["final"]
    for rank, res in enumerate(results["odd_eval_batch"]):
        assert res["ok"], res
        got = res["final"]
        assert got["num_samples"] == ref["num_samples"] == 289, rank
        assert abs(got["log_loss"] - ref["log_loss"]) < 1e-5, (rank, got, ref)
        assert abs(got["auc"] - ref["auc"]) < 1e-4, (rank, got, ref)


def test_resuming_a_sharded_run_is_bitwise_equal_to_an_uninterrupted_one(two_ranks):
    """Bugs caught: a rank's optimizer state or rounding stream not saved, a rank loading
    another rank's blocks, the data position lost on resume."""
    results, tmp = two_ranks
    for name in ("straight", "first_half", "second_half"):
        assert all(r["ok"] for r in results[name]), results[name]
    a, b = tmp / "straight" / "step_00000006", tmp / "resumed" / "step_00000006"
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert files == ["rank_00000.safetensors", "rank_00001.safetensors", "tensors.safetensors"]
    for f in files:
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert ta.keys() == tb.keys(), f
        for k in ta:
            assert (ta[k] == tb[k]).all(), (f, k)
    saved = [json.loads((d / "meta.json").read_text())["dense_transform"] for d in (a, b)]
    assert saved[0] == saved[1]
    assert saved[0]["kinds"] == ["standardize"] * 13
    meta = json.loads((a / "meta.json").read_text())["sharding"]
    plan = ShardingPlan.from_dict(meta["plan"])
    assert plan.fingerprint() == meta["fingerprint"]
    assert len(meta["ranks"]) == 2


def test_a_stop_asked_of_one_rank_stops_every_rank_after_one_step_with_its_checkpoint(
    two_ranks,
):
    """SIGTERM reaches the ranks at different moments: the stop request rides on the
    step's loss all-reduce, so all stop after the same step and write its checkpoint
    together. Bugs caught: only the asked rank stopping (the other hangs in the next
    step's collective, the harness's deadline fails it), ranks checkpointing different
    steps, no checkpoint on stop, a resume from it not equal to an uninterrupted run."""
    results, tmp = two_ranks
    first = results["stopped_first"]
    assert [r["ok"] for r in first] == [False, False], first
    for r in first:
        assert r["error"].startswith("TrainingStoppedError: stopped after step 1; checkpoint ")
        assert r["error"].endswith("step_00000001")
    assert all(r["ok"] for r in results["stopped_second"]), results["stopped_second"]
    a, b = tmp / "straight" / "step_00000006", tmp / "stopped" / "step_00000006"
    for f in sorted(p.name for p in a.glob("*.safetensors")):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert ta.keys() == tb.keys(), f
        for k in ta:
            assert (ta[k] == tb[k]).all(), (f, k)


def test_a_sharded_sgd_run_resumes_to_the_uninterrupted_runs_metrics(two_ranks):
    """SGD keeps no state, so the checkpoint named none of a rank's blocks and every
    resume was refused ("optimizer state for [], this rank holds [...]"); with the keys
    in rank 0's meta only, rank 1 was refused for rank 0's blocks."""
    results, _ = two_ranks
    for name in ("sgd_first_half", "sgd_second_half"):
        assert all(r["ok"] for r in results[name]), results[name]
    for resumed, straight in zip(results["sgd_second_half"], results["row_wise"]):
        assert resumed["final"] == straight["final"]


def test_sharded_keep_best_and_early_stop_agree_on_every_rank(two_ranks):
    """keep_best and early stopping in a sharded run: every rank takes the same
    decisions (each new best's checkpoint is collective: a rank that skipped it would
    hang the others), ``best`` links rank 0's complete checkpoint of the best step, and
    pruning keeps it. Bugs caught: decisions from a rank's own slice of the metrics,
    the link written by every rank at once, or the best checkpoint pruned."""
    results, tmp = two_ranks
    runs = results["keep_best"]
    assert all(r["ok"] for r in runs), runs
    assert runs[0]["best"] == runs[1]["best"]
    assert runs[0]["steps"] == runs[1]["steps"]
    best, stop = runs[0]["best"]["step"], runs[0]["steps"]
    losses = [e["log_loss"] for e in runs[0]["evals"]]
    assert losses.index(min(losses)) + 1 == best
    # dense_lr=2 overshoots at step 2 (log loss 0.61 -> 0.82): patience 1 stops there
    assert runs[0]["stopped_early"]
    assert best == stop - 1  # patience 1: the first evaluation without improvement
    root = tmp / "best"
    assert (root / "best").resolve() == (root / f"step_{best:08d}").resolve()
    kept = sorted(p.name for p in root.glob("step_*"))
    assert kept == sorted({f"step_{best:08d}", f"step_{stop:08d}"})
    assert sorted(p.name for p in (root / "best").glob("*.safetensors")) == [
        "rank_00000.safetensors",
        "rank_00001.safetensors",
        "tensors.safetensors",
    ]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("other_plan_on_resume", "resuming with another world size or plan is not supported"),
        # it said only "plan 5d39d124cfe4bd19 ... plan ba9237a85dd8935d", not what differs
        ("other_plan_on_resume", "(table 'C2': sharding column_wise then, row_wise now)"),
        ("rank_1_other_config", "rank 1 differs from rank 0 in config.optim.sparse.lr"),
        ("unknown_table", "names tables ['nope'] that the model does not have"),
        ("block_not_dividing", "the column block size 3 does not divide its dim 8"),
        ("plan_for_3_ranks", "the sharding plan was made for 3 ranks"),
        # was "[Errno 2] No such file or directory: ...", naming no setting
        ("missing_stats", "sharding.stats="),
    ],
)
def test_bad_input_fails_on_every_rank_with_a_clear_error(two_ranks, name, message):
    """None of these may hang: each must stop every rank with the same readable error."""
    results, _ = two_ranks
    for rank, res in enumerate(results[name]):
        assert not res["ok"], (name, rank)
        assert message in res["error"], (name, rank, res["error"])


def test_the_plan_round_trips_through_json_and_describes_itself(tmp_path):
    tables = build_tables(RunConfig().with_overrides(list(TINY)).model)
    plan = plan_by_type(
        tables,
        [ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL,
         ShardingType.TABLE_WISE],
        world_size=3,
        column_block=4,
    )  # fmt: skip
    plan.save(tmp_path / "p.json")
    back = ShardingPlan.load(tmp_path / "p.json")
    assert back == plan
    assert back.fingerprint() == plan.fingerprint()
    text = plan.describe(tables)
    for word in ("C2", "column_wise", "weights per rank"):
        assert word in text
    # RW over 3 ranks + CW dim 8 in blocks of 4 + DP on 3 ranks + TW
    assert Path(tmp_path / "p.json").read_text().count('"rank"') == 3 + 2 + 3 + 1


def test_without_a_type_or_plan_the_planner_plans_and_training_matches_one_process(two_ranks):
    """Bugs caught: the run ignoring the planner (placing by type, or failing), ranks that
    plan differently (the fingerprint check would stop them), a plan not saved with the
    checkpoint, a planned run that trains differently from one process."""
    from tetrarec.planner import Topology, inputs_from_config, plan

    results, tmp = two_ranks
    assert all(r["ok"] for r in results["planned"]), results["planned"]
    config = RunConfig().with_overrides([*TINY, "optim.sparse.kind=sgd"])
    expected, _ = plan(inputs_from_config(config, Topology.preset("this-machine").resized(2, 2)))
    meta = json.loads((tmp / "planned" / "step_00000006" / "meta.json").read_text())
    assert ShardingPlan.from_dict(meta["sharding"]["plan"]) == expected
    ref = one_process("optim.sparse.kind=sgd")["final"]
    for res in results["planned"]:
        assert abs(res["final"]["log_loss"] - ref["log_loss"]) < 1e-5


def test_sharded_cached_tables_train_as_one_process_and_resume_bitwise(two_ranks):
    """Each rank caches its own shards (FP16 rows, FP32 caches, one table on SSD files).
    Bugs caught: a sharded run that ignores the config's placements (no cache in the
    ranks' checkpoints), caches that decide otherwise than one process's, a checkpoint
    without the cache contents (the resumed run's rows and counters would differ)."""
    results, tmp = two_ranks
    for name in ("cached", "cached_first_half", "cached_second_half"):
        assert all(r["ok"] for r in results[name]), results[name]
    ref = one_process(*CACHED)["final"]
    plain = one_process(*CACHED[1:], "model.placement=host")["final"]
    assert plain["log_loss"] != ref["log_loss"]  # FP32 cached rows train differently
    for rank, res in enumerate(results["cached"]):
        got = res["final"]
        assert abs(got["log_loss"] - ref["log_loss"]) < 1e-5, (rank, got, ref)
        assert abs(got["auc"] - ref["auc"]) < 1e-4, (rank, got, ref)
    a, b = tmp / "cached" / "step_00000006", tmp / "cresumed" / "step_00000006"
    for f in sorted(p.name for p in a.glob("*.safetensors")):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert ta.keys() == tb.keys(), f
        if f.startswith("rank_"):
            assert any(".cache." in k for k in ta), f  # the cache contents are saved
        for k in ta:
            assert (ta[k] == tb[k]).all(), (f, k)


def test_the_cache_counters_of_a_sharded_run_sum_every_ranks_shards(two_ranks):
    """Bug caught: the summary's cache counters (and the logged hit rate) were rank 0's
    shards only, and None when rank 0 held no cached table. Table-wise, each cached
    table's cache decides on one rank as one process's does, so the sums are equal."""
    results, _ = two_ranks
    runs = results["cached_table_wise"]
    assert all(r["ok"] for r in runs), runs
    ref = one_process(*CACHED[:4], "sharding.type=table_wise")["cache"]
    assert ref is not None
    assert ref["hits"] > 0
    for rank, res in enumerate(runs):
        assert res["cache"] == ref, (rank, res["cache"], ref)


@pytest.mark.parametrize(("name", "extra"), [("cached", CACHED), ("cached_dp", CACHED_DP)])
def test_replicas_and_column_blocks_count_their_tables_lookups_once(two_ranks, name, extra):
    """Bug caught: the summary's cache counters summed every rank's shards, so a
    data-parallel table (each replica sees the global batch) and a column-wise table
    (each column block sees every id) were counted once per replica or block: twice the
    hits, misses, slots and occupied slots of one process on 2 ranks. Only the lowest
    rank's replica and the first column block count now."""
    results, _ = two_ranks
    assert all(r["ok"] for r in results[name]), results[name]
    ref = one_process(*extra)["cache"]
    assert ref["hits"] > 0
    for rank, res in enumerate(results[name]):
        assert res["cache"] == ref, (rank, res["cache"], ref)


def test_a_byte_budget_is_shared_by_the_tables_as_in_one_process(two_ranks):
    """``model.cache.bytes`` under torchrun was applied again by every rank and every
    sharding group (each rank's shards got the whole budget: twice the slots in all,
    and other decisions than one process's). Each table's (or column block's) cache now
    holds one process's slots, and decides as it does."""
    results, tmp = two_ranks
    assert all(r["ok"] for r in results["cached_bytes"]), results["cached_bytes"]
    ref = one_process(*CACHED_BYTES, f"train.checkpoint_dir={tmp / 'bytes_one'}")["final"]
    one = read_checkpoint(latest_checkpoint(tmp / "bytes_one")).tensors
    ranks = [
        load_file(str(tmp / "cached_bytes" / "step_00000006" / f"rank_0000{r}.safetensors"))
        for r in (0, 1)
    ]
    for table, slots in (("C1", 12), ("C2", 5), ("C4", 25)):
        want = one[f"embedding.cache.{table}.slot_rows"]
        assert want.numel() == slots, table
        pattern = re.compile(rf"cache\.{table}(@[^.]*)?\.slot_rows$")
        found = [t[k] for t in ranks for k in t if pattern.search(k)]
        assert found, (table, sorted(ranks[0]))
        for got in found:
            assert torch.equal(got, want), (table, got, want)
    for rank, res in enumerate(results["cached_bytes"]):
        got = res["final"]
        assert abs(got["log_loss"] - ref["log_loss"]) < 1e-5, (rank, got, ref)


def test_cached_data_parallel_tables_train_as_one_process_and_resume_bitwise(two_ranks):
    """Cached replicated tables (INT8 rows, FP32 caches, one on SSD files) beside a
    cached table-wise table. Bugs caught: a replica whose cache decides on its own
    samples (its rows, and so the metrics, drift from one process's), replicas whose
    caches differ (their checkpoints would differ), and a checkpoint without a
    replica's cache contents (the resumed run's rows and counters would differ)."""
    results, tmp = two_ranks
    for name in ("cached_dp", "cached_dp_first_half", "cached_dp_second_half"):
        assert all(r["ok"] for r in results[name]), results[name]
    ref = one_process(*CACHED_DP)["final"]
    plain = one_process(*CACHED_DP[1:], "model.placement=host")["final"]
    assert plain["log_loss"] != ref["log_loss"]  # FP32 cached rows train differently
    for rank, res in enumerate(results["cached_dp"]):
        got = res["final"]
        assert abs(got["log_loss"] - ref["log_loss"]) < 1e-5, (rank, got, ref)
        assert abs(got["auc"] - ref["auc"]) < 1e-4, (rank, got, ref)
    a, b = tmp / "cached_dp" / "step_00000006", tmp / "dresumed" / "step_00000006"
    replicas = [load_file(str(a / f"rank_0000{r}.safetensors")) for r in (0, 1)]
    shared = [k for k in replicas[0] if ".C1." in k or k.endswith(".C1")]
    assert any(".cache.C1." in k for k in shared), sorted(replicas[0])
    for key in shared:  # a replicated table: rows, state and cache equal on both ranks
        assert torch.equal(replicas[0][key], replicas[1][key]), key
    for f in sorted(p.name for p in a.glob("*.safetensors")):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert ta.keys() == tb.keys(), f
        if f.startswith("rank_"):
            assert any(".cache.C1." in k for k in ta), f  # every replica saves its cache
        for k in ta:
            assert (ta[k] == tb[k]).all(), (f, k)


def test_sharded_static_cache_pins_the_one_process_rows(two_ranks):
    """``policy = 'static'`` in a sharded run: the sample is the first global batches,
    whatever slice each rank reads. Bugs caught: a rank counting only its own slice
    (replicas pinning other rows than each other and than one process), a shard
    pinning by another block's counts, and static counts that never reach the ranks'
    caches (the run would fail to build)."""

    results, tmp = two_ranks
    assert all(r["ok"] for r in results["static"]), results["static"]
    ref = one_process(*STATIC, f"train.checkpoint_dir={tmp / 'static_one'}")["final"]
    one = read_checkpoint(latest_checkpoint(tmp / "static_one")).tensors
    ranks = [load_file(str(tmp / "static" / "step_00000006" / f"rank_0000{r}.safetensors"))
             for r in (0, 1)]  # fmt: skip
    for table, holders in (("C1", (0, 1)), ("C4", (0, 1)), ("C2", None)):
        want = one[f"embedding.cache.{table}.slot_rows"]
        found = [
            (r, t[k])
            for r, t in enumerate(ranks)
            for k in t
            if k.endswith(f"cache.{table}.slot_rows")
        ]
        assert found, (table, sorted(ranks[0]))
        if holders is not None:
            assert sorted(r for r, _ in found) == list(holders), table  # every replica
        for r, got in found:
            assert torch.equal(got, want), (table, r, got, want)
    for rank, res in enumerate(results["static"]):
        got = res["final"]
        assert abs(got["log_loss"] - ref["log_loss"]) < 1e-5, (rank, got, ref)


@pytest.mark.timeout(600)
def test_resuming_at_three_ranks_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    """At 3 ranks gloo's ring all-reduce adds an element's terms in an order set by its
    place in the buffer, and DDP lays its buckets out by parameter order first, then by
    gradient-ready order: a resumed run's first step added its dense gradients in
    another order than the uninterrupted run's same step (log losses apart in the 8th
    digit). At 2 ranks a sum of two is the same either way, so the 2-rank test above
    could not see it."""
    ck = lambda name: f"train.checkpoint_dir={tmp_path / name}"  # noqa: E731
    base = (*TINY, "sharding.type=row_wise", "optim.dense=adam", "optim.dense_lr=0.01")
    scenarios = [
        Scenario("straight", (*base, "train.checkpoint_every=3", ck("straight"))),
        Scenario("first_half", (*base, "train.steps=3", ck("resumed"))),
        Scenario("second_half", (*base, ck("resumed")), resume=True),
    ]
    results = run_ranks(train_worker, world_size=3, args=(scenarios,), timeout_s=540)
    for rank in results:
        assert all(r["ok"] for r in rank), rank
    a, b = tmp_path / "straight" / "step_00000006", tmp_path / "resumed" / "step_00000006"
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(files) == 4  # tensors + 3 ranks
    for f in files:
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert ta.keys() == tb.keys(), f
        for k in ta:
            assert torch.equal(ta[k], tb[k]), (f, k)


@pytest.mark.timeout(600)
def test_torchrun_runs_the_command_end_to_end_and_every_rank_exits_0(tmp_path):
    """``torchrun --standalone --nproc-per-node 2 -m tetrarec train``: the command as a
    user runs it, through to the ranks' exit (a completed run waits for every rank
    before it leaves the process group; a rank once aborted there). Bugs caught: a rank
    exiting non-zero after a good run, the summary printed by every rank, no JSON."""
    import subprocess
    import sys

    out = tmp_path / "summary.json"
    sets = [x for kv in (*TINY, "sharding.type=row_wise") for x in ("--set", kv)]
    example = Path(__file__).parents[2] / "examples" / "dlrm_dcnv2_small.toml"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "tetrarec", "-q", "train", "--config", str(example),
        *sets, "--set", "model.dlrm.arch=dlrm", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.count("samples/s") == 1  # rank 0 prints the summary
    assert json.loads(out.read_text())["steps"] == 6
