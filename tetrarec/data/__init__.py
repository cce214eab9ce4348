"""Data ingestion: Criteo, binary, parquet and synthetic sources, and the loader.

The sources are raw Criteo TSV (.gz), the preprocessed memory-mapped binary format,
parquet with a column mapping and the synthetic power-law generator; readers return raw
dense values, which a ``DenseTransform`` fitted on the training rows maps to the model's
inputs; the ``BatchLoader`` gives each rank its slice of every global batch, prefetched.

Typical use::

    train, held_out = build_datasets(config.data, tables)   # dense transform fitted on train
    saved = train.transform.to_dict()                        # what a checkpoint keeps
    loader = BatchLoader(train, batch_size=2048, rank=r, world_size=w, shuffle=True)
    for batch in loader:   # this rank's slice of each global batch
        ...
"""

from tetrarec.data.binary import BinaryColumns, PreprocessSummary, open_binary, preprocess_criteo
from tetrarec.data.build import LOADERS, build_datasets, dense_spec
from tetrarec.data.config import BadLinePolicy, DataConfig, DataSource, DenseKind, SyntheticConfig
from tetrarec.data.criteo import CriteoBlock, iter_criteo_blocks, read_criteo
from tetrarec.data.datasets import ColumnsDataset, Dataset, RowRange
from tetrarec.data.dense import DenseSpec, DenseTransform, TransformedDataset
from tetrarec.data.errors import (
    BadLineReason,
    BadLineSummary,
    BadLineTally,
    DataError,
    DataFileNotFoundError,
)
from tetrarec.data.loader import BatchLoader
from tetrarec.data.parquet import ParquetDataset
from tetrarec.data.synthetic import SyntheticDataset
from tetrarec.data.transforms import dense_transform, hash_ids

__all__ = [
    "LOADERS",
    "BadLinePolicy",
    "BadLineReason",
    "BadLineSummary",
    "BadLineTally",
    "BatchLoader",
    "BinaryColumns",
    "ColumnsDataset",
    "CriteoBlock",
    "DataConfig",
    "DataError",
    "DataFileNotFoundError",
    "DataSource",
    "Dataset",
    "DenseKind",
    "DenseSpec",
    "DenseTransform",
    "ParquetDataset",
    "PreprocessSummary",
    "RowRange",
    "SyntheticConfig",
    "SyntheticDataset",
    "TransformedDataset",
    "build_datasets",
    "dense_spec",
    "dense_transform",
    "hash_ids",
    "iter_criteo_blocks",
    "open_binary",
    "preprocess_criteo",
    "read_criteo",
]
