"""The SSD tier: backing rows in memory-mapped files train as in process memory."""

import dataclasses
import gc

import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sparse import SparseFeatures
from tetrarec.types import Precision

TABLES = [
    TableConfig(name="a", num_embeddings=40, dim=6, precision="int8"),
    TableConfig(name="b", num_embeddings=20, dim=4, precision="fp16", pooling="mean"),
]
ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2)


def batches(n):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        bags = {
            t.name: [
                (torch.rand(3, generator=gen) ** 2 * t.num_embeddings).long().tolist()
                for _ in range(4)
            ]
            for t in TABLES
        }
        out.append(SparseFeatures.from_lists(bags))
    return out


def train(module, data):
    for i, sf in enumerate(data):
        out = module(sf).values
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(i)))


def test_ssd_tier_trains_as_the_in_memory_backing_and_its_files_have_the_table_size(tmp_path):
    """Placement ``ssd`` (one table) equals ``cached`` bitwise; files sized as the store.

    Catches: rows or state not initialized in the file (zeros), writes that do not reach
    the file-backed tensor, a file of the wrong size (rows lost or overrun), files left
    behind after the module is gone.
    """
    spec = CacheSpec(fraction=0.2, directory=str(tmp_path))
    ssd = CachedEmbeddingBagCollection(TABLES, ADAGRAD, spec, placements={"a": "ssd"}, seed=3)
    ram = CachedEmbeddingBagCollection(TABLES, ADAGRAD, spec, seed=3)
    data = batches(5)
    train(ssd, data)
    train(ram, data)
    for key, value in ram.state_dict().items():
        assert torch.equal(ssd.state_dict()[key], value), key
    row_bytes = Precision.INT8.row_bytes(6)  # 6 codes, fp16 scale and bias, aligned
    assert ssd.memory().backing_ssd == 40 * row_bytes
    files = {p.name: p.stat().st_size for p in ssd.ssd_files()}
    assert files == {"rows-0-int8.bin": 40 * row_bytes, "state-0-sum.bin": 40 * 4}
    # the file holds the table: its bytes are the saved rows of table "a"
    rows = torch.from_file(str(ssd.ssd_files()[0]), size=40 * row_bytes, dtype=torch.uint8)
    assert torch.equal(rows.view(40, row_bytes), ssd.state_dict()["weights.a"])
    directory = ssd.ssd_files()[0].parent
    del ssd
    gc.collect()  # the module and its optimizer refer to each other
    assert not directory.exists()


def test_ssd_tier_with_every_table_on_file(tmp_path):
    """Catches: a collection with no in-memory backing part (only ssd tables) failing."""
    spec = CacheSpec(policy="lfu", fraction=0.25, directory=str(tmp_path))
    tables = [dataclasses.replace(t, precision="bf16") for t in TABLES]
    ssd = CachedEmbeddingBagCollection(
        tables, ADAGRAD, spec, placements={"a": "ssd", "b": "ssd"}, seed=1
    )
    ram = CachedEmbeddingBagCollection(tables, ADAGRAD, spec, seed=1)
    data = batches(4)
    train(ssd, data)
    train(ram, data)
    for name, w in ram.table_weights().items():
        assert torch.equal(ssd.table_weights()[name], w), name
    assert ssd.memory().backing_ram == 0
