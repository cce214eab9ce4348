"""Pruning an exported model's tables by training counts (tetrarec.inference.prune)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from _quant_tiny_model import held_out_batches, tiny_model, training_batches

from tetrarec.inference import load, save
from tetrarec.inference.model import InferenceModel
from tetrarec.inference.prune import count_ids, prune_tables, training_dataset
from tetrarec.inference.quantize import QuantSpec, quantize_model, quantize_tables
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision


@pytest.fixture(scope="module")
def model() -> InferenceModel:
    return tiny_model(first_order=True)


@pytest.fixture(scope="module")
def counts(model: InferenceModel) -> dict[str, torch.Tensor]:
    return count_ids(model, training_dataset(model), batch_size=512)


@pytest.fixture(scope="module")
def min_count(counts: dict[str, torch.Tensor]) -> int:
    """C1's median count: about half its rows are pruned."""
    return int(counts["C1"].median())


def _one_id_bags(model: InferenceModel, table: str, ids: list[int]) -> SparseFeatures:
    """One bag per id for ``table``'s feature, id 0 for the other features."""
    return SparseFeatures.from_lists(
        {f: [[i] for i in ids] if f == table else [[0]] * len(ids) for f in model.sparse_features}
    )


def test_counts_equal_a_hand_count(model: InferenceModel, counts: dict[str, torch.Tensor]) -> None:
    """Catches ids counted into the wrong table (a feature order mix-up), values of
    another feature counted, or batches skipped."""
    hand: dict[str, Counter[int]] = {f: Counter() for f in model.sparse_features}
    for batch in training_batches(model, num=10**6, batch_size=300):
        for key, (values, _) in batch.sparse.to_dict().items():
            hand[key].update(values.tolist())
    for name in ("C1", "C2", "C3", "C4"):
        want = torch.zeros_like(counts[name])
        for i, n in hand[name].items():
            want[i] = n
        assert torch.equal(counts[name], want), name
    assert int(counts["C1"].sum()) == sum(hand["C1"].values()) > 0


def test_a_first_order_table_counts_as_its_embedding_table(
    counts: dict[str, torch.Tensor],
) -> None:
    """Catches first-order tables left uncounted (they would all be pruned)."""
    assert torch.equal(counts["C1_first_order"], counts["C1"])


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.INT8, Precision.INT4])
def test_pruned_ids_pool_to_zero_and_kept_ids_pool_as_before(
    model: InferenceModel, counts: dict[str, torch.Tensor], min_count: int, precision: Precision
) -> None:
    """Catches a remap off by one (kept ids reading their neighbour's row), a zero row
    that is not zero, or rows moved by decoding and re-encoding."""
    base = quantize_tables(model, {"C1": precision})
    # row_bytes: prune even where the id map costs more than the rows it drops (small
    # INT4 rows), so that every precision's remap is tested
    pruned = prune_tables(base, counts, min_count, row_bytes={"C1": 1 << 10})
    c1 = counts["C1"]
    ids = list(range(c1.numel()))
    sf = _one_id_bags(model, "C1", ids)
    before = base.embeddings(sf).values[:, :8]
    after = pruned.embeddings(sf).values[:, :8]
    kept = c1 >= min_count
    assert 0 < int(kept.sum()) < c1.numel()  # this test prunes some rows and keeps some
    assert torch.equal(after[kept], before[kept])
    assert torch.equal(after[~kept], torch.zeros_like(after[~kept]))
    entry = next(e for e in pruned.manifest.tables if e["name"] == "C1")
    assert entry["stored_rows"] == int(kept.sum()) + 1
    assert pruned.embeddings.remap("C1") is not None
    assert pruned.embeddings.table_rows("C1").shape[0] == int(kept.sum()) + 1


def test_a_table_is_pruned_only_where_that_saves_bytes(model: InferenceModel) -> None:
    """Catches pruning that makes a model larger (found in review: a benchmark's pruned
    model was bigger than the unpruned one): the int32 id map costs 4 bytes per id, so
    dropping half the rows of 8-byte rows saves nothing, while dropping them from
    1 KiB rows does."""
    half = (torch.arange(100) % 2).to(torch.int64)  # every other id never seen
    small = prune_tables(model, {"C1": half}, 1, row_bytes={"C1": 8})
    assert small.embeddings.remap("C1") is None
    large = prune_tables(model, {"C1": half}, 1, row_bytes={"C1": 1024})
    assert large.embeddings.remap("C1") is not None
    assert large.embeddings.table_rows("C1").shape[0] == 51  # 50 kept + the zero row


def test_a_table_with_nothing_to_prune_stays_unpruned(model: InferenceModel) -> None:
    """Catches a full table copied with a useless id map and an extra zero row."""
    counts = {"C2": torch.full((60,), 5, dtype=torch.int64)}
    pruned = prune_tables(model, counts, 5)
    assert pruned.embeddings.remap("C2") is None
    assert "tables.C2.remap" not in pruned.tensors()


def test_pruning_twice_keeps_the_first_prune(model: InferenceModel) -> None:
    """Catches a second prune that reads the old id map wrongly (a pruned id pointing
    at a real row again)."""
    c = torch.arange(100, dtype=torch.int64) % 7  # counts 0..6
    once = prune_tables(model, {"C1": c}, 3)
    twice = prune_tables(once, {"C1": torch.full((100,), 9, dtype=torch.int64)}, 1)
    sf = _one_id_bags(model, "C1", list(range(100)))
    assert torch.equal(twice.embeddings(sf).values, once.embeddings(sf).values)
    assert twice.embeddings.table_rows("C1").shape == once.embeddings.table_rows("C1").shape


def test_a_pruned_model_scores_the_same_after_save_and_load(
    tmp_path: Path, model: InferenceModel, counts: dict[str, torch.Tensor], min_count: int
) -> None:
    """Catches an id map or stored-row count not written or not read back."""
    pruned = prune_tables(model, counts, min_count)
    batch = held_out_batches(model)[0]
    save(pruned, tmp_path / "m")
    loaded = load(tmp_path / "m")
    assert torch.equal(
        loaded.logits(batch.dense, batch.sparse), pruned.logits(batch.dense, batch.sparse)
    )
    assert loaded.manifest.tables == pruned.manifest.tables
    assert pruned.nbytes() < model.nbytes()


def test_quantize_model_prunes_then_converts(
    model: InferenceModel, counts: dict[str, torch.Tensor], min_count: int
) -> None:
    """Catches pruning skipped by quantize_model, or run after conversion (the other
    order gives other bytes only if rows were re-encoded)."""
    spec = QuantSpec(tables={"C1": Precision.INT8}, prune_min_count=min_count, prune_counts=counts)
    out = quantize_model(model, spec)
    expected = quantize_tables(prune_tables(model, counts, min_count), {"C1": Precision.INT8})
    for key, value in expected.tensors().items():
        assert torch.equal(out.tensors()[key], value), key
    assert out.manifest.quantization["prune"]["min_count"] == min_count
    assert out.embeddings.remap("C1") is not None


def test_quantize_model_counts_the_training_rows_itself(
    model: InferenceModel, counts: dict[str, torch.Tensor], min_count: int
) -> None:
    """Catches prune_min_count ignored when no counts are given."""
    out = quantize_model(model, QuantSpec(prune_min_count=min_count))
    assert out.manifest.tables == prune_tables(model, counts, min_count).manifest.tables
    assert out.manifest.tables != model.manifest.tables


def test_bad_counts_are_clear_errors(model: InferenceModel) -> None:
    """Catches counts of a wrong table or length pruning the wrong ids silently."""
    with pytest.raises(
        ValueError, match=r"counts for table\(s\) the model does not have: \['C9'\]"
    ):
        prune_tables(model, {"C9": torch.zeros(3, dtype=torch.int64)}, 1)
    with pytest.raises(
        ValueError, match="table 'C1': counts of shape \\(3,\\), the table answers 100"
    ):
        prune_tables(model, {"C1": torch.zeros(3, dtype=torch.int64)}, 1)
    with pytest.raises(ValueError, match="min_count must be at least 1"):
        prune_tables(model, {}, 0)
