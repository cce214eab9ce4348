"""Frozen configuration of the data pipeline: ``DataConfig`` and ``SyntheticConfig``.

Both are kw-only frozen dataclasses. String choices (``source``, ``on_bad_line``,
``dense_transform``) are parsed into ``StrEnum`` members in ``__post_init__`` (a
``StrEnum`` compares equal to its string, so ``config.source == "synthetic"`` keeps
working); lists given by a TOML file are normalized to tuples.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from tetrarec import jsonio

__all__ = [
    "BadLinePolicy",
    "CsvConfig",
    "DataConfig",
    "DataSource",
    "DenseKind",
    "SyntheticConfig",
    "expand_home",
]


_Choice = TypeVar("_Choice", bound=enum.StrEnum)


def _parse_choice(cls: type[_Choice], value: str | _Choice, what: str) -> _Choice:
    """The member of ``cls`` named ``value``, in any case as every config choice is.

    Raises:
        ValueError: listing the valid ones, if none is named so.
    """
    try:
        return cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{what} must be one of {valid}, got {value!r}") from None


class DataSource(enum.StrEnum):
    """Where training data comes from."""

    SYNTHETIC = "synthetic"
    CRITEO = "criteo"
    BINARY = "binary"
    PARQUET = "parquet"
    CSV = "csv"

    @classmethod
    def parse(cls, value: str | DataSource) -> DataSource:
        """Return the member for ``value``.

        Raises:
            ValueError: naming the valid values.
        """
        return _parse_choice(cls, value, "data source")


class BadLinePolicy(enum.StrEnum):
    """What a reader does with a malformed input line."""

    ERROR = "error"  # raise DataError naming file, line and field
    SKIP = "skip"  # drop the line, count it per reason, summarize at the end

    @classmethod
    def parse(cls, value: str | BadLinePolicy) -> BadLinePolicy:
        """Return the member for ``value``.

        Raises:
            ValueError: naming the valid values.
        """
        return _parse_choice(cls, value, "on_bad_line")


class DenseKind(enum.StrEnum):
    """What happens to one dense column before the model sees it (``tetrarec.data.dense``).

    Every kind works on the column's raw values (missing values are 0); clipping, when
    asked for, comes after it.
    """

    NONE = "none"  # the raw value
    LOG1P = "log1p"  # log(1 + max(x, 0)): Criteo's transform for its counts
    STANDARDIZE = "standardize"  # (x - mean) / std, over the training rows
    # log1p, then standardized with the mean and std of the log1p'd training rows: for
    # heavy-tailed counts (Criteo's) whose logs still sit far from mean 0 and std 1
    LOG1P_STANDARDIZE = "log1p_standardize"

    @property
    def standardizes(self) -> bool:
        """Whether this kind needs the training rows' mean and standard deviation."""
        return self in (DenseKind.STANDARDIZE, DenseKind.LOG1P_STANDARDIZE)

    @property
    def takes_log(self) -> bool:
        """Whether this kind starts with ``log(1 + max(x, 0))``."""
        return self in (DenseKind.LOG1P, DenseKind.LOG1P_STANDARDIZE)

    @classmethod
    def parse(cls, value: str | DenseKind) -> DenseKind:
        """Return the member for ``value``.

        Raises:
            ValueError: naming the valid values.
        """
        return _parse_choice(cls, value, "data.dense_transform")


AUTO_DENSE = "auto"  # DataConfig.dense_transform's default: the source's natural transform


def _dense_kinds(value: object) -> DenseKind | tuple[DenseKind, ...] | str:
    """``dense_transform`` normalized: ``"auto"``, one kind, or a tuple of kinds.

    An override's text comes as one string; ``"log1p,none"`` or ``"[log1p, none]"``
    (quotes allowed) is a list of kinds.
    """
    if isinstance(value, str) and ("," in value or value.startswith("[")):
        value = [v.strip().strip("\"'") for v in value.strip("[]").split(",") if v.strip()]
    if isinstance(value, str):
        value = value.lower()
        if value in (AUTO_DENSE, *DenseKind):
            return AUTO_DENSE if value == AUTO_DENSE else DenseKind(value)
        valid = ", ".join(repr(m.value) for m in DenseKind)
        raise ValueError(
            f"data.dense_transform must be 'auto' (the source's default), one of {valid}, or "
            f"a list of those, one per dense column; got {value!r}"
        )
    if not isinstance(value, Iterable) or not value:
        raise ValueError(
            f"DataConfig.dense_transform must be 'auto', a kind or a non-empty list of kinds "
            f"(one per dense column), got {value!r}"
        )
    return tuple(DenseKind.parse(v) for v in value)


def _dense_clip(value: object) -> tuple[tuple[float, float], ...] | tuple[float, float] | None:
    """``dense_clip`` normalized: ``None``, one ``(lo, hi)`` or a tuple of them.

    A bound may be the string ``"inf"`` or ``"-inf"`` (``jsonio.parse_inf``): JSON has
    no number for an infinity, so a checkpoint's ``meta.json`` holds the config so.
    """
    if value is None:
        return None
    bad = ValueError(
        "DataConfig.dense_clip must be [lo, hi] (every column) or a list of [lo, hi], one "
        f"per dense column (-inf and inf leave a side open), with lo < hi; got {value!r}"
    )
    if not isinstance(value, Iterable) or isinstance(value, str):
        raise bad
    items = [jsonio.parse_inf(v) for v in value]
    pairs = items if items and not isinstance(items[0], int | float) else [items]
    out = []
    for pair in pairs:
        if isinstance(pair, str) or not isinstance(pair, Iterable):
            raise bad
        bounds = [jsonio.parse_inf(b) for b in pair]
        if len(bounds) != 2 or not all(
            isinstance(b, int | float) and not isinstance(b, bool) for b in bounds
        ):
            raise bad
        lo, hi = float(bounds[0]), float(bounds[1])
        if not lo < hi:  # also refuses nan
            raise bad
        out.append((lo, hi))
    if pairs is not items:  # one pair for every column
        return out[0]
    return tuple(out)


def _positive(owner: str, **values: int | float) -> None:
    for name, v in values.items():
        if v <= 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """The built-in power-law data with a planted teacher (see ``tetrarec.data.synthetic``).

    Every sample is a pure function of ``(seed, row index)``: any row can be read in any
    order, on any rank, without generating the others.

    Args:
        num_samples: rows of the training split (rows ``[0, num_samples)``).
        eval_samples: rows of the held-out split (rows that follow the training rows).
        zipf: power-law exponent ``s`` of the id distribution, ``P(rank k) ~ k^-s``.
        pooling: mean ids per bag; 1 is one-hot, above 1 bag lengths vary uniformly in
            ``[1, 2*pooling-1]``.
        pooling_per_feature: optional per-feature override of ``pooling`` (one entry per
            feature, in feature order); empty means ``pooling`` everywhere.
        num_dense: dense features per sample.
        seed: the seed of both the inputs and the teacher.
        dense_weight: scale of the teacher's dense (linear) term.
        id_weight: scale of the teacher's per-id scalar term (summed over features).
        interaction_rank: rank ``k`` of the teacher's per-id vectors for the pairwise term.
        interaction_weight: scale of the pairwise (factorization machine) term.
        target_ctr: the intercept is chosen so that the mean label is about this value.

    The default teacher (for 26 tables of 10k-100k rows) has a Bayes AUC of about 0.82;
    its dense term alone gives 0.63, so a model must learn the frequent ids' effects to
    pass 0.70 (a small DLRM does within about 150k samples).
    """

    num_samples: int = 1_000_000
    eval_samples: int = 100_000
    zipf: float = 1.05
    pooling: int = 1
    pooling_per_feature: tuple[int, ...] = ()
    num_dense: int = 13
    seed: int = 0
    dense_weight: float = 0.6
    id_weight: float = 1.3
    interaction_rank: int = 4
    interaction_weight: float = 0.9
    target_ctr: float = 0.25

    def __post_init__(self) -> None:
        """Validate the fields (``ValueError`` names the field) and normalize them."""
        _positive(
            "SyntheticConfig",
            num_samples=self.num_samples,
            eval_samples=self.eval_samples,
            zipf=self.zipf,
            pooling=self.pooling,
            interaction_rank=self.interaction_rank,
        )
        object.__setattr__(self, "pooling_per_feature", tuple(self.pooling_per_feature))
        if any(p < 1 for p in self.pooling_per_feature):
            raise ValueError(
                f"SyntheticConfig.pooling_per_feature entries must be >= 1, "
                f"got {self.pooling_per_feature}"
            )
        if self.num_dense < 0:
            raise ValueError(f"SyntheticConfig.num_dense must be >= 0, got {self.num_dense}")
        if not 0.0 < self.target_ctr < 1.0:
            raise ValueError(f"SyntheticConfig.target_ctr must be in (0, 1), got {self.target_ctr}")
        for name in ("dense_weight", "id_weight", "interaction_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"SyntheticConfig.{name} must be >= 0, got {getattr(self, name)}")


def _as_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"expected a string or a list of strings, got {value!r}")
    return tuple(str(v) for v in value)


def expand_home(path: str | None) -> str | None:
    """``path`` with a leading ``~`` or ``~user`` made the home directory.

    A config's paths come from TOML or ``--set``, which no shell expands: without this,
    ``checkpoint_dir = "~/ck"`` would write to a directory named ``~`` in the working
    directory.
    """
    return None if path is None else os.path.expanduser(path)


def _check_rows(name: str, rows: tuple[int, int] | None) -> tuple[int, int] | None:
    if rows is None:
        return None
    bounds = tuple(int(r) for r in rows)  # TOML gives a list
    if len(bounds) != 2 or not 0 <= bounds[0] < bounds[1]:
        raise ValueError(
            f"DataConfig.{name} must be [start, stop) with 0 <= start < stop, got {bounds}"
        )
    return bounds[0], bounds[1]


_FORBIDDEN_DELIMITERS = '\n\r"'


@dataclass(frozen=True, kw_only=True)
class CsvConfig:
    """How the ``csv`` source reads its files (see ``tetrarec.data.csv_source``).

    Args:
        delimiter: the one ASCII character between fields (``","``, a tab,
            ``";"``, ...); not a newline or ``"``, which quotes fields. The two
            characters backslash and ``t`` also mean a tab (for ``--set``).
        header: the first line of every file names its columns. Without a header,
            ``column_names`` names them.
        column_names: every column of a headerless file, in order (empty with a
            header).
        multi_hot_columns: sparse columns whose field is a list of values joined by
            ``multi_hot_separator`` (``"a|b|c"``), one bag per row; empty items are
            dropped, so an empty field is an empty bag.
        multi_hot_separator: the separator inside a multi-hot field (backslash and
            ``t`` also mean a tab, as for ``delimiter``); when ``multi_hot_columns``
            are declared it must not contain ``delimiter`` (with ``delimiter = "|"``,
            set another separator than the default ``"|"``).

    Raises:
        ValueError: naming the field and the valid values.
    """

    delimiter: str = ","
    header: bool = True
    column_names: tuple[str, ...] = ()
    multi_hot_columns: tuple[str, ...] = ()
    multi_hot_separator: str = "|"

    def __post_init__(self) -> None:
        """Validate the fields (``ValueError`` names the field) and normalize them."""
        for name in ("delimiter", "multi_hot_separator"):
            if getattr(self, name) == "\\t":  # a tab, as typed in --set data.csv.delimiter=\t
                object.__setattr__(self, name, "\t")
        d = self.delimiter
        if len(d) != 1 or not d.isascii() or d in _FORBIDDEN_DELIMITERS:
            raise ValueError(
                f"CsvConfig.delimiter must be one ASCII character other than a newline or "
                f'a quote (e.g. ",", "\\t", ";"), got {d!r}'
            )
        for name in ("column_names", "multi_hot_columns"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        if self.header and self.column_names:
            raise ValueError(
                "CsvConfig.column_names names the columns of files without a header line; "
                "set header = false to use it (a header line names the columns itself)"
            )
        if not self.header and not self.column_names:
            raise ValueError("CsvConfig.header = false needs CsvConfig.column_names")
        dup = sorted({c for c in self.column_names if self.column_names.count(c) > 1})
        if dup:
            raise ValueError(f"CsvConfig.column_names repeats {dup}")
        sep = self.multi_hot_separator
        if not sep or any(c in sep for c in _FORBIDDEN_DELIMITERS):
            raise ValueError(
                f"CsvConfig.multi_hot_separator must be a non-empty string without a "
                f"newline or a quote, got {sep!r}"
            )
        # The separator matters only inside multi-hot fields: with none declared, the
        # default "|" must not refuse delimiter = "|".
        if self.multi_hot_columns and d in sep:
            raise ValueError(
                f"CsvConfig.multi_hot_separator {sep!r} contains the delimiter {d!r}, so "
                f"the multi-hot columns {list(self.multi_hot_columns)} could not be split; "
                f'set another multi_hot_separator (e.g. ";")'
            )


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the data comes from and how it is batched.

    Args:
        source: ``"synthetic"``, ``"criteo"`` (raw TSV or .gz files), ``"binary"`` (a
            directory written by ``preprocess_criteo``), ``"parquet"`` (files) or
            ``"csv"`` (delimited text files, plain or gzip; see ``csv``).
        train_path: input files (criteo, parquet, csv) or one directory (binary).
        eval_path: the same for evaluation; empty means "evaluate on ``train_path``
            rows ``eval_rows``" (and when ``eval_rows`` is None too, the last 10% of
            the training rows are held out).
        train_rows: ``[start, stop)`` 0-based rows of ``train_path`` to train on (file
            sources; the synthetic source ignores it, with a warning).
        eval_rows: ``[start, stop)`` rows of the evaluation input (file sources).
        batch_size: the global training batch (all ranks together).
        eval_batch_size: the global evaluation batch.
        shuffle: shuffle training rows each epoch.
        on_bad_line: ``"error"`` or ``"skip"`` (see ``BadLinePolicy``).
        prefetch: batches prepared ahead by the loader's thread (0: none).
        dense_columns: parquet/csv columns of the dense features, in order.
        sparse_columns: parquet/csv columns of the sparse features, in feature order
            (parquet: integer, string or list columns; csv: any text, hashed with
            ``hash_strings``).
        label_column: parquet/csv column of the 0/1 label.
        dense_transform: what the dense features go through before the model: ``"none"``
            (raw values), ``"log1p"`` (``log(1 + max(x, 0))``), ``"standardize"``
            (``(x - mean) / std`` of the raw values, with the mean and the standard
            deviation of the training rows), ``"log1p_standardize"`` (``log1p``, then
            standardized with the statistics of the log1p'd training rows), or a list
            with one of these per dense column. The default ``"auto"`` is the source's
            natural transform: ``"log1p"`` for criteo and binary (Criteo's counts),
            ``"none"`` for the others. Statistics are computed once from the training
            rows and saved in every checkpoint; evaluation, resume and inference reuse
            them.
        dense_clip: optional ``[lo, hi]`` applied to every dense column after the
            transform, or a list of ``[lo, hi]``, one per column (``-inf``/``inf``
            leave a side open; also as the strings ``"-inf"``/``"inf"``). A list's
            length, like ``dense_transform``'s, is checked against the data's dense
            columns when the data is loaded.
        synthetic: settings of the synthetic source.
        csv: how the csv source reads its files (delimiter, header or column names,
            multi-hot columns); see ``CsvConfig``.

    Raises:
        ValueError: naming the field and the valid values.
    """

    source: str = "synthetic"
    train_path: tuple[str, ...] = ()
    eval_path: tuple[str, ...] = ()
    train_rows: tuple[int, int] | None = None
    eval_rows: tuple[int, int] | None = None
    batch_size: int = 2048
    eval_batch_size: int = 8192
    shuffle: bool = True
    on_bad_line: str = "error"
    prefetch: int = 2
    dense_columns: tuple[str, ...] = ()
    sparse_columns: tuple[str, ...] = ()
    label_column: str = "label"
    # Dense features (tetrarec.data.dense): the transform and the optional clipping.
    dense_transform: str | tuple[str, ...] = AUTO_DENSE
    dense_clip: tuple[float, float] | tuple[tuple[float, float], ...] | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # The csv source (issue 9): its reading settings, checked against the mapping below.
    csv: CsvConfig = field(default_factory=CsvConfig)

    def __post_init__(self) -> None:
        """Validate the fields (``ValueError`` names the field) and normalize them."""
        source = DataSource.parse(self.source)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "on_bad_line", BadLinePolicy.parse(self.on_bad_line))
        for name in ("train_path", "eval_path", "dense_columns", "sparse_columns"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        for name in ("train_path", "eval_path", "dense_columns", "sparse_columns"):
            if "" in getattr(self, name):
                raise ValueError(f"DataConfig.{name} has an empty entry: {getattr(self, name)}")
        for name in ("train_path", "eval_path"):
            object.__setattr__(self, name, tuple(map(os.path.expanduser, getattr(self, name))))
        object.__setattr__(self, "train_rows", _check_rows("train_rows", self.train_rows))
        object.__setattr__(self, "eval_rows", _check_rows("eval_rows", self.eval_rows))
        _positive("DataConfig", batch_size=self.batch_size, eval_batch_size=self.eval_batch_size)
        if self.prefetch < 0:
            raise ValueError(f"DataConfig.prefetch must be >= 0, got {self.prefetch}")
        object.__setattr__(self, "dense_transform", _dense_kinds(self.dense_transform))
        object.__setattr__(self, "dense_clip", _dense_clip(self.dense_clip))
        if isinstance(self.synthetic, dict):
            object.__setattr__(self, "synthetic", SyntheticConfig(**self.synthetic))
        if source != DataSource.SYNTHETIC and not self.train_path:
            raise ValueError(f"DataConfig.train_path is needed for source {source.value!r}")
        if source == DataSource.BINARY and (len(self.train_path) > 1 or len(self.eval_path) > 1):
            raise ValueError(
                f"source 'binary' reads one directory per split, got train_path="
                f"{self.train_path} eval_path={self.eval_path}"
            )
        if source in (DataSource.PARQUET, DataSource.CSV) and not self.sparse_columns:
            raise ValueError(
                f"source {source.value!r} needs DataConfig.sparse_columns (the mapping)"
            )
        self._check_csv(source)

    def _check_csv(self, source: DataSource) -> None:
        """Normalize ``csv`` and check it against the column mapping."""
        if isinstance(self.csv, dict):
            object.__setattr__(self, "csv", CsvConfig(**self.csv))
        if source != DataSource.CSV:
            return
        extra = [c for c in self.csv.multi_hot_columns if c not in self.sparse_columns]
        if extra:
            raise ValueError(
                f"DataConfig.csv.multi_hot_columns {extra} are not sparse_columns "
                f"{list(self.sparse_columns)}"
            )
        mapped = [self.label_column, *self.dense_columns, *self.sparse_columns]
        missing = [c for c in mapped if self.csv.column_names and c not in self.csv.column_names]
        if missing:
            raise ValueError(
                f"DataConfig columns {missing} are not in csv.column_names "
                f"{list(self.csv.column_names)}"
            )
