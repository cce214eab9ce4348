"""Initial rows of a table: a pure function of ``(seed, table, row)``, so shards agree.

The rows of a table are drawn in chunks of ``INIT_CHUNK_ROWS`` rows; chunk ``c`` of
table ``t`` comes from its own generator, seeded by a stable hash of ``(seed, t.name, c)``::

    table "C1", 150k rows, seed 7:
      rows [0, 64k)      uniform(-b, b) from generator hash(7, "C1", 0)
      rows [64k, 128k)   uniform(-b, b) from generator hash(7, "C1", 1)
      rows [128k, 150k)  the first 22k rows of chunk hash(7, "C1", 2)

So any block of rows (a row-wise shard) or of columns (a column-wise shard) is drawn
without drawing the rest of the table, and the unsharded reference, the fused
collection and every sharded layout start from the same weights.
"""

from __future__ import annotations

import hashlib

import torch

from tetrarec.embedding.config import TableConfig

__all__ = ["INIT_CHUNK_ROWS", "draw_seed", "init_rows"]

INIT_CHUNK_ROWS = 1 << 16


def _chunk_generator(seed: int, table: str, chunk: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{table}/{chunk}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def init_rows(
    table: TableConfig,
    seed: int,
    start: int = 0,
    stop: int | None = None,
    *,
    columns: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Initial FP32 rows ``[start, stop)`` of ``table``, uniform in ``+-table.bound``.

    Args:
        table: the (whole, unsharded) table.
        seed: the run's seed.
        start: first row.
        stop: one past the last row (default: the table's rows).
        columns: ``(first, stop)`` columns to keep (default: all).

    Returns:
        ``(stop - start, columns)`` FP32 rows on the CPU.

    Raises:
        ValueError: for a row or column range outside the table.
    """
    stop = table.num_embeddings if stop is None else stop
    c0, c1 = columns if columns is not None else (0, table.dim)
    if not 0 <= start <= stop <= table.num_embeddings or not 0 <= c0 < c1 <= table.dim:
        raise ValueError(
            f"table {table.name!r} ({table.num_embeddings} x {table.dim}): rows "
            f"[{start}, {stop}) columns [{c0}, {c1}) are out of range"
        )
    out = torch.empty(stop - start, c1 - c0)
    first, last = start // INIT_CHUNK_ROWS, (stop - 1) // INIT_CHUNK_ROWS
    for c in range(first, last + 1) if stop > start else ():
        c_start = c * INIT_CHUNK_ROWS
        c_rows = min(INIT_CHUNK_ROWS, table.num_embeddings - c_start)
        chunk = torch.empty(c_rows, table.dim).uniform_(
            -table.bound, table.bound, generator=_chunk_generator(seed, table.name, c)
        )
        lo, hi = max(start, c_start), min(stop, c_start + c_rows)
        out[lo - start : hi - start] = chunk[lo - c_start : hi - c_start, c0:c1]
    return out


def draw_seed() -> int:
    """A seed drawn from the global torch RNG (for collections built without one)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))
