"""``preprocess_to_parquet``: parse csv or parquet inputs once into a parquet file of ids.

The output has the mapped columns under their own names::

    label_column        float32   0/1
    dense_columns       float32   raw values, missing -> 0
    sparse_columns      int64             the raw 64-bit id (one-hot columns)
                        list<int64>       a bag of raw ids (list / multi-hot columns)

The ids are those the reader computed (an integer value, or ``hash_strings`` of a
string), not yet hashed into tables, so reading the file back with
``source = "parquet"`` and the same mapping gives bit-identical batches for any table
sizes, without parsing or hashing text again. The file's key-value metadata ``tetrarec``
holds JSON describing the inputs and the skipped lines. The file is written beside
``output`` under a temporary name and renamed into place at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from tetrarec import jsonio
from tetrarec.data.binary import PreprocessSummary
from tetrarec.data.config import BadLinePolicy, CsvConfig, DataSource
from tetrarec.data.csv_source import iter_csv_blocks
from tetrarec.data.errors import BadLineTally, DataError, DataFileNotFoundError
from tetrarec.data.multi_hot import ColumnMapping, MultiHotColumns
from tetrarec.data.parquet import iter_parquet_blocks

__all__ = ["BLOCK_READERS", "METADATA_KEY", "preprocess_to_parquet"]

logger = logging.getLogger(__name__)

METADATA_KEY = "tetrarec"

BlockReader = Callable[
    [Path, ColumnMapping, CsvConfig, BadLinePolicy, BadLineTally, Callable[[int], None]],
    Iterator[MultiHotColumns],
]


def _csv_blocks(
    path: Path,
    mapping: ColumnMapping,
    csv: CsvConfig,
    policy: BadLinePolicy,
    tally: BadLineTally,
    on_bytes: Callable[[int], None],
) -> Iterator[MultiHotColumns]:
    return iter_csv_blocks(
        path, mapping, csv=csv, on_bad_line=policy, tally=tally, on_bytes=on_bytes
    )


def _parquet_blocks(
    path: Path,
    mapping: ColumnMapping,
    csv: CsvConfig,
    policy: BadLinePolicy,
    tally: BadLineTally,
    on_bytes: Callable[[int], None],
) -> Iterator[MultiHotColumns]:
    del csv, policy, tally  # parquet is typed: a bad value always raises
    return iter_parquet_blocks(path, mapping, on_bytes=on_bytes)


# The sources ``preprocess_to_parquet`` reads, each a block iterator.
BLOCK_READERS: dict[DataSource, BlockReader] = {
    DataSource.CSV: _csv_blocks,
    DataSource.PARQUET: _parquet_blocks,
}


def _schema(mapping: ColumnMapping, multi_hot: Sequence[bool]) -> pa.Schema:
    fields = [pa.field(mapping.label_column, pa.float32())]
    fields += [pa.field(c, pa.float32()) for c in mapping.dense_columns]
    fields += [
        pa.field(c, pa.list_(pa.int64()) if listed else pa.int64())
        for c, listed in zip(mapping.sparse_columns, multi_hot)
    ]
    return pa.schema(fields)


def _table(
    block: MultiHotColumns, schema: pa.Schema, mapping: ColumnMapping, path: Path
) -> pa.Table:
    """``block`` as a table of ``schema`` (one-hot or list per the schema)."""
    arrays = [pa.array(block.labels, pa.float32())]
    arrays += [pa.array(block.dense[:, i], pa.float32()) for i in range(block.dense.shape[1])]
    for f, name in enumerate(mapping.sparse_columns):
        ids, offsets = block.ids[f], block.offsets[f]
        if pa.types.is_list(schema.field(name).type):
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(ids)))
        elif (np.diff(offsets) == 1).all():
            arrays.append(pa.array(ids, pa.int64()))
        else:
            raise DataError(
                "a list column here, but one id per row in the first input (the output "
                "column's type follows the first input)",
                path=path,
                field=name,
            )
    return pa.Table.from_arrays(arrays, schema=schema)


def _check_paths(inputs: Sequence[str | Path], output: Path) -> list[Path]:
    if not inputs:
        raise ValueError("preprocess_to_parquet needs at least one input file")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.exists():
            raise DataFileNotFoundError(p)
    if output.exists():
        raise DataError("the output already exists; remove it or choose another", path=output)
    return paths


def preprocess_to_parquet(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    source: str | DataSource,
    mapping: ColumnMapping,
    csv: CsvConfig | None = None,
    on_bad_line: str | BadLinePolicy = BadLinePolicy.ERROR,
    progress: bool = True,
) -> PreprocessSummary:
    """Parse csv or parquet files once into one parquet file of raw ids.

    Args:
        inputs: the files, concatenated in this order.
        output: the parquet file to create (must not exist).
        source: ``"csv"`` or ``"parquet"`` (a key of ``BLOCK_READERS``).
        mapping: the label, dense and sparse columns; the output keeps their names.
        csv: how csv files are read (see ``CsvConfig``).
        on_bad_line: ``"error"`` or ``"skip"`` (csv; parquet always raises).
        progress: show a tqdm bar (bytes read) on stderr.

    Returns:
        The summary (rows, per-file rows, skipped lines, seconds).

    Raises:
        ValueError: for a source that cannot be preprocessed to parquet, or no inputs.
        DataFileNotFoundError: if an input does not exist.
        DataError: see the readers; also for no rows at all or an existing ``output``.
    """
    t0 = time.perf_counter()
    kind = DataSource.parse(source)
    if kind not in BLOCK_READERS:
        valid = ", ".join(repr(s.value) for s in BLOCK_READERS)
        raise ValueError(f"preprocess_to_parquet reads sources {valid}, got {kind.value!r}")
    read_blocks = BLOCK_READERS[kind]
    output = Path(output)
    paths = _check_paths(inputs, output)
    policy = BadLinePolicy.parse(on_bad_line)
    csv = CsvConfig() if csv is None else csv
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    tally, files, rows, positives = BadLineTally(), [], 0, 0
    writer: pq.ParquetWriter | None = None
    bar = tqdm(
        total=sum(p.stat().st_size for p in paths),
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
    )
    try:
        with bar:
            for p in paths:
                before = rows
                for block in read_blocks(p, mapping, csv, policy, tally, bar.update):
                    if writer is None:
                        writer = pq.ParquetWriter(tmp, _schema(mapping, block.multi_hot))
                    writer.write_table(_table(block, writer.schema, mapping, p))
                    rows += block.rows
                    positives += int(block.labels.sum())
                files.append((str(p), rows - before))
        if writer is None or rows == 0:
            raise tally.no_rows_error("the input", path=paths[0] if len(paths) == 1 else None)
        bad = tally.freeze(rows)
        meta = {"source": kind.value, "files": files, "bad_lines": bad.to_dict()}
        writer.add_key_value_metadata({METADATA_KEY: jsonio.dumps(meta)})
        writer.close()
        tmp.rename(output)
    except BaseException:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
        raise
    summary = PreprocessSummary(
        output=output,
        rows=rows,
        positives=positives,
        files=tuple(files),
        bad_lines=bad,
        seconds=time.perf_counter() - t0,
    )
    logger.info("%s", summary.summary())
    return summary
