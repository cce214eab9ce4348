"""``hash_strings`` is FNV-1a 64 of the UTF-8 bytes, fixed forever.

The expected values come from outside the implementation: literal constants (the FNV
authors' published test vectors for FNV-1a 64) and a few-line pure-Python
reimplementation of the published algorithm, with Python's unbounded integers
reduced mod 2**64 (no numpy, no pyarrow).
"""

import random

import numpy as np
import pyarrow as pa
import pytest

from tetrarec.data import hash_ids, hash_strings

MASK = 2**64 - 1


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h


def fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK
    return h ^ (h >> 33)


def as_uint64(raw: np.ndarray) -> list[int]:
    return raw.view(np.uint64).tolist()


def test_published_fnv1a64_vectors():
    """Catches any change of the algorithm (offset basis, prime, FNV-1 vs FNV-1a order,
    byte order) or of the bytes hashed."""
    # From the FNV reference test suite (isthe.com/chongo/src/fnv/test_fnv.c), FNV-1a 64.
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8
    got = hash_strings(["a", "foobar"])
    assert got.dtype == np.int64
    assert as_uint64(got) == [0xAF63DC4C8601EC8C, 0x85944171F73967E8]


def test_utf8_bytes_and_lengths_match_the_reference():
    """Catches hashing code points instead of UTF-8 bytes, and the length-sorted
    vectorized loop stopping early or late for some values (mixed lengths, in random
    order, repeated)."""
    rng = random.Random(0)
    alphabet = "ab09_-é€😀"
    values = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    values += [*values[:50], "ddd2926e", "1fbe01fe", "é", "😀"]
    rng.shuffle(values)
    expected = [fnv1a64(v.encode("utf-8")) for v in values]
    assert as_uint64(hash_strings(values)) == expected
    assert as_uint64(hash_strings(["é"])) == [fnv1a64(b"\xc3\xa9")]


def test_missing_and_empty_are_raw_zero_and_row_zero():
    """Catches null or "" hashing to FNV's offset basis (they are documented as the
    missing value, raw id 0, which hash_ids maps to row 0)."""
    raw = hash_strings(pa.array(["", None, "x"]))
    assert as_uint64(raw)[:2] == [0, 0]
    assert hash_ids(raw, 1000).tolist()[:2] == [0, 0]


def test_rows_are_fmix64_of_the_string_hash():
    """A string's row is hash_ids of its 64-bit hash, computed here in pure Python; so a
    stored int64 copy of the hash reads the same row (catches a signed/unsigned slip)."""
    values = ["ddd2926e", "site", "é"]
    rows = hash_ids(hash_strings(values), 1009).tolist()
    assert rows == [fmix64(fnv1a64(v.encode())) % 1009 for v in values]
    stored = np.array(hash_strings(values).tolist(), dtype=np.int64)  # via Python ints
    assert hash_ids(stored, 1009).tolist() == rows


def test_every_arrow_string_type_hashes_the_same():
    """Catches a type whose bytes or offsets are read wrongly (large offsets, a
    dictionary's indices, a sliced array's offset, chunk boundaries)."""
    values = ["b", "aa", None, "", "b", "ccc"]
    expected = [0 if not v else fnv1a64(v.encode()) for v in values]
    plain = pa.array(values)
    variants = [
        plain,
        plain.cast(pa.large_string()),
        plain.cast(pa.binary()),
        plain.cast(pa.large_binary()),
        plain.dictionary_encode(),
        pa.chunked_array([plain[:2], plain[2:]]),
        values,
        [None if v is None else v.encode() for v in values],
    ]
    for v in variants:
        assert as_uint64(hash_strings(v)) == expected, type(v)
    assert as_uint64(hash_strings(pa.array(["zz", *values])[1:])) == expected


def int8_dictionary(values: list[str], indices: list[int | None]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(indices, pa.int8()), pa.array(values))


def test_chunks_with_different_small_dictionaries_hash_like_plain_strings():
    """Chunks (parquet row groups) each with its own int8 dictionary, 200 distinct
    values in all, with nulls. Bug caught: combining the chunks unified the
    dictionaries into one int8 index and failed with "These dictionaries cannot be
    combined. The unified dictionary requires a larger index type."."""
    indices = [i % 100 for i in range(150)] + [None]
    chunks = [int8_dictionary([f"v{i}" for i in range(lo, lo + 100)], indices) for lo in (0, 100)]
    plain = [v for c in chunks for v in c.to_pylist()]
    expected = [0 if v is None else fnv1a64(v.encode()) for v in plain]
    assert as_uint64(hash_strings(pa.chunked_array(chunks))) == expected
    assert as_uint64(hash_strings(pa.array(plain))) == expected


def test_a_dictionary_that_fills_its_index_type_and_a_null():
    """An int8 dictionary of 128 values (indices 0..127) and a null. Bug caught: the
    null was filled with the index 128, which int8 cannot hold ("Value 128 too large to
    fit in C integer type")."""
    values = [f"x{i}" for i in range(128)]
    arr = int8_dictionary(values, [*range(128), None])
    expected = [*(fnv1a64(v.encode()) for v in values), 0]
    assert as_uint64(hash_strings(arr)) == expected
    unsigned = pa.DictionaryArray.from_arrays(
        pa.array([*range(256), None], pa.uint8()), pa.array([f"x{i}" for i in range(256)])
    )
    assert as_uint64(hash_strings(unsigned))[-2:] == [fnv1a64(b"x255"), 0]


def test_text_and_integer_ids_differ():
    """The documented rule: a string column hashes its bytes, an integer column its
    value, so "123" is not 123."""
    assert as_uint64(hash_strings(["123"])) == [fnv1a64(b"123")]
    assert fnv1a64(b"123") != 123


def test_non_text_values_are_rejected():
    with pytest.raises(TypeError, match="string or binary values, got int64"):
        hash_strings(pa.array([1, 2]))
