"""Strict JSON for every file and summary tetrarec writes.

Python's ``json`` writes NaN and the infinities as the bare tokens ``NaN``,
``Infinity`` and ``-Infinity``, which are not JSON: strict parsers (JavaScript's
``JSON.parse``, jq, Go's ``encoding/json``) refuse the whole file. So every writer
goes through ``dumps`` (``allow_nan=False``), and a value without a JSON number is
written one of two ways:

- a figure that may be NaN (a metric: the AUC of evaluation rows that all have one
  label is NaN) becomes ``null``, which ``dumps`` does to any float left non-finite;
  a reader that needs the float back reads ``null`` as NaN (``Metrics.from_dict``);
- a setting that must round-trip exactly (a ``data.dense_clip`` bound of ``-inf``, in
  a checkpoint's ``meta.json``) is encoded by its owner with ``inf_text`` as the
  string ``"inf"`` or ``"-inf"``, which the config loader reads back (``parse_inf``:
  a float setting may be given so in TOML and ``--set`` too).

Reading stays permissive: ``json.loads`` takes the bare tokens, so files written by
earlier versions (``-Infinity`` in a checkpoint's ``meta.json``) still load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["check_output_path", "dumps", "inf_text", "parse_inf"]

_INF_TEXT = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf}


def inf_text(value: float) -> float | str:
    """``value``, or ``"inf"``/``"-inf"`` for an infinity (JSON has no number for it)."""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def parse_inf(value: Any) -> Any:
    """The float of ``"inf"``, ``"+inf"`` or ``"-inf"`` (any case); other values as given.

    The inverse of ``inf_text``: a float setting written as that text (by tetrarec or
    by hand) reads as the infinity; anything else is left to the caller's checks.
    """
    if isinstance(value, str):
        return _INF_TEXT.get(value.strip().lower(), value)
    return value


def _finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts, lists, tuples) as ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def dumps(value: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """``value`` as strict JSON text: a NaN or infinite float is written as ``null``."""
    return json.dumps(_finite_or_null(value), indent=indent, sort_keys=sort_keys, allow_nan=False)


def check_output_path(path: str, named: str) -> None:
    """Refuse a path for a JSON file that is written after the work (a summary).

    A directory, or a path under a file, could only fail once the work is done, so it
    is refused before. ``named`` says how the user gave it (``"--json 'x'"``).

    Raises:
        ValueError: naming the path as ``named``.
    """
    if Path(path).is_dir():
        raise ValueError(f"{named} is a directory; give a file path")
    blocked = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"{named}: {str(blocked)!r} is a file, not a directory")
