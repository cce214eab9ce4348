"""Data ingestion: Criteo, binary, parquet and synthetic sources, and the loader.

The sources are raw Criteo TSV (.gz), the preprocessed memory-mapped binary format,
parquet with a column mapping and the synthetic power-law generator; the
``BatchLoader`` gives each rank its slice of every global batch, prefetched.

Typical use::

    train, held_out = build_datasets(config.data, tables)
    loader = BatchLoader(train, batch_size=2048, rank=r, world_size=w, shuffle=True)
    for batch in loader:   # this rank's slice of each global batch
        ...
"""

from tetrarec.data.binary import BinaryColumns, PreprocessSummary, open_binary, preprocess_criteo
from tetrarec.data.build import LOADERS, build_datasets
from tetrarec.data.config import BadLinePolicy, DataConfig, DataSource, SyntheticConfig
from tetrarec.data.criteo import CriteoBlock, iter_criteo_blocks, read_criteo
from tetrarec.data.datasets import ColumnsDataset, Dataset, RowRange
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
    "ParquetDataset",
    "PreprocessSummary",
    "RowRange",
    "SyntheticConfig",
    "SyntheticDataset",
    "build_datasets",
    "dense_transform",
    "hash_ids",
    "iter_criteo_blocks",
    "open_binary",
    "preprocess_criteo",
    "read_criteo",
]
