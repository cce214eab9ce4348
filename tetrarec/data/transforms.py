"""The documented, stable id hash and the Criteo dense transform.

Both are vectorized numpy functions, applied at read time so that one preprocessed
copy of the data serves any table sizes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dense_transform", "hash_ids"]

# MurmurHash3's 64-bit finalizer (fmix64) constants.
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def hash_ids(raw: np.ndarray, num_rows: int | np.ndarray) -> np.ndarray:
    """Map raw categorical values to table rows: ``fmix64(uint64(raw)) % num_rows``.

    ``fmix64`` is MurmurHash3's 64-bit finalizer::

        h ^= h >> 33; h *= 0xff51afd7ed558ccd; h ^= h >> 33
        h *= 0xc4ceb9fe1a85ec53; h ^= h >> 33          (all mod 2**64)

    It is a bijection on 64-bit integers, fixed forever (changing it would silently
    remap every trained row), and spreads structured ids (small integers, ids sharing
    low bits) evenly over any row count. Negative inputs are taken modulo ``2**64``.
    ``fmix64(0) == 0``, so a missing value (stored as 0) lands on row 0.

    >>> hash_ids(np.array([0, 1, 0x68FD1E64]), 1000).tolist()
    [0, 604, 12]

    Args:
        raw: integer array of any shape (a Criteo categorical is its 8 hex digits read
            as a 32-bit unsigned integer).
        num_rows: table rows (``num_embeddings``), > 0; or an array of row counts that
            broadcasts against ``raw`` (e.g. ``(F,)`` for ``raw`` of shape ``(B, F)``).

    Returns:
        int64 array shaped like ``raw``, values in ``[0, num_rows)``.

    Raises:
        ValueError: if ``num_rows`` is not positive.
    """
    rows = np.asarray(num_rows)
    if (rows <= 0).any():
        raise ValueError(f"num_rows must be > 0, got {num_rows}")
    h = np.asarray(raw).astype(np.uint64)  # a copy: the fmix below works in place
    h ^= h >> _S33
    h *= _C1
    h ^= h >> _S33
    h *= _C2
    h ^= h >> _S33
    h %= rows.astype(np.uint64)
    return h.astype(np.int64)


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """The DLRM dense transform ``log(1 + max(x, 0))`` as float32.

    Missing values are stored as 0 and so map to 0.

    >>> [round(float(v), 4) for v in dense_transform(np.array([-3, 0, 1, 9]))]
    [0.0, 0.0, 0.6931, 2.3026]
    """
    x = np.maximum(np.asarray(raw, dtype=np.float64), 0.0)
    return np.log1p(x).astype(np.float32)
