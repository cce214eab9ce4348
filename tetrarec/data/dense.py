"""Dense-feature transforms, fitted once on the training rows: ``DenseTransform``.

Readers return raw dense values (float32, missing -> 0). One ``DenseTransform`` maps
them to what the model sees, the same way for training, evaluation and inference::

    raw (B, D) float32 --float64--> per column c:                  --clip c--> float32
        none         x
        log1p        log(1 + max(x, 0))                    (Criteo's counts)
        standardize  (x - mean_c) / std_c                  (of the raw values)
        log1p_standardize  (log1p(x) - mean_c) / std_c     (of the log1p'd values)

``mean_c`` and ``std_c`` (population standard deviation) are computed in one streaming
pass over the **training rows only** (``DenseTransform.fit``), saved in every
checkpoint (``to_dict``) and reloaded from it (``from_dict``): evaluation and a resumed
run never refit, so no evaluation row ever leaks into them. ``standardize`` works on
the raw values; ``log1p_standardize`` composes the two for heavy-tailed counts (Criteo's
log1p'd counts have means of 1-5 and spreads of 0.5-3, so they are still far from what
the MLP's initialization expects).

``TransformedDataset`` wraps any ``Dataset`` and applies a transform at read time;
``build_datasets`` wraps both splits with the transform fitted on the training split.

Data written already transformed (a binary directory of format version 1 stores
``log1p`` values) says so through its ``dense_applied`` attribute: such columns are
not transformed twice, and any other kind on them is an error that tells the user to
re-run ``tetrarec preprocess``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from tetrarec import jsonio
from tetrarec.data.config import AUTO_DENSE, DataConfig, DenseKind
from tetrarec.data.datasets import Dataset, has_labels, read_dense_rows
from tetrarec.data.errors import BadLineSummary, DataError
from tetrarec.sparse import Batch

__all__ = ["DenseSpec", "DenseTransform", "TransformedDataset"]

logger = logging.getLogger(__name__)

FIT_CHUNK_ROWS = 1 << 16  # rows per chunk of the fitting pass (~7 MB of float64 at D=13)
_DICT_VERSION = 1

_Array = TypeVar("_Array", np.ndarray, torch.Tensor)


def _per_column(what: str, value: Sequence[Any], columns: tuple[str, ...]) -> None:
    if len(value) != len(columns):
        raise ValueError(
            f"data.{what} lists {len(value)} entries, one per dense column, but the data has "
            f"{len(columns)} dense columns ({', '.join(columns)})"
        )


@dataclass(frozen=True, kw_only=True)
class DenseSpec:
    """What to do to each dense column, before statistics are fitted.

    Args:
        columns: the dense columns' names (for messages and checkpoints).
        kinds: one ``DenseKind`` per column.
        clip: ``(lo, hi)`` per column, applied after the transform; ``None``: no clip.

    Raises:
        ValueError: if ``kinds`` or ``clip`` has not one entry per column.
    """

    columns: tuple[str, ...]
    kinds: tuple[DenseKind, ...]
    clip: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        """Check the per-column lengths."""
        _per_column("dense_transform", self.kinds, self.columns)
        if self.clip is not None:
            _per_column("dense_clip", self.clip, self.columns)

    @classmethod
    def from_config(
        cls, config: DataConfig, *, columns: Sequence[str], default: DenseKind
    ) -> DenseSpec:
        """The spec ``config.dense_transform`` and ``dense_clip`` describe for ``columns``.

        Args:
            config: the data configuration.
            columns: the names of the data's dense columns (their count is the data's).
            default: the source's natural kind, used for ``dense_transform = "auto"``.

        Raises:
            ValueError: if a list in the config has not one entry per dense column.
        """
        names = tuple(columns)
        kinds = config.dense_transform
        if kinds == AUTO_DENSE:
            kinds = default
        if isinstance(kinds, str):  # one DenseKind for every column
            kinds = (DenseKind(kinds),) * len(names)
        clip = config.dense_clip
        if clip is not None and not isinstance(clip[0], tuple):  # one (lo, hi) for all
            clip = (clip,) * len(names)
        return cls(
            columns=names,
            kinds=tuple(DenseKind(k) for k in kinds),
            clip=None if clip is None else tuple((float(lo), float(hi)) for lo, hi in clip),
        )

    @property
    def needs_statistics(self) -> bool:
        """Whether a column is standardized (so fitting reads the training rows)."""
        return any(k.standardizes for k in self.kinds)


def _check_applied(
    columns: Sequence[str], kinds: Sequence[DenseKind], applied: DenseKind, where: str
) -> None:
    """Refuse a kind that data stored already transformed by ``applied`` cannot give.

    Raises:
        DataError: naming the column, the kind and how to get raw values back.
    """
    if applied == DenseKind.NONE:
        return
    for name, kind in zip(columns, kinds):
        if kind != applied:
            raise DataError(
                f"{where} stores dense values already transformed by {applied.value} (a binary "
                f"directory of format version 1, written by an older `tetrarec preprocess`), "
                f"so dense column {name} cannot be given {kind.value!r}; re-run "
                "`tetrarec preprocess criteo` on the raw files to write the raw values "
                f"(format version 2), or set data.dense_transform = {applied.value!r}"
            )


@dataclass(frozen=True, kw_only=True)
class DenseTransform:
    """A fitted dense transform: per-column kind, statistics and clipping.

    ``mean`` and ``std`` are 0 and 1 for columns that are not standardized.

    >>> t = DenseTransform(columns=("a", "b"), kinds=("log1p", "standardize"),
    ...                    mean=(0.0, 10.0), std=(1.0, 2.0), clip=((-9, 9), (-1, 1)))
    >>> t.apply(np.array([[-4.0, 12.0], [np.e - 1, 20.0]], dtype=np.float32)).tolist()
    [[0.0, 1.0], [1.0, 1.0]]

    Args:
        columns: the dense columns' names.
        kinds: one ``DenseKind`` (or its name) per column.
        mean: per-column mean of the training values (standardized columns: of the raw
            values, or of their ``log1p`` for ``log1p_standardize``).
        std: per-column population standard deviation, > 0 (standardized columns).
        clip: ``(lo, hi)`` per column, applied after the transform; ``None``: no clip.

    Raises:
        ValueError: if the fields have different lengths, a statistic is not finite, a
            standard deviation is not positive, or a clip bound pair is not ``lo < hi``.
    """

    columns: tuple[str, ...]
    kinds: tuple[DenseKind, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    clip: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        """Normalize the fields to tuples of kinds and floats, and check them."""
        object.__setattr__(self, "columns", tuple(str(c) for c in self.columns))
        object.__setattr__(self, "kinds", tuple(DenseKind.parse(k) for k in self.kinds))
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        for what in ("kinds", "mean", "std"):
            if len(getattr(self, what)) != len(self.columns):
                raise ValueError(
                    f"DenseTransform.{what} has {len(getattr(self, what))} entries for "
                    f"{len(self.columns)} columns"
                )
        for name, m, s in zip(self.columns, self.mean, self.std):
            if not (math.isfinite(m) and math.isfinite(s) and s > 0):
                raise ValueError(
                    f"DenseTransform: column {name} needs a finite mean and a finite std > 0, "
                    f"got mean={m} std={s}"
                )
        if self.clip is not None:
            clip = tuple((float(lo), float(hi)) for lo, hi in self.clip)
            object.__setattr__(self, "clip", clip)
            if len(clip) != len(self.columns) or not all(lo < hi for lo, hi in clip):
                raise ValueError(
                    f"DenseTransform.clip must be one (lo, hi) with lo < hi per column "
                    f"({len(self.columns)}), got {self.clip}"
                )

    @property
    def num_dense(self) -> int:
        """``D``, the number of dense columns."""
        return len(self.columns)

    @property
    def is_identity(self) -> bool:
        """Whether ``apply`` returns its input unchanged (no transform, no clip)."""
        return self.clip is None and all(k == DenseKind.NONE for k in self.kinds)

    def check_columns(self, columns: Sequence[str], where: str) -> None:
        """Check that data whose dense columns are ``columns`` fits this transform.

        The transform is applied by position. The same names in another order (a
        ``data.dense_columns`` reordered since the statistics were fitted) would apply
        each column's statistics to another column: an error. Other names (a renamed
        file, or columns that carry no names) are only warned about.

        Raises:
            ValueError: if ``columns`` are this transform's columns in another order.
        """
        columns = tuple(columns)
        if columns == self.columns:
            return
        if sorted(columns) == sorted(self.columns):
            raise ValueError(
                f"{where} maps the dense columns in the order ({', '.join(columns)}), but the "
                f"dense transform was fitted on ({', '.join(self.columns)}) in that order: "
                "set data.dense_columns in the run's order"
            )
        logger.warning(
            "%s has the dense columns (%s); the dense transform was fitted on (%s): applying "
            "it by position",
            where,
            ", ".join(columns),
            ", ".join(self.columns),
        )

    # --- fitting ----------------------------------------------------------------------

    @classmethod
    def without_statistics(cls, spec: DenseSpec) -> DenseTransform:
        """The transform of ``spec`` when no column needs statistics.

        Raises:
            ValueError: if a column is standardized (its statistics must be fitted on
                training rows or read from a checkpoint).
        """
        if spec.needs_statistics:
            col = next(c for c, k in zip(spec.columns, spec.kinds) if k.standardizes)
            raise ValueError(
                f"dense column {col} is standardized, so its mean and standard deviation must "
                "come from the training rows (or a checkpoint that saved them)"
            )
        d = len(spec.columns)
        return cls(
            columns=spec.columns, kinds=spec.kinds, mean=(0.0,) * d, std=(1.0,) * d, clip=spec.clip
        )

    @classmethod
    def fit(
        cls,
        dataset: Dataset,
        spec: DenseSpec,
        *,
        chunk_rows: int = FIT_CHUNK_ROWS,
        where: str = "the training data",
    ) -> DenseTransform:
        """Fit ``spec`` on every row of ``dataset`` (pass the training rows only).

        Only standardized columns need statistics; without one, no row is read. The
        pass reads ``chunk_rows`` rows at a time (memory-mapped data stays on disk) in
        row order, accumulates in float64 and merges the chunks' means and squared
        deviations (Chan et al.), so the result depends only on the rows and
        ``chunk_rows``: every rank of a sharded run computes the same numbers. A constant
        column (its minimum equals its maximum) gets its value as mean and 1 as standard
        deviation (it is only centred, to exactly 0), with a warning.

        Args:
            dataset: the training rows.
            spec: the kinds and clipping, one per dense column of ``dataset``.
            chunk_rows: rows per chunk.
            where: names ``dataset`` in error messages (its files).

        Returns:
            The fitted transform.

        Raises:
            ValueError: if ``spec`` has not one entry per dense column of ``dataset``.
            DataError: if a standardized column holds nan or inf (naming the column and
                the row), or ``dataset`` stores already transformed values a kind cannot
                be computed from.
        """
        if len(spec.columns) != dataset.num_dense:
            raise ValueError(
                f"the dense transform has {len(spec.columns)} columns, the data has "
                f"{dataset.num_dense} dense columns"
            )
        applied = DenseKind(getattr(dataset, "dense_applied", DenseKind.NONE))
        _check_applied(spec.columns, spec.kinds, applied, where)
        if not spec.needs_statistics:
            return cls.without_statistics(spec)
        cols = np.flatnonzero([k.standardizes for k in spec.kinds])
        logs = np.array([spec.kinds[c].takes_log for c in cols], dtype=bool)
        count, mean, m2 = 0, np.zeros(cols.size), np.zeros(cols.size)
        # A constant column is told by its range, exactly: its float64 mean is rounded, so
        # its squared deviations sum to ~1e-29, not 0, and a test of std > 0 would keep a
        # std of ~1e-16 that blows any other value up to ~1e14.
        lo, hi = np.full(cols.size, np.inf), np.full(cols.size, -np.inf)
        for start in range(0, dataset.num_samples, chunk_rows):
            stop = min(start + chunk_rows, dataset.num_samples)
            x = np.asarray(read_dense_rows(dataset, start, stop))[:, cols].astype(np.float64)
            _check_finite(x, start, [spec.columns[c] for c in cols])
            x[:, logs] = np.log1p(np.maximum(x[:, logs], 0.0))
            n = x.shape[0]
            np.minimum(lo, x.min(axis=0), out=lo)
            np.maximum(hi, x.max(axis=0), out=hi)
            chunk_mean = x.mean(axis=0)
            chunk_m2 = np.square(x - chunk_mean).sum(axis=0)
            delta = chunk_mean - mean
            total = count + n
            mean = mean + delta * (n / total)
            m2 = m2 + chunk_m2 + np.square(delta) * (count * n / total)
            count = total
        std = np.sqrt(m2 / count)
        means, stds = [0.0] * len(spec.columns), [1.0] * len(spec.columns)
        for j, c in enumerate(cols):
            if lo[j] < hi[j]:
                means[c], stds[c] = float(mean[j]), float(std[j])
            else:
                means[c] = float(lo[j])  # the constant itself, not its rounded mean
                logger.warning(
                    "dense column %s is constant (%g) over the %d training rows: its standard "
                    "deviation is 0, so it is only centred (std taken as 1)",
                    spec.columns[c],
                    means[c],
                    count,
                )
        return cls(
            columns=spec.columns,
            kinds=spec.kinds,
            mean=tuple(means),
            std=tuple(stds),
            clip=spec.clip,
        )

    # --- applying ---------------------------------------------------------------------

    def apply(self, x: _Array) -> _Array:
        """Transform raw dense values ``x`` of shape ``(B, D)``; float32 out.

        A numpy array is computed in numpy (float64 inside); a CPU tensor goes through
        the same numpy code, so a batch gives bitwise the same values either way. A
        tensor on another device is computed there with torch ops in float64 (the same
        values up to the last bit of ``log1p``).

        Raises:
            ValueError: if ``x`` is not ``(B, D)``.
        """
        if x.ndim != 2 or x.shape[1] != self.num_dense:
            raise ValueError(f"dense values must be (B, {self.num_dense}), got {tuple(x.shape)}")
        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu":
                return torch.from_numpy(self._apply_numpy(x.detach().numpy()))
            return self._apply_torch(x)
        return self._apply_numpy(x)

    def _apply_numpy(self, x: np.ndarray) -> np.ndarray:
        if self.is_identity:
            return np.ascontiguousarray(x, dtype=np.float32)
        y = np.array(x, dtype=np.float64)  # our own copy, updated in place below
        log = np.array([k.takes_log for k in self.kinds])
        if log.all():  # Criteo's default: whole-array calls, as the reader once made
            np.maximum(y, 0.0, out=y)
            np.log1p(y, out=y)
        elif log.any():
            y[:, log] = np.log1p(np.maximum(y[:, log], 0.0))
        if any(k.standardizes for k in self.kinds):
            # mean 0 and std 1 elsewhere: (y - 0) / 1 is exactly y
            y -= np.array(self.mean)
            y /= np.array(self.std)
        if self.clip is not None:
            lo = np.array([c[0] for c in self.clip])  # (D,)
            hi = np.array([c[1] for c in self.clip])  # (D,)
            np.clip(y, lo, hi, out=y)
        with np.errstate(over="ignore"):  # TransformedDataset warns once, by column
            out: np.ndarray = y.astype(np.float32)
        return out

    def _apply_torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_identity:
            return x.to(torch.float32)
        y = x.to(torch.float64)
        log = torch.tensor([k.takes_log for k in self.kinds], device=y.device)
        y = torch.where(log, torch.log1p(y.clamp_min(0.0)), y)
        if any(k.standardizes for k in self.kinds):
            y = (y - y.new_tensor(self.mean)) / y.new_tensor(self.std)
        if self.clip is not None:
            lo = y.new_tensor([c[0] for c in self.clip])  # (D,)
            hi = y.new_tensor([c[1] for c in self.clip])  # (D,)
            y = torch.clamp(y, lo, hi)
        return y.to(torch.float32)

    def after(self, applied: DenseKind | str, where: str = "the data") -> DenseTransform:
        """What is left to apply to data stored already transformed by ``applied``.

        For ``none`` that is the whole transform; for ``log1p`` (binary format version
        1) every column must be ``log1p``, and only the clipping is left.

        Raises:
            DataError: if a column's kind cannot be computed from the stored values.
        """
        kind = DenseKind(applied)
        if kind == DenseKind.NONE:
            return self
        _check_applied(self.columns, self.kinds, kind, where)
        d = self.num_dense
        none = (DenseKind.NONE,) * d
        return DenseTransform(
            columns=self.columns, kinds=none, mean=(0.0,) * d, std=(1.0,) * d, clip=self.clip
        )

    # --- saving -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (a checkpoint's ``meta.json`` holds them)."""
        return {
            "version": _DICT_VERSION,
            "columns": list(self.columns),
            "kinds": [k.value for k in self.kinds],
            "mean": list(self.mean),
            "std": list(self.std),
            # an open side (+-inf) as "inf"/"-inf": JSON has no number for it
            "clip": None
            if self.clip is None
            else [[jsonio.inf_text(b) for b in c] for c in self.clip],
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DenseTransform:
        """Inverse of ``to_dict`` (floats round-trip exactly through JSON).

        A clip bound may be ``"inf"``/``"-inf"`` (as ``to_dict`` writes it) or a float
        infinity (as checkpoints of earlier versions hold it, ``-Infinity``).

        Raises:
            ValueError: if ``values`` is not a saved transform of a known version.
        """
        if not isinstance(values, dict) or values.get("version") != _DICT_VERSION:
            raise ValueError(
                f"not a saved dense transform of version {_DICT_VERSION}: {values!r:.200}"
            )
        try:
            clip = values["clip"]
            return cls(
                columns=tuple(values["columns"]),
                kinds=tuple(values["kinds"]),
                mean=tuple(values["mean"]),
                std=tuple(values["std"]),
                clip=None
                if clip is None
                else tuple((jsonio.parse_inf(lo), jsonio.parse_inf(hi)) for lo, hi in clip),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed saved dense transform ({e!r}): {values!r:.200}") from e


def _check_finite(x: np.ndarray, first_row: int, names: Sequence[str]) -> None:
    """Raise ``DataError`` naming the first nan or inf of a chunk (row-major order)."""
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise DataError(
            f"dense column {names[col]} holds {x[row, col]} at training row "
            f"{first_row + int(row)} (0-based); standardize needs finite values: clean the data "
            "or choose another data.dense_transform for this column"
        )


class TransformedDataset:
    """Another dataset's rows with a fitted ``DenseTransform`` applied to the dense part.

    Sparse features and labels pass through untouched. Applied identically to the
    training and evaluation splits, and after a resume or from a checkpoint.

    Args:
        base: the raw dataset.
        transform: the fitted transform (``transform.num_dense == base.num_dense``).
        where: names ``base`` in error messages (its files).

    Raises:
        ValueError: if the transform has another number of columns than ``base``.
        DataError: if ``base`` stores already transformed values (old binary format)
            that ``transform`` cannot be computed from.
    """

    def __init__(
        self, base: Dataset, transform: DenseTransform, *, where: str = "the data"
    ) -> None:
        if transform.num_dense != base.num_dense:
            raise ValueError(
                f"the dense transform has {transform.num_dense} columns "
                f"({', '.join(transform.columns)}) but {where} has {base.num_dense} dense columns"
            )
        applied = DenseKind(getattr(base, "dense_applied", DenseKind.NONE))
        self._effective = transform.after(applied, where)
        self.base, self.transform, self.where = base, transform, where
        self.num_samples = base.num_samples
        self.num_dense = base.num_dense
        self.keys = base.keys
        self.bad_lines: BadLineSummary | None = getattr(base, "bad_lines", None)
        self.has_labels = has_labels(base)
        self._warned_overflow = False

    def with_transform(self, transform: DenseTransform) -> TransformedDataset:
        """The same rows with ``transform`` instead (a checkpoint's saved statistics)."""
        return TransformedDataset(self.base, transform, where=self.where)

    def read(self, indices: np.ndarray) -> Batch:
        """The batch of rows ``indices`` with its dense part transformed."""
        batch = self.base.read(indices)
        if self._effective.is_identity:
            return batch
        raw = batch.dense.numpy()
        out = self._effective.apply(raw)
        if not self._warned_overflow:
            self._warn_overflow(raw, out, indices)
        return Batch(torch.from_numpy(out), batch.sparse, batch.labels)

    def _warn_overflow(self, raw: np.ndarray, out: np.ndarray, indices: np.ndarray) -> None:
        """Warn once when a finite raw value becomes inf in float32.

        Such a value lies millions of standard deviations out: the model's output will
        overflow with it.
        """
        if np.isfinite(out).all():  # every batch until a warning: one pass, no temporaries
            return
        bad = ~np.isfinite(out) & np.isfinite(raw)
        if not bad.any():
            return
        self._warned_overflow = True
        row, col = np.argwhere(bad)[0]
        logger.warning(
            "dense column %s: the value %r of row %d of %s is %s after its transform (%s) in "
            "float32; the model's output will not be finite (set data.dense_clip to bound it)",
            self.transform.columns[col],
            float(raw[row, col]),
            int(np.asarray(indices).reshape(-1)[row]),
            self.where,
            out[row, col],
            self.transform.kinds[col].value,
        )
