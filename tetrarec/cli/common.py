"""What the ``tetrarec`` command's parts share: argument types and the JSON writer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tetrarec import jsonio

__all__ = ["at_least_one", "write_json"]


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` as strict JSON to ``path`` (``--json``), if one was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(jsonio.dumps(payload, indent=2) + "\n")


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
