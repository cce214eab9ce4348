"""Errors of the data readers and the summary of skipped bad lines.

Every problem with an input file surfaces as ``DataError`` (a ``ValueError``) or
``DataFileNotFoundError`` (a ``FileNotFoundError``) whose message names the file and,
for a malformed line, the 1-based line number and the field - never as a traceback
from deep inside pyarrow, gzip or numpy.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

__all__ = [
    "BadLineReason",
    "BadLineSummary",
    "BadLineTally",
    "DataError",
    "DataFileNotFoundError",
]


class DataError(ValueError):
    """Bad input data: an empty or truncated file, or a malformed line.

    Args:
        message: what is wrong.
        path: the file, when one is concerned.
        line: the 1-based line number within ``path``, for a malformed line.
        field: the field name (``"label"``, ``"I3"``, ``"C12"``, ``"fields"``; for
            csv and parquet, the column name).
        reason: why a line is bad (set for malformed lines only).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        line: int | None = None,
        field: str | None = None,
        reason: BadLineReason | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = ""
        if self.path is not None:
            where = self.path
            if line is not None:
                where += f", line {line}"
            if field is not None:
                where += f", field {field}"
            where += ": "
        super().__init__(where + message)


class DataFileNotFoundError(FileNotFoundError):
    """An input file or directory does not exist."""

    def __init__(self, path: str | Path, what: str = "input file") -> None:
        self.path = str(path)
        super().__init__(f"{what} not found: {self.path}")


class BadLineReason(enum.StrEnum):
    """Why a line was rejected (Criteo and csv sources)."""

    FIELD_COUNT = "wrong number of fields"
    DENSE_NOT_INTEGER = "dense value is not an integer"
    CATEGORICAL_NOT_HEX = "categorical value is not hex"  # of 1-8 digits
    LABEL_NOT_BINARY = "label is not 0 or 1"
    DENSE_NOT_NUMBER = "dense value is not a finite number"  # csv
    NOT_UTF8 = "value is not UTF-8 text"  # csv


_MAX_EXAMPLES = 5


@dataclass
class BadLineTally:
    """Mutable counter filled while reading; ``freeze()`` gives the ``BadLineSummary``."""

    counts: Counter[BadLineReason] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, error: DataError) -> None:
        """Count one skipped line by its reason; keep the first few messages as examples."""
        assert error.reason is not None, "only malformed-line errors are counted"
        self.counts[error.reason] += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(str(error))

    def no_rows_error(self, where: str, path: str | Path | None = None) -> DataError:
        """The error of an input with no row left, ``"no valid rows in {where}"``.

        When lines were skipped it gives their per-reason count and the first one, as
        the skip summary does: otherwise the reason every line was dropped is lost.
        """
        why = f": {self.freeze(0).summary()}" if self.counts else ""
        return DataError(f"no valid rows in {where}{why}", path=path)

    def freeze(self, rows_read: int) -> BadLineSummary:
        """The immutable summary, with ``rows_read`` good rows."""
        ordered = {r.value: self.counts[r] for r in BadLineReason if self.counts[r]}
        return BadLineSummary(
            rows_read=rows_read, counts=MappingProxyType(ordered), examples=tuple(self.examples)
        )


@dataclass(frozen=True, kw_only=True)
class BadLineSummary:
    """Lines skipped under ``on_bad_line="skip"``, counted per reason.

    Args:
        rows_read: good rows kept.
        counts: ``{reason text: lines skipped}`` (reasons with no line are left out).
        examples: the first few error messages (file, line, field).
    """

    rows_read: int = 0
    counts: MappingProxyType[str, int] = field(default_factory=lambda: MappingProxyType({}))
    examples: tuple[str, ...] = ()

    @property
    def skipped(self) -> int:
        """Total lines skipped."""
        return sum(self.counts.values())

    def merge(self, other: BadLineSummary) -> BadLineSummary:
        """The summary of both reads together."""
        counts = Counter(dict(self.counts))
        counts.update(dict(other.counts))
        ordered = {r.value: counts[r.value] for r in BadLineReason if counts[r.value]}
        return BadLineSummary(
            rows_read=self.rows_read + other.rows_read,
            counts=MappingProxyType(ordered),
            examples=(self.examples + other.examples)[:_MAX_EXAMPLES],
        )

    def summary(self) -> str:
        """One line for the log, e.g. ``"read 998 rows, skipped 2 bad lines (...)"``."""
        if not self.skipped:
            return f"read {self.rows_read} rows, no bad lines"
        parts = ", ".join(f"{n} {reason}" for reason, n in self.counts.items())
        first = f"; first: {self.examples[0]}" if self.examples else ""
        return f"read {self.rows_read} rows, skipped {self.skipped} bad lines ({parts}){first}"

    def to_dict(self) -> dict[str, object]:
        """Plain data for JSON."""
        return {
            "rows_read": self.rows_read,
            "skipped": self.skipped,
            "counts": dict(self.counts),
            "examples": list(self.examples),
        }
