"""A training run with cached and SSD-placed tables: logs, checkpoints, resume."""

import logging

import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.train import evaluate_checkpoint, latest_checkpoint, read_checkpoint, train

TINY = [
    "data.source=synthetic",
    "data.batch_size=32",
    "data.eval_batch_size=64",
    "data.prefetch=1",
    "data.synthetic.num_samples=128",
    "data.synthetic.eval_samples=64",
    "model.num_sparse=3",
    "model.num_embeddings=[50, 20, 100]",
    "model.precision=int8",
    "model.dlrm.bottom_mlp=[8, 4]",
    "model.dlrm.top_mlp=[8, 1]",
    "optim.sparse.kind=rowwise_adagrad",
    "optim.sparse.lr=0.1",
    "train.progress=false",
    "train.deterministic=true",
    "train.log_every=2",
]


def tiny(tmp_path, run, *extra):
    return RunConfig().with_overrides(
        [
            *TINY,
            "model.placement=[cached, ssd, host]",
            "model.cache.fraction=0.2",
            f"model.cache.dir={tmp_path / 'ssd'}",
            f"train.checkpoint_dir={tmp_path / run}",
            *extra,
        ]
    )


@pytest.mark.slow
def test_cached_run_logs_hit_rate_and_resumes_bitwise(tmp_path, caplog):
    """6 steps straight equal 3 steps, a resume and 3 more, with a cache and an SSD table.

    Catches: a builder that ignores ``model.placement`` (no cache keys in the
    checkpoint), a checkpoint without the cache contents or taken before the flush, a
    trainer that does not log the hit rate.
    """
    caplog.set_level(logging.INFO, logger="tetrarec.train.loop")
    straight = train(tiny(tmp_path, "a", "train.steps=6"))
    assert any("cache hit rate" in r.getMessage() for r in caplog.records)
    train(tiny(tmp_path, "b", "train.steps=3"))
    resumed = train(tiny(tmp_path, "b", "train.steps=6"), resume=True)
    assert resumed.start_step == 3
    a = read_checkpoint(latest_checkpoint(tmp_path / "a"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert "embedding.cache.C1.slot_rows" in a.tensors
    assert "embedding.cache.C3.slot_rows" not in a.tensors  # host: no cache
    assert a.tensors["embedding.weights.C2"].dtype == torch.uint8  # the stored rows
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[name]), name
    assert resumed.final == straight.final


def oracle_hot_rows(config, batches):
    """The most frequent rows (count desc, row asc) of each cached table in the first
    ``batches`` training batches, counted with a plain Counter."""
    from collections import Counter

    from tetrarec.data import BatchLoader, build_datasets
    from tetrarec.train import build_tables

    tables = build_tables(config.model)
    train_ds, _ = build_datasets(config.data, tables)
    loader = BatchLoader(
        train_ds,
        batch_size=config.data.batch_size,
        shuffle=config.data.shuffle,
        seed=config.train.seed,
        prefetch=0,
    )
    counts = {t.name: Counter() for t in tables}
    for i, batch in enumerate(loader):
        if i == batches:
            break
        for key, (values, _) in batch.sparse.to_dict().items():
            counts[key].update(values.tolist())
    out = {}
    for t in tables:
        slots = int(0.2 * t.num_embeddings)
        ranked = sorted(counts[t.name].items(), key=lambda kv: (-kv[1], kv[0]))[:slots]
        covered = sum(n for _, n in ranked)
        out[t.name] = (sorted(r for r, _ in ranked), covered, sum(counts[t.name].values()))
    return out


@pytest.mark.slow
def test_static_policy_pins_the_training_sample_top_rows_logs_them_and_resumes(tmp_path, caplog):
    """``policy = 'static'`` from a run config: the trainer counts the first
    ``static_sample_batches`` training batches and pins each cached table's most
    frequent rows; it logs them with the share of the sample's lookups they cover; a
    resumed run equals an uninterrupted one, and ``evaluate_checkpoint`` reads the
    pinned rows back. Bugs caught: counting another sample (eval data, another number
    of batches, unshuffled order), ties broken otherwise than row ascending, a host
    table pinned, no log or a wrong share, pins lost or recounted differently on resume,
    and a static checkpoint that cannot be evaluated."""
    from tetrarec.train import evaluate_checkpoint

    caplog.set_level(logging.INFO, logger="tetrarec.train.static_cache")
    static = ("model.cache.policy=static", "model.cache.static_sample_batches=2")
    config = tiny(tmp_path, "a", *static, "train.steps=4")
    want = oracle_hot_rows(config, 2)
    assert want["C1"][0] != oracle_hot_rows(config, 4)["C1"][0]  # the sample size matters
    straight = train(config)
    saved = read_checkpoint(latest_checkpoint(tmp_path / "a")).tensors
    for table in ("C1", "C2"):
        rows = saved[f"embedding.cache.{table}.slot_rows"]
        assert sorted(rows.tolist()) == want[table][0], table
        line = next(r.getMessage() for r in caplog.records if f"{table}: " in r.getMessage())
        rows_pinned, covered, lookups = want[table]
        share = f"{covered / lookups:.1%}"
        assert f"{len(rows_pinned)} of " in line, line
        assert share in line, (line, share)
        assert f"{lookups} lookups of {table}" in line, line
    assert "embedding.cache.C3.slot_rows" not in saved  # host: nothing pinned
    assert not any("C3: " in r.getMessage() for r in caplog.records)
    train(tiny(tmp_path, "b", *static, "train.steps=2"))
    resumed = train(tiny(tmp_path, "b", *static, "train.steps=4"), resume=True)
    again = read_checkpoint(latest_checkpoint(tmp_path / "b")).tensors
    for name, tensor in saved.items():
        assert torch.equal(tensor, again[name]), name
    assert resumed.final == straight.final
    assert evaluate_checkpoint(latest_checkpoint(tmp_path / "a")) == straight.final


@pytest.mark.parametrize(
    "changed",
    [
        "model.cache.policy=static",
        "model.cache.policy=lfu",
        "model.cache.fraction=0.3",
        "model.cache.bytes=600",
    ],
)
def test_a_resume_with_other_cache_settings_is_refused_by_name(tmp_path, changed):
    """An LRU checkpoint resumed under ``policy = "static"`` kept the LRU cache's rows as
    if pinned, while the log named the sample's hottest rows; other changes failed on a
    saved tensor's shape ("cache.freq is (0,), this cache needs (50,)"). Both now say
    that [model.cache] changed. (fraction -> bytes also changes the size.)"""
    train(tiny(tmp_path, "a", "train.steps=2"))
    extra = [changed] if "bytes" not in changed else [changed, "model.cache.fraction=none"]
    with pytest.raises(
        ValueError,
        match=r"^resume: .* cached its tables with model\.cache policy=lru fraction=0\.2, not ",
    ):
        train(tiny(tmp_path, "a", "train.steps=4", *extra), resume=True)


def test_the_same_cache_settings_and_an_uncached_checkpoint_resume(tmp_path):
    """The check above must not refuse what works: the same settings, or a checkpoint of
    uncached tables resumed with caches (the documented direction)."""
    train(tiny(tmp_path, "a", "train.steps=2"))
    assert train(tiny(tmp_path, "a", "train.steps=3"), resume=True).start_step == 2
    host = RunConfig().with_overrides(
        [*TINY, f"train.checkpoint_dir={tmp_path / 'h'}", "train.steps=2"]
    )
    train(host)
    assert train(tiny(tmp_path, "h", "train.steps=3"), resume=True).start_step == 2


def test_an_ssd_directory_the_run_cannot_write_is_refused_by_its_key(tmp_path):
    """A ``model.cache.dir`` under a file, or not writable, failed as a bare OSError
    ("[Errno 20] Not a directory") naming no setting, with the exit status of a failed
    run rather than of bad input."""
    (tmp_path / "afile").write_text("x")
    bad = str(tmp_path / "afile" / "sub")
    with pytest.raises(
        ValueError,
        match=r"model\.cache\.dir='.*afile/sub': the ssd placement cannot write its files "
        r"there \(Not a directory\)",
    ):
        train(tiny(tmp_path, "a", "train.steps=1", f"model.cache.dir={bad}"))
    # tetrarec eval checks it the same way (bug caught: a raw "[Errno 17] File exists"
    # or "[Errno 20] Not a directory" naming no key, with a failed run's exit status).
    result = train(tiny(tmp_path, "b", "train.steps=1"))
    with pytest.raises(ValueError, match=r"model\.cache\.dir='.*afile/sub': the ssd placement"):
        evaluate_checkpoint(result.checkpoint, overrides=[f"model.cache.dir={bad}"])
    afile = tmp_path / "afile"
    with pytest.raises(ValueError, match=r"model\.cache\.dir='.*afile' is a file; give a dir"):
        evaluate_checkpoint(result.checkpoint, overrides=[f"model.cache.dir={afile}"])


def test_the_json_summary_holds_the_runs_cache_counters(tmp_path):
    """The counters were only in the log, the progress bar and TensorBoard: a script
    reading ``train.json`` could not see the hit rate. Lookups counted must be every id
    of the cached tables' training batches (this process's, a resume's own steps)."""
    import json

    from tetrarec.data import BatchLoader, build_datasets
    from tetrarec.train import build_tables

    out = tmp_path / "summary.json"
    config = tiny(tmp_path, "a", "train.steps=3", f"train.json={out}")
    result = train(config)
    summary = json.loads(out.read_text())["cache"]
    assert summary == result.to_dict()["cache"]
    train_ds, _ = build_datasets(config.data, build_tables(config.model))
    loader = BatchLoader(train_ds, batch_size=32, shuffle=config.data.shuffle,
                         seed=config.train.seed, prefetch=0)  # fmt: skip
    ids = 0
    for i, batch in enumerate(loader):
        if i == 3:
            break
        ids += sum(v.numel() for k, (v, _) in batch.sparse.to_dict().items() if k in ("C1", "C2"))
    assert summary["hits"] + summary["misses"] == ids
    assert summary["hit_rate"] == pytest.approx(summary["hits"] / ids)
    assert summary["capacity"] == int(0.2 * 50) + int(0.2 * 20)
    resumed = train(tiny(tmp_path, "a", "train.steps=4", f"train.json={out}"), resume=True)
    assert resumed.cache is not None
    assert resumed.cache.lookups < ids  # one step's, not the restored counters too
    uncached = RunConfig().with_overrides([*TINY, "train.steps=1"])
    assert train(uncached).to_dict()["cache"] is None


def test_a_cache_size_under_one_slot_is_said(tmp_path, caplog):
    """``bytes = 1`` (or a fraction under one row) built caches of 0 slots without a
    word: the run trained its "cached" tables uncached."""
    caplog.set_level(logging.WARNING, logger="tetrarec.train.loop")
    extra = ("model.cache.fraction=none", "model.cache.bytes=1", "train.steps=1")
    train(tiny(tmp_path, "a", *extra))
    said = [r.getMessage() for r in caplog.records if "no cache slot" in r.getMessage()]
    assert said == [
        "cached tables with no cache slot (model.cache.bytes=1 is under one slot for their "
        "rows): C1, C2 train as uncached tables"
    ]
    caplog.clear()
    train(tiny(tmp_path, "b", "train.steps=1"))
    assert not [r for r in caplog.records if "no cache slot" in r.getMessage()]
