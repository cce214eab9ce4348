"""``build_datasets``: the (train, eval) datasets a ``DataConfig`` describes.

One loader per source, in the ``LOADERS`` registry keyed by ``DataSource``; row ranges
and the evaluation split are applied the same way for every file source. Loaders return
raw dense values; both splits are then wrapped in a ``TransformedDataset`` with the
dense transform fitted on the training split only (``tetrarec.data.dense``).

Training always requires labels: a file without its label column is refused, naming the
column and the file. Only ``evaluation_dataset(..., require_labels=False)`` (scoring)
reads files without one; the dataset then says ``has_labels = False``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from tetrarec.data.binary import open_binary
from tetrarec.data.config import DataConfig, DataSource, DenseKind
from tetrarec.data.criteo import DENSE_FIELDS, read_criteo
from tetrarec.data.csv_source import CsvDataset
from tetrarec.data.datasets import ColumnsDataset, Dataset, RowRange
from tetrarec.data.dense import DenseSpec, DenseTransform, TransformedDataset
from tetrarec.data.errors import BadLineSummary
from tetrarec.data.multi_hot import ColumnMapping
from tetrarec.data.parquet import ParquetDataset
from tetrarec.data.synthetic import SyntheticDataset
from tetrarec.embedding.config import TableConfig

__all__ = [
    "LOADERS",
    "NATURAL_DENSE",
    "Loader",
    "build_datasets",
    "dense_spec",
    "evaluation_dataset",
    "input_bad_lines",
    "log_bad_lines",
]

logger = logging.getLogger(__name__)

_HOLDOUT = 10  # without eval_path and eval_rows, the last 1/10 of the rows is held out


class Loader(Protocol):
    """Reads the files of one source into a dataset (an entry of ``LOADERS``)."""

    def __call__(
        self,
        paths: tuple[str, ...],
        config: DataConfig,
        tables: Sequence[TableConfig],
        *,
        require_labels: bool = True,
    ) -> Dataset:
        """The rows of ``paths``.

        Args:
            paths: the files (or the one directory) to read.
            config: the data settings (columns, csv options, bad-line rule).
            tables: the model's tables.
            require_labels: refuse files without labels (training); when false, such
                files are read and the dataset says ``has_labels = False`` (scoring).
        """
        ...


def _load_criteo(
    paths: tuple[str, ...],
    config: DataConfig,
    tables: Sequence[TableConfig],
    *,
    require_labels: bool = True,
) -> Dataset:
    block, bad = read_criteo(paths, on_bad_line=config.on_bad_line, require_labels=require_labels)
    return ColumnsDataset(
        labels=block.labels,
        dense=block.dense,
        sparse=block.sparse,
        tables=tables,
        bad_lines=bad,
        has_labels=block.labeled,
    )


def _load_binary(
    paths: tuple[str, ...],
    config: DataConfig,
    tables: Sequence[TableConfig],
    *,
    require_labels: bool = True,  # a preprocessed directory always has its labels
) -> Dataset:
    if len(paths) != 1:
        raise ValueError(
            f"source 'binary' reads one directory (one tetrarec preprocess output), got "
            f"{len(paths)}: {', '.join(paths)}"
        )
    cols = open_binary(paths[0])
    return ColumnsDataset(
        labels=cols.labels,
        dense=cols.dense,
        sparse=cols.sparse,
        tables=tables,
        bad_lines=cols.bad_lines,
        dense_applied=cols.dense_applied,
    )


def _load_parquet(
    paths: tuple[str, ...],
    config: DataConfig,
    tables: Sequence[TableConfig],
    *,
    require_labels: bool = True,
) -> Dataset:
    return ParquetDataset(
        paths,
        dense_columns=config.dense_columns,
        sparse_columns=config.sparse_columns,
        label_column=config.label_column,
        tables=tables,
        require_labels=require_labels,
    )


def _load_csv(
    paths: tuple[str, ...],
    config: DataConfig,
    tables: Sequence[TableConfig],
    *,
    require_labels: bool = True,
) -> Dataset:
    mapping = ColumnMapping(
        label_column=config.label_column,
        dense_columns=config.dense_columns,
        sparse_columns=config.sparse_columns,
    )
    return CsvDataset(
        paths,
        mapping=mapping,
        tables=tables,
        csv=config.csv,
        on_bad_line=config.on_bad_line,
        require_labels=require_labels,
    )


LOADERS: dict[DataSource, Loader] = {
    DataSource.CRITEO: _load_criteo,
    DataSource.BINARY: _load_binary,
    DataSource.PARQUET: _load_parquet,
    DataSource.CSV: _load_csv,
}


# The kind ``data.dense_transform = "auto"`` means per source; any other source: none.
NATURAL_DENSE: dict[DataSource, DenseKind] = {
    DataSource.CRITEO: DenseKind.LOG1P,
    DataSource.BINARY: DenseKind.LOG1P,
}


def _dense_names(config: DataConfig, num_dense: int) -> tuple[str, ...]:
    """The dense columns' names: Criteo's I1..I13, the mapped columns, or dense0..."""
    if config.source in NATURAL_DENSE and num_dense == len(DENSE_FIELDS):
        return DENSE_FIELDS
    if len(config.dense_columns) == num_dense:
        return config.dense_columns
    return tuple(f"dense{i}" for i in range(num_dense))


def dense_spec(config: DataConfig, num_dense: int) -> DenseSpec:
    """The dense transform ``config`` asks for, for data with ``num_dense`` columns.

    Raises:
        ValueError: if ``data.dense_transform`` or ``data.dense_clip`` lists another
            number of entries than the data's dense columns.
    """
    return DenseSpec.from_config(
        config,
        columns=_dense_names(config, num_dense),
        default=NATURAL_DENSE.get(DataSource(config.source), DenseKind.NONE),
    )


def _rows(base: Dataset, rows: tuple[int, int] | None, what: str) -> Dataset:
    return base if rows is None else RowRange(base, *rows, what=what)


def _split_one_input(base: Dataset, config: DataConfig) -> tuple[Dataset, Dataset]:
    """Train and eval rows of one input (``eval_path`` empty)."""
    n = base.num_samples
    train_rows, eval_rows = config.train_rows, config.eval_rows
    if eval_rows is None:
        if train_rows is not None:
            eval_rows = (train_rows[1], n)  # the rows after the training rows
        else:
            cut = n - max(1, n // _HOLDOUT)
            if cut < 1:
                raise ValueError(
                    f"the input has {n} row(s): too few to hold some out for evaluation; "
                    "give more rows, data.eval_path or data.eval_rows"
                )
            train_rows, eval_rows = (0, cut), (cut, n)
            logger.info(
                "no eval_path or eval_rows: training on rows %s, evaluating on rows %s",
                train_rows,
                eval_rows,
            )
        if eval_rows[0] >= n:
            raise ValueError(
                f"train_rows {train_rows} leave no rows of the {n} for evaluation; "
                "set eval_rows or eval_path"
            )
    train = _rows(base, train_rows, "data.train_rows")
    # eval_rows not set: the rows after train_rows
    held_out = _rows(base, eval_rows, "data.eval_rows" if config.eval_rows else "eval rows")
    tr = (0, n) if train_rows is None else train_rows
    if max(tr[0], eval_rows[0]) < min(tr[1], eval_rows[1]):
        logger.warning("train rows %s and eval rows %s overlap", tr, eval_rows)
    return train, held_out


def build_datasets(
    config: DataConfig,
    tables: Sequence[TableConfig],
    *,
    dense: DenseTransform | None = None,
) -> tuple[TransformedDataset, TransformedDataset]:
    """Build the training and evaluation datasets.

    Feature ``i`` of the data is ``feature_order(tables)[i]``; Criteo, binary, parquet
    and csv categorical values are hashed into each feature's table ``num_embeddings``. The
    dense transform (``data.dense_transform``, ``data.dense_clip``) is fitted on the
    training split only, and applied to both.

    Args:
        config: the data configuration.
        tables: the model's tables.
        dense: an already fitted transform (a checkpoint's) to apply instead of fitting
            one; the config's dense fields are then not used.

    Returns:
        ``(train, eval)``, each with its ``transform``. File datasets carry
        ``bad_lines`` (a ``BadLineSummary``).

    Raises:
        DataFileNotFoundError: if an input is missing.
        DataError: for bad input data (see the readers), or a dense transform that the
            stored values cannot give (binary format version 1).
        ValueError: if the tables do not match the data's features, a row range does
            not fit the data, or a per-column dense list does not fit its columns.
    """
    train, held_out = _raw_datasets(config, tables)
    train_where = ", ".join(config.train_path) or "the synthetic data"
    eval_where = ", ".join(config.eval_path) or train_where
    if dense is None:
        spec = dense_spec(config, train.num_dense)
        dense = DenseTransform.fit(train, spec, where=train_where)
        if spec.needs_statistics:
            stats = ", ".join(
                f"{c} {m:.4g}+-{s:.4g}"
                for c, k, m, s in zip(dense.columns, dense.kinds, dense.mean, dense.std)
                if k.standardizes
            )
            logger.info("dense statistics of the %d training rows: %s", train.num_samples, stats)
    return (
        TransformedDataset(train, dense, where=train_where),
        TransformedDataset(held_out, dense, where=eval_where),
    )


def evaluation_dataset(
    config: DataConfig,
    tables: Sequence[TableConfig],
    saved: DenseTransform | None,
    files: Sequence[str] = (),
    *,
    require_labels: bool = True,
) -> TransformedDataset:
    """The rows a saved model is evaluated (or scores) on, through its saved transform.

    ``files`` of ``config.source`` (all their rows, unless ``config.eval_rows`` is set);
    without them the run's own evaluation split: ``config.eval_path`` alone when the
    model saved its transform (the training files may be gone), else the split
    ``build_datasets`` makes (rows of ``train_path``, or synthetic). The dense features
    go through ``saved`` (fitted on the run's training rows), never a transform refitted
    on these rows; a model too old to have saved one gets the source's default.

    With ``require_labels=False`` (scoring) files without labels are read too (a Criteo
    file of 39 fields, a csv or parquet file without ``data.label_column``); the
    dataset's ``has_labels`` then says whether every file had them.

    Raises:
        ValueError: for ``files`` of a source that reads none (synthetic), or dense
            columns mapped otherwise than the run's.
        DataFileNotFoundError, DataError: as the readers raise them.
    """
    load = LOADERS.get(DataSource(config.source))
    if files and load is None:
        valid = ", ".join(s.value for s in LOADERS)
        raise ValueError(
            f"reading files needs a file source ({valid}); the run's data.source is "
            f"{config.source!r}: set data.source"
        )
    own = config.eval_path if load is not None and saved is not None else ()
    paths = tuple(files) or tuple(own)
    if load is not None and paths:
        base = load(paths, config, tables, require_labels=require_labels)
        log_bad_lines(base, paths)  # data.on_bad_line = "skip" drops lines: say how many
        rows = config.eval_rows
        raw = base if rows is None else RowRange(base, *rows, what="data.eval_rows")
        if saved is None:  # an older checkpoint: the source's default, no statistics
            saved = DenseTransform.without_statistics(dense_spec(config, raw.num_dense))
        elif saved.num_dense == raw.num_dense:  # another count: TransformedDataset says so
            saved.check_columns(dense_spec(config, raw.num_dense).columns, ", ".join(paths))
        return TransformedDataset(raw, saved, where=", ".join(paths))
    _, eval_ds = build_datasets(config, tables, dense=saved)
    if saved is not None and saved.num_dense == eval_ds.num_dense:
        saved.check_columns(dense_spec(config, eval_ds.num_dense).columns, "the data")
    return eval_ds


def _raw_datasets(config: DataConfig, tables: Sequence[TableConfig]) -> tuple[Dataset, Dataset]:
    """``build_datasets`` before the dense transform: raw dense values."""
    if config.source == DataSource.SYNTHETIC:
        syn = config.synthetic
        if config.train_rows is not None or config.eval_rows is not None:
            logger.warning(
                "train_rows/eval_rows select rows of train_path files; the synthetic source "
                "ignores them (its splits are synthetic.num_samples and eval_samples)"
            )
        train = SyntheticDataset(syn, tables, num_samples=syn.num_samples)
        held_out = SyntheticDataset(
            syn, tables, num_samples=syn.eval_samples, row_offset=syn.num_samples
        )
        return train, held_out
    load = LOADERS[DataSource(config.source)]
    base = load(config.train_path, config, tables)
    log_bad_lines(base, config.train_path)
    if not config.eval_path:
        return _split_one_input(base, config)
    eval_base = load(config.eval_path, config, tables)
    log_bad_lines(eval_base, config.eval_path)
    return _rows(base, config.train_rows, "data.train_rows"), _rows(
        eval_base, config.eval_rows, "data.eval_rows"
    )


def input_bad_lines(config: DataConfig, train: Dataset, held_out: Dataset) -> BadLineSummary | None:
    """The lines skipped in the input files of ``build_datasets``'s ``(train, held_out)``.

    The read of ``train_path``, plus that of ``eval_path`` when the evaluation split
    has its own files (otherwise both splits are rows of one read, counted once);
    ``None`` for a source that reads no lines (synthetic, parquet).
    """
    bad: BadLineSummary | None = getattr(train, "bad_lines", None)
    held: BadLineSummary | None = getattr(held_out, "bad_lines", None)
    if bad is None or held is None or not config.eval_path:
        return bad
    return bad.merge(held)


def log_bad_lines(dataset: Dataset, paths: Sequence[str]) -> None:
    """Warn with the summary of the lines ``dataset``'s reader skipped, if any."""
    bad = getattr(dataset, "bad_lines", None)
    if bad is not None and bad.skipped:
        logger.warning("%s: %s", ", ".join(paths), bad.summary())
