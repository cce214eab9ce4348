"""The documented raw id of a text value, written out as the fuzz tests' oracle."""

from __future__ import annotations

MASK = 2**64 - 1


def fnv1a64(data: bytes) -> int:
    """FNV-1a 64 of ``data``'s bytes, "" -> 0, as int64 (the readers' string ids)."""
    if not data:
        return 0
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h - 2**64 if h >= 2**63 else h
