import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tetrarec.data import (
    ColumnMapping,
    DataError,
    DataFileNotFoundError,
    ParquetDataset,
    hash_ids,
    hash_strings,
    iter_parquet_blocks,
    read_parquet,
)
from tetrarec.embedding import TableConfig

TABLES = [
    TableConfig(name="user", num_embeddings=100, dim=4),
    TableConfig(name="items", num_embeddings=1000, dim=4, feature_names=("clicked", "seen")),
]


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


def dataset(paths, **kw):
    args = {
        "dense_columns": ("d0", "d1"),
        "sparse_columns": ("u", "clicked_list", "seen_list"),
        "label_column": "y",
        "tables": TABLES,
    }
    args.update(kw)
    return ParquetDataset(paths, **args)


def sample_file(path):
    return write(
        path,
        y=pa.array([1, 0, 1], pa.int8()),
        d0=pa.array([0.5, None, 2.0]),
        d1=pa.array([1, 2, 3], pa.int64()),
        u=pa.array([7, None, 9], pa.int64()),
        clicked_list=pa.array([[1, 2, 3], [], None], pa.list_(pa.int64())),
        seen_list=pa.array([[5], [6, 7], [8]], pa.list_(pa.int32())),
    )


def test_mapping_with_list_columns(tmp_path):
    ds = dataset([sample_file(tmp_path / "a.parquet")])
    assert ds.num_samples == 3
    assert ds.num_dense == 2
    assert ds.keys == ("user", "clicked", "seen")
    b = ds.read(np.array([2, 0, 1]))
    assert b.dense.tolist() == [[2.0, 3.0], [0.5, 1.0], [0.0, 2.0]]
    assert b.labels.tolist() == [1.0, 1.0, 0.0]
    d = b.sparse.to_dict()
    h = lambda xs, n: hash_ids(np.array(xs, dtype=np.int64), n).tolist()  # noqa: E731
    assert d["user"][0].tolist() == h([9, 7, 0], 100)  # null scalar -> raw value 0
    assert d["user"][1].tolist() == [1, 1, 1]
    assert d["clicked"][0].tolist() == h([1, 2, 3], 1000)  # row 2 null, row 1 empty
    assert d["clicked"][1].tolist() == [0, 3, 0]
    assert d["seen"][0].tolist() == h([8, 5, 6, 7], 1000)
    assert d["seen"][1].tolist() == [1, 1, 2]
    assert b.sparse.value_counts == (3, 3, 4)


def test_several_files_concatenate(tmp_path):
    a = sample_file(tmp_path / "a.parquet")
    b = sample_file(tmp_path / "b.parquet")
    ds = dataset([a, b])
    assert ds.num_samples == 6
    one, two = ds.read(np.arange(3)), ds.read(np.arange(3, 6))
    assert one.sparse.values.tolist() == two.sparse.values.tolist()
    assert one.sparse.lengths.tolist() == two.sparse.lengths.tolist()


def test_errors_name_file_and_column(tmp_path):
    a = sample_file(tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a\.parquet: columns \['nope'\]"):
        dataset([a], dense_columns=("nope",))
    with pytest.raises(DataFileNotFoundError):
        dataset([tmp_path / "missing.parquet"])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet"):
        dataset([tmp_path / "junk.parquet"])
    bad = write(
        tmp_path / "bad.parquet",
        y=pa.array([0, 2, 1]),
        d0=[1.0, 1.0, 1.0],
        d1=[1, 1, 1],
        u=[1, 2, 3],
        clicked_list=[[1], [2], [3]],
        seen_list=[[1], [2], [3]],
    )
    with pytest.raises(DataError, match=r"bad\.parquet, field y: label is not 0 or 1 \(row 2"):
        dataset([bad])
    text = write(
        tmp_path / "text.parquet",
        y=[0],
        d0=[1.0],
        d1=[1],
        u=[1.5],  # strings are ids now (hash_strings); a float column is not
        clicked_list=[[1]],
        seen_list=[[1]],
    )
    with pytest.raises(DataError, match=r"field u: expected an integer, string or list"):
        dataset([text])
    with pytest.raises(ValueError, match="3 sparse features"):
        dataset([a], tables=TABLES[:1])


# --- found by mutation testing (mutation/README.md) ----------------------------------


def mapping(dense=("d",), sparse=("s",)):
    return ColumnMapping(label_column="y", dense_columns=dense, sparse_columns=sparse)


def corrupt_copy(path, out):
    """A copy of ``path`` whose first data page header is garbage (its footer still reads)."""
    data = bytearray(path.read_bytes())
    data[4:12] = b"\xff" * 8
    out.write_bytes(bytes(data))
    return out


def corrupt_column(path, name):
    """Garbage over the first page header of column ``name`` (the other columns still read)."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    col = next(
        meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == name
    )
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    return path


def test_only_the_mapped_columns_are_read(tmp_path):
    """Columns the mapping does not name are never read: here one is unreadable.

    Catches ``iter_batches`` and ``read`` without ``columns=`` (every column read).
    """
    p = tmp_path / "a.parquet"
    table = pa.table({"y": [0, 1], "d": [1.0, 2.0], "s": [1, 2], "extra": [5, 6]})
    pq.write_table(table, p, compression="none")
    corrupt_column(p, "extra")
    assert read_parquet([p], mapping()).ids[0].tolist() == [1, 2]
    (block,) = iter_parquet_blocks(p, mapping())
    assert block.ids[0].tolist() == [1, 2]
    with pytest.raises(DataError, match="cannot read parquet data"):
        read_parquet([p], mapping(sparse=("s", "extra")))


def test_read_parquet_gives_the_documented_dtypes_and_bags(tmp_path):
    """Labels and dense are float32, ids and offsets int64, and ``multi_hot`` per column.

    Catches the label and dense casts dropped, one-hot offsets other than ``arange``, and
    a scalar column reported as a list (or a list column as a scalar).
    """
    p = write(
        tmp_path / "a.parquet",
        y=pa.array([1, 0], pa.int8()),
        d=pa.array([0.25, None], pa.float64()),
        s=pa.array([7, None], pa.int32()),
        l=pa.array([[3, 4], None], pa.large_list(pa.int16())),
    )
    cols = read_parquet([p], mapping(sparse=("s", "l")))
    assert cols.labels.dtype == np.float32
    assert cols.labels.tolist() == [1.0, 0.0]
    assert cols.dense.dtype == np.float32
    assert cols.dense.tolist() == [[0.25], [0.0]]
    assert [i.dtype for i in cols.ids] == [np.int64, np.int64]
    assert cols.ids[0].tolist() == [7, 0]
    assert cols.ids[1].tolist() == [3, 4]
    assert [o.dtype for o in cols.offsets] == [np.int64, np.int64]
    assert cols.offsets[0].tolist() == [0, 1, 2]
    assert cols.offsets[1].tolist() == [0, 2, 2]
    assert cols.multi_hot == (False, True)


def test_no_dense_columns_give_an_empty_dense_block_per_row(tmp_path):
    """Without dense columns ``dense`` is ``(rows, 0)`` float32, not another shape."""
    p = write(tmp_path / "a.parquet", y=[0, 1, 1], s=[1, 2, 3])
    cols = read_parquet([p], mapping(dense=()))
    assert cols.dense.shape == (3, 0)
    assert cols.dense.dtype == np.float32


def test_boolean_and_float_labels_and_boolean_dense(tmp_path):
    """Boolean and float 0/1 labels are accepted; a boolean dense column reads as 0/1.

    The module docstring allows boolean labels and numbers, but ``fill_null(0)`` raised
    ``ArrowInvalid`` on every boolean column (pyarrow cannot make 0 a boolean): such a
    file could not be read at all.
    """
    p = write(
        tmp_path / "a.parquet",
        y=pa.array([True, False]),
        d=pa.array([True, None]),
        s=[1, 2],
    )
    cols = read_parquet([p], mapping())
    assert cols.labels.tolist() == [1.0, 0.0]
    assert cols.dense.tolist() == [[1.0], [0.0]]
    q = write(tmp_path / "b.parquet", y=pa.array([0.0, 1.0]), d=[1, 2], s=[1, 2])
    assert read_parquet([q], mapping()).labels.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_string_labels_are_0_or_1(tmp_path, kind):
    """``"0"``/``"1"`` strings are labels; another string or a null is named with its row."""
    p = write(tmp_path / "a.parquet", y=pa.array(["1", "0", "1"], kind), d=[1, 2, 3], s=[1, 2, 3])
    assert read_parquet([p], mapping()).labels.tolist() == [1.0, 0.0, 1.0]
    bad = write(
        tmp_path / "b.parquet", y=pa.array(["1", "yes", None, "0"], kind), d=[1] * 4, s=[1] * 4
    )
    msg = "b.parquet, field y: label is not 0 or 1 (row 2 holds 'yes'; 2 such rows)"
    with pytest.raises(DataError) as e:
        read_parquet([bad], mapping())
    assert str(e.value) == f"{bad}, field y: label is not 0 or 1 (row 2 holds 'yes'; 2 such rows)"
    assert str(e.value).endswith(msg)


def test_dictionary_encoded_label_and_dense_columns_are_read_as_their_values(tmp_path):
    """A label column of dictionary<string> "0"/"1" (a pandas categorical) was refused as
    "expected a numeric column, got dictionary<...>", though its values are accepted as
    plain strings and a sparse column may be dictionary<string>; the same for a
    dictionary<int> label or dense column. A bad value is still named with its row."""
    p = write(
        tmp_path / "a.parquet",
        y=pa.array(["1", "0", "1"]).dictionary_encode(),
        d=pa.array([2.5, None, 2.5]).dictionary_encode(),
        s=[1, 2, 3],
    )
    cols = read_parquet([p], mapping())
    assert cols.labels.tolist() == [1.0, 0.0, 1.0]
    assert cols.dense.tolist() == [[2.5], [0.0], [2.5]]
    q = write(tmp_path / "b.parquet", y=pa.array([0, 1]).dictionary_encode(), d=[1, 2], s=[1, 2])
    assert read_parquet([q], mapping()).labels.tolist() == [0.0, 1.0]
    bad = write(
        tmp_path / "c.parquet", y=pa.array(["1", "yes"]).dictionary_encode(), d=[1, 2], s=[1, 2]
    )
    with pytest.raises(DataError) as e:
        read_parquet([bad], mapping())
    assert str(e.value) == f"{bad}, field y: label is not 0 or 1 (row 2 holds 'yes'; 1 such rows)"


def test_a_null_numeric_label_is_refused(tmp_path):
    """A null label is not 0: it is refused like a 2, and counted with the other bad rows."""
    p = write(tmp_path / "a.parquet", y=pa.array([0, None, 3, 1]), d=[1] * 4, s=[1] * 4)
    with pytest.raises(DataError) as e:
        read_parquet([p], mapping())
    assert str(e.value) == f"{p}, field y: label is not 0 or 1 (row 2 holds None; 2 such rows)"


def test_a_label_column_of_another_type_is_named(tmp_path):
    """A label column that is neither numeric nor text is refused naming file and column."""
    p = write(tmp_path / "a.parquet", y=pa.array([b"1"], pa.binary()), d=[1], s=[1])
    with pytest.raises(DataError) as e:
        read_parquet([p], mapping())
    assert str(e.value) == f"{p}, field y: expected a numeric column, got binary"


def test_a_non_numeric_dense_column_is_named(tmp_path):
    """A string dense column is refused with the column's type, not read as numbers."""
    p = write(tmp_path / "a.parquet", y=[0], d=["1.5"], s=[1])
    with pytest.raises(DataError) as e:
        read_parquet([p], mapping())
    assert str(e.value) == f"{p}, field d: expected a numeric column, got string"


@pytest.mark.parametrize(
    ("values", "shown"),
    [
        ([1.0, np.nan, 2.0, np.nan], "nan"),
        ([1.0, np.inf, 2.0, -np.inf], "inf"),
        ([1.0, 1e39, 2.0, -1e39], "1e+39"),  # finite as float64, inf as the float32 stored
    ],
)
def test_a_dense_value_that_is_not_a_finite_float32_is_named(tmp_path, values, shown):
    """NaN, inf and values beyond float32's range are refused with their row, not read
    into the batch (where the first step's loss would be ``nan``, naming nothing)."""
    p = write(tmp_path / "a.parquet", y=[0, 1, 0, 1], d=pa.array(values), s=[1] * 4)
    with pytest.raises(DataError) as e:
        read_parquet([p], mapping())
    assert str(e.value) == (
        f"{p}, field d: dense value is not a finite float32 (row 2 holds {shown}; 2 such rows)"
    )
    ok = write(tmp_path / "b.parquet", y=[0, 1], d=pa.array([3.4e38, None]), s=[1, 2])
    assert read_parquet([ok], mapping()).dense[:, 0].tolist() == [np.float32(3.4e38), 0.0]


@pytest.mark.parametrize(
    "kind",
    [
        pa.string(),
        pa.large_string(),
        pa.binary(),
        pa.large_binary(),
        pa.dictionary(pa.int32(), pa.string()),
    ],
)
def test_every_text_type_is_hashed_as_its_bytes(tmp_path, kind):
    """Each text type of the module docstring gives ``hash_strings`` of the value's bytes."""
    values = ["ab", None, "", "ab"]
    arr = pa.array(values, pa.string()).cast(kind)
    p = write(tmp_path / "a.parquet", y=[0, 1, 0, 1], d=[1, 2, 3, 4], s=arr)
    cols = read_parquet([p], mapping())
    assert cols.ids[0].tolist() == hash_strings(values).tolist()
    assert cols.ids[0].tolist()[1:3] == [0, 0]
    assert cols.multi_hot == (False,)


@pytest.mark.skipif(not hasattr(pa, "string_view"), reason="pyarrow before 16 has no views")
def test_string_view_columns_read_as_the_plain_strings(tmp_path):
    """Bug caught: a ``string_view`` column (what Polars, or pyarrow's own view layout,
    writes) was refused ("expected an integer, string or list... got string_view"), as a
    label too; its values, in a list or not, are now those of the plain strings."""
    values = ["ab", None, "", "ab"]
    p = write(
        tmp_path / "a.parquet",
        y=pa.array(["0", "1", "0", "1"], pa.string_view()),
        d=[1, 2, 3, 4],
        s=pa.array(values, pa.string_view()),
        b=pa.array([b"x", None, b"", b"x"], pa.binary_view()),
        m=pa.array([["a", None], None, [], ["ab"]], pa.list_(pa.string_view())),
    )
    cols = read_parquet([p], mapping(sparse=("s", "b", "m")))
    assert cols.labels.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert cols.ids[0].tolist() == hash_strings(values).tolist()
    assert cols.ids[1].tolist() == hash_strings([b"x", None, b"", b"x"]).tolist()
    assert cols.ids[2].tolist() == hash_strings(["a", None, "ab"]).tolist()
    assert cols.offsets[2].tolist() == [0, 2, 2, 2, 3]


def test_row_groups_with_different_int8_dictionaries_read_as_the_plain_strings(tmp_path):
    """Two row groups, each with its own int8 dictionary of 100 strings (200 distinct in
    all) and a null: the ids are those of a plain-string copy, read whole (train) or by
    block (preprocess). Bug caught: training failed with "These dictionaries cannot be
    combined. The unified dictionary requires a larger index type." (no file, no
    column), while ``tetrarec preprocess parquet`` read the file."""

    def group(lo):
        c = pa.DictionaryArray.from_arrays(
            pa.array([i % 100 for i in range(150)] + [None], pa.int8()),
            pa.array([f"v{i}" for i in range(lo, lo + 100)]),
        )
        return pa.table({"y": [i % 2 for i in range(151)], "c": c})

    coded = pa.concat_tables([group(0), group(100)])
    p = tmp_path / "coded.parquet"
    pq.write_table(coded, p, row_group_size=151)
    assert pq.ParquetFile(p).num_row_groups == 2
    assert pq.read_table(p).column("c").type == pa.dictionary(pa.int8(), pa.string())
    plain = coded.column("c").to_pylist()
    want = hash_strings(pa.array(plain, pa.string())).tolist()
    assert len(set(want)) == 201  # 200 values and null
    cols = mapping(dense=(), sparse=("c",))
    assert read_parquet([p], cols).ids[0].tolist() == want
    assert [v for b in iter_parquet_blocks(p, cols) for v in b.ids[0].tolist()] == want


def test_list_of_strings_and_the_wrong_item_type(tmp_path):
    """A list of strings is a bag of hashed strings; a list of floats is refused by name."""
    p = write(
        tmp_path / "a.parquet",
        y=[0, 1],
        d=[1, 2],
        s=pa.array([["a", None], None], pa.list_(pa.string())),
    )
    cols = read_parquet([p], mapping())
    assert cols.ids[0].tolist() == hash_strings(["a", None]).tolist()
    assert cols.offsets[0].tolist() == [0, 2, 2]
    bad = write(tmp_path / "b.parquet", y=[0], d=[1], s=pa.array([[1.5]]))
    with pytest.raises(DataError) as e:
        read_parquet([bad], mapping())
    assert str(e.value) == (
        f"{bad}, field s: expected an integer, string or list<integer or string> column, "
        "got list<element: double>"
    )


def test_open_errors_have_exact_messages(tmp_path):
    """A missing file, a missing column (listing the file's) and junk are named exactly."""
    p = write(tmp_path / "a.parquet", y=[0], d=[1.0], s=[1])
    with pytest.raises(DataError) as e:
        read_parquet([p], mapping(dense=("d", "x")))
    assert str(e.value) == f"{p}: columns ['x'] are not in the file; it has ['y', 'd', 's']"
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError) as e:
        read_parquet([junk], mapping())
    assert str(e.value).startswith(f"{junk}: not a readable parquet file (")
    none = tmp_path / "none.parquet"
    for read in (
        lambda: read_parquet([none], mapping()),
        lambda: next(iter_parquet_blocks(none, mapping())),
    ):
        with pytest.raises(DataFileNotFoundError) as missing:
            read()
        assert str(missing.value) == f"input file not found: {none}"
    with pytest.raises(ValueError, match=r"^read_parquet needs at least one file$"):
        read_parquet([], mapping())


def test_corrupt_data_is_a_data_error_naming_the_file(tmp_path):
    """A file whose footer reads but whose data does not raises ``DataError``, not OSError."""
    good = write(
        tmp_path / "good.parquet",
        y=pa.array(np.arange(1000) % 2),
        d=np.arange(1000.0),
        s=np.arange(1000),
    )
    pq.write_table(pq.read_table(good), good, compression="none")
    bad = corrupt_copy(good, tmp_path / "bad.parquet")
    for read in (
        lambda: read_parquet([good, bad], mapping()),
        lambda: list(iter_parquet_blocks(bad, mapping())),
    ):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value).startswith(f"{bad}: cannot read parquet data (")


def test_iter_parquet_blocks_reads_the_file_and_reports_its_size_once(tmp_path):
    """The blocks hold the file's rows in order; ``on_bytes`` gets the size once, at the end."""
    p = write(tmp_path / "a.parquet", y=[0, 1, 1], d=[1.0, 2.0, 3.0], s=pa.array([[1], [], [2, 3]]))
    seen = []
    blocks = iter_parquet_blocks(p, mapping(), on_bytes=seen.append)
    first = next(blocks)
    assert seen == []
    assert list(blocks) == []
    assert seen == [p.stat().st_size]
    assert first.labels.tolist() == [0.0, 1.0, 1.0]
    assert first.dense.tolist() == [[1.0], [2.0], [3.0]]
    assert first.ids[0].tolist() == [1, 2, 3]
    assert first.offsets[0].tolist() == [0, 1, 1, 3]
    (only,) = iter_parquet_blocks(str(p), mapping())  # read to the end, no on_bytes
    assert only.rows == 3


def test_iter_parquet_blocks_numbers_rows_across_blocks(tmp_path):
    """A bad label in a later block is named by its row in the file, not in its block.

    The file has two blocks (2**20 rows each) and one row more, the bad label last.
    Catches the row count restarting per block or set to the last block's size.
    """
    n = 2 * (1 << 20) + 1
    y = np.zeros(n, dtype=np.int8)
    y[-1] = 5
    p = write(tmp_path / "a.parquet", y=y, s=np.zeros(n, dtype=np.int8))
    blocks = iter_parquet_blocks(p, mapping(dense=()))
    assert [next(blocks).rows, next(blocks).rows] == [1 << 20, 1 << 20]
    with pytest.raises(DataError) as e:
        next(blocks)
    assert str(e.value) == f"{p}, field y: label is not 0 or 1 (row {n} holds 5; 1 such rows)"


def test_a_file_with_no_rows_is_refused_by_name(tmp_path):
    """A dataset of files with no rows at all is an error naming the files."""
    p = write(tmp_path / "a.parquet", y=pa.array([], pa.int8()), u=pa.array([], pa.int64()))
    with pytest.raises(DataError) as e:
        ParquetDataset(
            [p], dense_columns=(), sparse_columns=("u",), label_column="y", tables=TABLES[:1]
        )
    assert str(e.value) == f"no rows in [{str(p)!r}]"


def test_damaged_page_header_is_a_one_line_error(tmp_path):
    """pyarrow's thrift error spans lines ("...Invalid data\\nDeserializing page header
    failed.\\n"); the DataError it becomes was printed over three lines (found by
    tests/fuzz/test_fuzz_parquet.py: one byte inserted before a good file)."""
    p = tmp_path / "spliced.parquet"
    sample_file(tmp_path / "good.parquet")
    p.write_bytes(b"\x00" + (tmp_path / "good.parquet").read_bytes())
    with pytest.raises(DataError) as info:
        dataset([p])
    assert str(info.value).startswith(f"{p}: cannot read parquet data (")
    assert "\n" not in str(info.value)


def test_column_name_of_invalid_utf8_is_a_data_error_naming_the_file(tmp_path):
    """A footer whose column name is not UTF-8 made pyarrow raise UnicodeDecodeError (a
    ValueError naming no file) from ParquetFile (found by tests/fuzz/test_fuzz_parquet.py:
    one byte flipped in a good file's footer)."""
    p = tmp_path / "names.parquet"
    pq.write_table(pa.table({"y": [1, 0], "d\u00e9": [1.0, 2.0], "u": [3, 4]}), p)
    raw = p.read_bytes()
    assert raw.count("d\u00e9".encode()) >= 1
    p.write_bytes(raw.replace("d\u00e9".encode(), b"d\xe4\xa9"))  # a broken 3-byte sequence
    with pytest.raises(DataError) as info:
        read_parquet([p], ColumnMapping(label_column="y", sparse_columns=("u",)))
    assert str(info.value).startswith(f"{p}: not a readable parquet file (")
