"""Batch scoring: an exported model over files, the scores written chunk by chunk.

``predict_files`` reads the input files the way the model's training run read its data
(``data.source``: Criteo TSV(.gz), csv (plain or .gz) or parquet; its column mapping,
string-id hashing and ``data.on_bad_line`` rule, each overridable), puts the dense
features through the model's saved transform and writes, for every row, ``batch_size``
rows at a time::

    row    the 0-based index of the row among the rows read (over the files in
           order); or, with ``id_column``, that column of the input (as text)
    score  the click probability, sigmoid(logit), FP32
    label  the row's 0/1 label, only when the input has labels: a Criteo file of 39
           fields (``test.txt``, no label field) or a csv or parquet file without
           ``data.label_column`` is scored all the same, without this column

Memory: the readers (``tetrarec.data``) hold the whole input in memory (raw columns,
about 4 bytes per value); scoring and writing stream over it, one batch at a time, so
the scores are never all held. The output goes to ``<output>.tmp-<pid>`` and is renamed
into place when complete: a failed run leaves no output that looks finished.

Skipped lines (``on_bad_line="skip"``) are left out of the output, so ``row`` then
counts the rows kept, not the lines of the file: name an id column to keep track of
rows (a warning says so).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from tetrarec.data import BadLinePolicy, BadLineSummary, DataFileNotFoundError, DataSource
from tetrarec.data.config import DataConfig
from tetrarec.data.criteo import open_input
from tetrarec.data.datasets import has_labels
from tetrarec.inference.model import InferenceModel
from tetrarec.inference.scoring import batches, model_dataset

__all__ = ["OUTPUT_FORMATS", "PredictSettings", "PredictSummary", "ScoreWriter", "predict_files"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PredictSettings:
    """What ``predict_files`` scores and where it writes.

    Args:
        files: the input files, read in order as one sequence of rows.
        output: the file to write (its directory must exist).
        output_format: ``"parquet"`` or ``"csv"`` (``OUTPUT_FORMATS``); ``None``: from
            the output's extension (``.parquet``/``.pq``, ``.csv``).
        batch_size: rows scored and written at a time.
        source: read the files as this ``data.source`` instead of the model's.
        on_bad_line: ``"error"`` or ``"skip"`` instead of the model's
            ``data.on_bad_line``.
        id_column: a column of a csv or parquet input to write as the row's id.
        progress: show a bar of the rows scored on stderr.
    """

    files: tuple[str, ...]
    output: Path
    output_format: str | None = None
    batch_size: int = 8192
    source: str | None = None
    on_bad_line: str | None = None
    id_column: str | None = None
    progress: bool = False


@dataclass(frozen=True, kw_only=True)
class PredictSummary:
    """What a scoring run wrote.

    Args:
        rows: rows scored (and written).
        output: the file written.
        output_format: its format.
        id_column: the input column written as ``id``, or ``None`` (``row`` written).
        labeled: whether the input had labels (and the output a ``label`` column).
        mean_score: the mean score over the rows.
        bad_lines: the lines skipped while reading, when the reader counts them.
    """

    rows: int
    output: Path
    output_format: str
    id_column: str | None
    mean_score: float
    bad_lines: BadLineSummary | None
    labeled: bool = True

    def summary(self) -> str:
        """One line: the rows, the file, the mean score and any skipped lines."""
        skipped = ""
        if self.bad_lines is not None and self.bad_lines.skipped:
            skipped = f"; skipped {self.bad_lines.skipped} bad lines"
        return (
            f"scored {self.rows:,} rows -> {self.output} ({self.output_format}), "
            f"mean score {self.mean_score:.4f}{skipped}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "rows": self.rows,
            "output": str(self.output),
            "format": self.output_format,
            "id_column": self.id_column,
            "labeled": self.labeled,
            "mean_score": self.mean_score,
            "bad_lines": None if self.bad_lines is None else self.bad_lines.to_dict(),
        }


class ScoreWriter(Protocol):
    """Writes chunks of ``{column: array}`` to one file, in order; ``close`` finishes it."""

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """Append one chunk of rows."""
        ...

    def close(self) -> None:
        """Flush and close the file."""
        ...


class _ParquetScoreWriter:
    """A parquet file, one row group per chunk (pyarrow's ``ParquetWriter``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: pq.ParquetWriter | None = None

    def write(self, columns: dict[str, np.ndarray]) -> None:
        table = pa.table({k: pa.array(v) for k, v in columns.items()})
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, table.schema)
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _CsvScoreWriter:
    """A comma-separated file with a header line; scores written as ``repr`` floats."""

    def __init__(self, path: Path) -> None:
        self.file: IO[str] = path.open("w", newline="")
        self.writer = csv.writer(self.file)
        self.header = False

    def write(self, columns: dict[str, np.ndarray]) -> None:
        if not self.header:
            self.writer.writerow(list(columns))
            self.header = True
        # tolist() gives Python floats: their repr round-trips the FP32 value exactly
        self.writer.writerows(zip(*(v.tolist() for v in columns.values()), strict=True))

    def close(self) -> None:
        self.file.close()


OUTPUT_FORMATS: dict[str, Callable[[Path], ScoreWriter]] = {
    "parquet": _ParquetScoreWriter,
    "csv": _CsvScoreWriter,
}
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}


def _output_format(settings: PredictSettings) -> str:
    name = settings.output_format
    if name is None:
        name = _EXTENSIONS.get(settings.output.suffix.lower())
        if name is None:
            raise ValueError(
                f"--output {str(settings.output)!r}: cannot tell the format from its "
                f"extension (known: {', '.join(sorted(_EXTENSIONS))}); give --format"
            )
    if name not in OUTPUT_FORMATS:
        raise ValueError(f"output format {name!r} is not one of {sorted(OUTPUT_FORMATS)}")
    return name


def _check_paths(settings: PredictSettings) -> None:
    """Refuse a missing input or an output that could not be written, before any work."""
    for f in settings.files:
        if not Path(f).exists():
            raise DataFileNotFoundError(f)
    out = settings.output
    if out.is_dir():
        raise ValueError(f"--output {str(out)!r} is a directory; give a file path")
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"--output {str(out)!r}: its directory {str(out.parent)!r} does not exist"
        )


_FILE_SOURCES = (DataSource.CRITEO, DataSource.CSV, DataSource.PARQUET, DataSource.BINARY)


def _scoring_config(model: InferenceModel, settings: PredictSettings) -> InferenceModel:
    """``model`` with the data settings overridden (source, bad-line rule)."""
    overrides = []
    if settings.source is not None:
        overrides.append(f"data.source={json.dumps(str(DataSource.parse(settings.source)))}")
    if settings.on_bad_line is not None:
        policy = BadLinePolicy.parse(settings.on_bad_line)
        overrides.append(f"data.on_bad_line={json.dumps(str(policy))}")
    config = model.config.with_overrides(overrides) if overrides else model.config
    if DataSource(config.data.source) not in _FILE_SOURCES:
        raise ValueError(
            f"the model's data.source is {str(config.data.source)!r}, which reads no files: "
            f"give --source ({', '.join(s.value for s in _FILE_SOURCES)}) and the column "
            "settings its training data had"
        )
    return dataclasses.replace(model, config=config)


def _csv_ids(path: str, column: str, data: DataConfig) -> pa.Array:
    opts = data.csv
    read = pacsv.ReadOptions(
        column_names=list(opts.column_names) if not opts.header else None,
        autogenerate_column_names=False,
        block_size=16 << 20,
    )
    stream, raw = open_input(Path(path))
    with raw, stream:
        try:
            header = pacsv.read_csv(
                stream,
                read_options=read,
                parse_options=pacsv.ParseOptions(delimiter=opts.delimiter),
                convert_options=pacsv.ConvertOptions(
                    include_columns=[column], column_types={column: pa.string()}
                ),
            )
        except (pa.ArrowException, KeyError) as e:
            raise ValueError(f"{path}: cannot read --id-column {column!r} ({e})") from None
    return header.column(column).combine_chunks()


def _parquet_ids(path: str, column: str, data: DataConfig) -> pa.Array:
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read parquet data ({e})") from None
    if column not in names:
        raise ValueError(f"{path}: has no column {column!r} (--id-column); columns: {names}")
    return pq.read_table(path, columns=[column]).column(column).combine_chunks().cast(pa.string())


# The sources whose files have named columns, and how to read one of them.
_ID_READERS: dict[DataSource, Callable[[str, str, DataConfig], pa.Array]] = {
    DataSource.CSV: _csv_ids,
    DataSource.PARQUET: _parquet_ids,
}


def _read_ids(files: Sequence[str], column: str, data: DataConfig, rows: int) -> np.ndarray:
    """The id column of every input, concatenated, as text (object array)."""
    read = _ID_READERS.get(DataSource(data.source))
    if read is None:
        raise ValueError(
            f"--id-column {column!r}: the {data.source} source has no named columns "
            f"(only {', '.join(s.value for s in _ID_READERS)} inputs do)"
        )
    ids = np.concatenate([read(f, column, data).to_numpy(zero_copy_only=False) for f in files])
    if ids.shape[0] != rows:
        raise ValueError(
            f"--id-column {column!r}: {ids.shape[0]} values in the input but {rows} rows were "
            "read (lines were skipped as bad); score without --id-column, or fix the lines"
        )
    return ids


def predict_files(model: InferenceModel, settings: PredictSettings) -> PredictSummary:
    """Score every row of ``settings.files`` with ``model`` and write the scores.

    Args:
        model: the loaded model.
        settings: the inputs, the output and how to read and write them.

    Returns:
        What was written.

    Raises:
        DataFileNotFoundError: for a missing input file.
        FileNotFoundError: for an output whose directory does not exist.
        DataError: for bad input (a missing column, naming it and the file; a bad line
            under ``on_bad_line="error"``, naming the file, line and field).
        ValueError: for a bad setting (format, source, id column).
    """
    if not settings.files:
        raise ValueError("predict needs at least one input file")
    if settings.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {settings.batch_size}")
    fmt = _output_format(settings)
    _check_paths(settings)
    model = _scoring_config(model, settings)
    dataset = model_dataset(model, settings.files, require_labels=False)
    labeled = has_labels(dataset)
    bad: BadLineSummary | None = getattr(dataset, "bad_lines", None)
    ids = None
    if settings.id_column is not None:
        ids = _read_ids(settings.files, settings.id_column, model.config.data, dataset.num_samples)
    elif bad is not None and bad.skipped:
        logger.warning(
            "%d bad lines were skipped: the output's row numbers count the rows kept, not "
            "the input's lines (name an --id-column to keep track)",
            bad.skipped,
        )
    tmp = settings.output.parent / f".{settings.output.name}.tmp-{os.getpid()}"
    writer = OUTPUT_FORMATS[fmt](tmp)
    done, total = 0, 0.0
    try:
        for batch in batches(dataset, batch_size=settings.batch_size, progress=settings.progress):
            batch = batch.to(model.device)
            scores = model.predict(batch.dense, batch.sparse).float().cpu().numpy()
            n = scores.shape[0]
            key = ids[done : done + n] if ids is not None else np.arange(done, done + n)
            columns = {"id" if ids is not None else "row": key, "score": scores}
            if labeled:
                columns["label"] = batch.labels.cpu().numpy().astype(np.int8)
            writer.write(columns)
            done, total = done + n, total + float(scores.astype(np.float64).sum())
        writer.close()
        tmp.replace(settings.output)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return PredictSummary(
        rows=done,
        output=settings.output,
        output_format=fmt,
        id_column=settings.id_column,
        mean_score=total / max(done, 1),
        bad_lines=bad,
        labeled=labeled,
    )
