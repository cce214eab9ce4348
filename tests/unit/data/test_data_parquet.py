import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tetrarec.data import DataError, DataFileNotFoundError, ParquetDataset, hash_ids
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
