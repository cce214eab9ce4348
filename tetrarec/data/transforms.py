"""The documented, stable id hashes and the Criteo dense transform.

``hash_strings`` turns a string categorical into a raw 64-bit id; ``hash_ids`` maps any
raw id (an integer value or a string's hash) to a table row. Both are vectorized and
fixed forever, so one preprocessed copy of the data serves any table sizes, on every
machine and version.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["dense_transform", "hash_ids", "hash_strings"]

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


# FNV-1a 64 (http://www.isthe.com/chongo/tech/comp/fnv/): offset basis and prime.
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def hash_strings(values: pa.Array | pa.ChunkedArray | Sequence[str | bytes | None]) -> np.ndarray:
    """Raw 64-bit ids of string categorical values: FNV-1a 64 of their UTF-8 bytes.

    The algorithm is FNV-1a with 64-bit state, over the value's bytes (UTF-8 for text,
    the bytes themselves for binary values), all arithmetic mod ``2**64``::

        h = 0xcbf29ce484222325
        for byte in value: h = (h ^ byte) * 0x100000001b3

    and the result is returned as the int64 with the same 64 bits. Two exceptions: a
    missing value (null) and the empty string both give the raw id ``0``, so a missing
    string categorical lands on row 0 like a missing Criteo or integer one.

    The raw id is then mapped to a table row exactly like an integer id,
    ``hash_ids(raw, num_rows)``; so a dataset that stores these ids as int64 (what
    ``tetrarec preprocess csv`` writes) reads the same rows as the strings. An integer
    column hashes its value and a string column its bytes: the text ``"123"`` and the
    integer ``123`` are different ids.

    Each distinct value is hashed once (``dictionary_encode``), so the cost follows the
    number of distinct values, not of rows; the loop runs over byte positions, with
    all values of at least that length updated together.

    >>> hash_strings(["", "a", "foobar", None]).view(np.uint64).tolist() == [
    ...     0, 0xAF63DC4C8601EC8C, 0x85944171F73967E8, 0]
    True

    Args:
        values: a pyarrow string, large_string, binary, large_binary or
            dictionary<string> array (chunked or not), or a sequence of ``str``,
            ``bytes`` or None.

    Returns:
        ``(N,)`` int64 raw ids (0 for null and empty values).

    Raises:
        TypeError: if ``values`` is not of a string or binary type.
    """
    arr = values if isinstance(values, pa.Array | pa.ChunkedArray) else pa.array(values)
    if isinstance(arr, pa.ChunkedArray):
        arr = combine_chunks(arr)
    if not pa.types.is_dictionary(arr.type):
        if not _is_text(arr.type):
            raise TypeError(f"hash_strings needs string or binary values, got {arr.type}")
        arr = pc.dictionary_encode(arr)
    elif not _is_text(arr.type.value_type):
        raise TypeError(f"hash_strings needs string or binary values, got {arr.type}")
    distinct = _fnv1a64(arr.dictionary)  # (U,)
    # Null indices (missing values) read the extra slot U, which holds 0; U itself may
    # not fit the index type (an int8 dictionary of 128 values), so widen first.
    indices = arr.indices.cast(pa.int64()).fill_null(len(distinct))
    indices = indices.to_numpy(zero_copy_only=False)
    out: np.ndarray = np.append(distinct, np.uint64(0))[indices].view(np.int64)
    return out


def combine_chunks(col: pa.ChunkedArray) -> pa.Array:
    """``col`` as one array; a dictionary column's indices widened to int64 first.

    Each chunk of a dictionary column (each row group of a parquet file) holds its own
    dictionary. Combining them unifies the dictionaries, and the union can outgrow the
    chunks' index type (int8 holds 128 values), which ``ChunkedArray.combine_chunks``
    refuses; int64 indices always fit. Other types are combined as they are.

    Args:
        col: any chunked array.

    Returns:
        The values of ``col`` in one array, of ``col``'s type except for the wider
        dictionary indices.
    """
    if pa.types.is_dictionary(col.type):
        col = col.cast(pa.dictionary(pa.int64(), col.type.value_type))
    return col.combine_chunks()


def _is_text(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def _fnv1a64(arr: pa.Array) -> np.ndarray:
    """``(N,)`` uint64 FNV-1a 64 of each value of a string/binary array; 0 for null or ""."""
    arr = arr.cast(pa.large_binary())  # int64 offsets, the same bytes
    n = len(arr)
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=n + 1, offset=arr.offset * 8)
    data = np.frombuffer(data_buf if data_buf is not None else b"", dtype=np.uint8)
    lens = offsets[1:] - offsets[:-1]  # (N,)
    # Longest first: the values still being hashed at byte j are a prefix of the order.
    order = np.argsort(-lens, kind="stable")
    starts, sorted_lens = offsets[:-1][order], lens[order]
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    active = np.searchsorted(-sorted_lens, -np.arange(int(lens.max(initial=0))), side="left")
    for j, k in enumerate(active.tolist()):  # k = values longer than j bytes
        h[:k] ^= data[starts[:k] + j]
        h[:k] *= _FNV_PRIME
    out = np.empty(n, dtype=np.uint64)
    out[order] = h
    out[lens == 0] = 0  # "" (and null, whose length is 0) is the missing value
    return out


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """The DLRM dense transform ``log(1 + max(x, 0))`` as float32.

    Missing values are stored as 0 and so map to 0.

    >>> [round(float(v), 4) for v in dense_transform(np.array([-3, 0, 1, 9]))]
    [0.0, 0.0, 0.6931, 2.3026]
    """
    x = np.maximum(np.asarray(raw, dtype=np.float64), 0.0)
    return np.log1p(x).astype(np.float32)
