"""Data ingestion: Criteo, binary, parquet, csv and synthetic sources, and the loader.

The sources are raw Criteo TSV (.gz), the preprocessed memory-mapped binary format,
parquet and delimited text (csv, plain or .gz) with a column mapping, and the
synthetic power-law generator; readers return raw dense values, which a
``DenseTransform`` fitted on the training rows maps to the model's inputs; the
``BatchLoader`` gives each rank its slice of every global batch, prefetched.

Typical use::

    train, held_out = build_datasets(config.data, tables)   # dense transform fitted on train
    saved = train.transform.to_dict()                        # what a checkpoint keeps
    loader = BatchLoader(train, batch_size=2048, rank=r, world_size=w, shuffle=True)
    for batch in loader:   # this rank's slice of each global batch
        ...
"""

from tetrarec.data.binary import BinaryColumns, PreprocessSummary, open_binary, preprocess_criteo
from tetrarec.data.build import (
    LOADERS,
    build_datasets,
    dense_spec,
    evaluation_dataset,
    input_bad_lines,
    log_bad_lines,
)
from tetrarec.data.config import (
    BadLinePolicy,
    CsvConfig,
    DataConfig,
    DataSource,
    DenseKind,
    SyntheticConfig,
)
from tetrarec.data.criteo import CriteoBlock, iter_criteo_blocks, read_criteo
from tetrarec.data.csv_source import CsvDataset, iter_csv_blocks, read_csv
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
from tetrarec.data.multi_hot import ColumnMapping, MultiHotColumns, MultiHotDataset
from tetrarec.data.parquet import ParquetDataset, iter_parquet_blocks, read_parquet
from tetrarec.data.parquet_export import preprocess_to_parquet
from tetrarec.data.synthetic import SyntheticDataset
from tetrarec.data.transforms import dense_transform, hash_ids, hash_strings

__all__ = [
    "LOADERS",
    "BadLinePolicy",
    "BadLineReason",
    "BadLineSummary",
    "BadLineTally",
    "BatchLoader",
    "BinaryColumns",
    "ColumnMapping",
    "ColumnsDataset",
    "CriteoBlock",
    "CsvConfig",
    "CsvDataset",
    "DataConfig",
    "DataError",
    "DataFileNotFoundError",
    "DataSource",
    "Dataset",
    "DenseKind",
    "DenseSpec",
    "DenseTransform",
    "MultiHotColumns",
    "MultiHotDataset",
    "ParquetDataset",
    "PreprocessSummary",
    "RowRange",
    "SyntheticConfig",
    "SyntheticDataset",
    "TransformedDataset",
    "build_datasets",
    "dense_spec",
    "dense_transform",
    "evaluation_dataset",
    "hash_ids",
    "hash_strings",
    "input_bad_lines",
    "iter_criteo_blocks",
    "iter_csv_blocks",
    "iter_parquet_blocks",
    "log_bad_lines",
    "open_binary",
    "preprocess_criteo",
    "preprocess_to_parquet",
    "read_criteo",
    "read_csv",
    "read_parquet",
]
