"""Request rows read as the training reader reads the same raw values (``inference.rows``).

Each source's test reads rows from a file with the training reader (``evaluation_dataset``,
what ``tetrarec eval`` and the scorer use) and sends the same raw values as JSON rows:
the two batches must be equal, so a server never scores other ids or dense values than
training saw for the same row.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tetrarec.config import RunConfig
from tetrarec.config.tables import build_tables
from tetrarec.data import DenseTransform, SyntheticDataset, evaluation_dataset
from tetrarec.data.criteo import DENSE_FIELDS, SPARSE_FIELDS
from tetrarec.inference.rows import RowError, RowReader, TooManyRowsError, parse_request
from tetrarec.sparse import Batch

REPO = Path(__file__).resolve().parents[3]
CRITEO = "criteo-kaggle-dac-sample/criteo_kaggle_dac_sample.tsv.gz"
AVAZU = "avazu-sample/avazu_sample.csv.gz"


def assert_same_batch(got: Batch, want: Batch) -> None:
    assert got.sparse.keys == want.sparse.keys
    assert got.sparse.batch_size == want.sparse.batch_size
    torch.testing.assert_close(got.dense, want.dense, rtol=0, atol=0)
    assert torch.equal(got.sparse.lengths, want.sparse.lengths)
    assert torch.equal(got.sparse.values, want.sparse.values)


def reader_batch(config: RunConfig, transform: DenseTransform | None, path: Path, n: int) -> Batch:
    config = config.with_overrides(["data.train_rows=none", "data.eval_rows=none"])
    ds = evaluation_dataset(config.data, build_tables(config.model), transform, (str(path),))
    return ds.read(np.arange(n, dtype=np.int64))


def json_round_trip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as a server receives them (through JSON text)."""
    out: list[dict[str, Any]] = json.loads(json.dumps({"rows": rows}))["rows"]
    return out


def criteo_config() -> RunConfig:
    return RunConfig.from_toml(REPO / "examples" / "criteo_kaggle_sample.toml")


def criteo_transform() -> DenseTransform:
    return DenseTransform(
        columns=DENSE_FIELDS, kinds=("log1p_standardize",) * 13,
        mean=tuple(0.1 * i for i in range(13)), std=tuple(1.0 + i for i in range(13)),
    )  # fmt: skip


def test_criteo_rows_equal_the_tsv_readers_rows(shared_data: Path) -> None:
    """Bug caught: Criteo JSON rows hashed or transformed otherwise than the TSV reader
    does (a hex id read as decimal, a missing value not 0, the saved transform unused)."""
    n = 400
    config, transform = criteo_config(), criteo_transform()
    want = reader_batch(config, transform, shared_data / CRITEO, n)
    rows = []
    with gzip.open(shared_data / CRITEO, "rt") as f:
        for k, line in zip(range(n), f):
            fields = line.rstrip("\n").split("\t")
            row: dict[str, Any] = {"label": int(fields[0])}
            for name, v in zip(DENSE_FIELDS, fields[1:14]):
                row[name] = int(v) if v else None
            for name, v in zip(SPARSE_FIELDS, fields[14:]):
                row[name] = v if v or k % 2 else None  # "" and null both mean missing
            rows.append(row)
    got = RowReader(config, transform).batch(json_round_trip(rows))
    assert_same_batch(got, want)


def test_csv_string_ids_equal_the_csv_readers_rows(shared_data: Path) -> None:
    """Bug caught: string ids hashed otherwise than the CSV reader hashes them (by
    another hash, or the text ``"1005"`` as the integer 1005)."""
    n = 300
    config = RunConfig.from_toml(REPO / "examples" / "avazu_sample.toml")
    want = reader_batch(config, None, shared_data / AVAZU, n)
    with gzip.open(shared_data / AVAZU, "rt") as f:
        header = f.readline().rstrip("\n").split(",")
        rows = [dict(zip(header, line.rstrip("\n").split(","))) for _, line in zip(range(n), f)]
    for row in rows:
        del row["id"]  # a column the model does not read: sent, it is an unknown feature
    got = RowReader(config, None).batch(json_round_trip(rows))
    assert_same_batch(got, want)


CSV_TEXT = """\
y,price,"tags",city,age
1,2.5,a|b||c,Paris,3
0,,,,-1e3
1,1e30,x,"New, York",7
0,-0.125,|,ab"c,0
"""


def csv_config(tmp_path: Path, source: str = "csv") -> RunConfig:
    return RunConfig.from_dict(
        {
            "data": {
                "source": source, "train_path": [str(tmp_path / "x")], "label_column": "y",
                "dense_columns": ["price", "age"], "sparse_columns": ["tags", "city"],
                "dense_transform": ["standardize", "none"],
                **({"csv": {"multi_hot_columns": ["tags"]}} if source == "csv" else {}),
            },
            "model": {"num_sparse": 2, "num_embeddings": [97, 13],
                      "dlrm": {"num_dense": 2, "bottom_mlp": [8, 4], "top_mlp": [4, 1]}},
        }
    )  # fmt: skip


PRICE_AGE = DenseTransform(
    columns=("price", "age"), kinds=("standardize", "none"), mean=(1.0, 0.0), std=(2.0, 1.0)
)


def test_csv_multi_hot_dense_and_quoted_values_equal_the_csv_reader(tmp_path: Path) -> None:
    """Bug caught: a multi-hot field not split (or empty items kept), an empty dense
    value not 0, a quoted comma or a literal quote hashed otherwise than the reader."""
    path = tmp_path / "rows.csv"
    path.write_text(CSV_TEXT)
    config = csv_config(tmp_path)
    want = reader_batch(config, PRICE_AGE, path, 4)
    rows = [
        {"y": 1, "price": 2.5, "tags": "a|b||c", "city": "Paris", "age": 3},
        {"price": None, "tags": None, "city": "", "age": -1e3},
        {"price": 1e30, "tags": ["x"], "city": "New, York", "age": 7},
        {"price": -0.125, "tags": "|", "city": 'ab"c', "age": 0},
    ]
    got = RowReader(config, PRICE_AGE).batch(json_round_trip(rows))
    assert_same_batch(got, want)


def test_parquet_integer_string_and_list_ids_equal_the_parquet_reader(tmp_path: Path) -> None:
    """Bug caught: a Parquet integer id hashed as text (or text as an integer), a list
    not read as a bag, a null item not the raw value 0."""
    path = tmp_path / "rows.parquet"
    table = pa.table(
        {
            "y": [1, 0, 1],
            "price": [2.5, None, -3.0],
            "age": [1, 2, None],
            "tags": [[5, None, 2**40], [], None],
            "city": ["Paris", None, ""],
        }
    )
    pq.write_table(table, path)
    config = csv_config(tmp_path, source="parquet")
    want = reader_batch(config, PRICE_AGE, path, 3)
    rows = [{k: table.column(k)[i].as_py() for k in table.column_names} for i in range(3)]
    rows[2]["tags"] = []  # a null list is an empty bag; JSON's null is the one id 0
    got = RowReader(config, PRICE_AGE).batch(json_round_trip(rows))
    assert_same_batch(got, want)
    # a bag of one id and the id alone are the same one-id bag
    one = RowReader(config, PRICE_AGE).batch([{**rows[0], "tags": [7]}])
    alone = RowReader(config, PRICE_AGE).batch([{**rows[0], "tags": 7}])
    assert_same_batch(one, alone)


def synthetic_config() -> RunConfig:
    return RunConfig.from_dict(
        {
            "data": {"source": "synthetic",
                     "synthetic": {"num_samples": 100, "eval_samples": 10, "num_dense": 3,
                                   "pooling": 3}},
            "model": {"num_sparse": 2, "num_embeddings": [50, 20],
                      "dlrm": {"num_dense": 3, "bottom_mlp": [8, 4], "top_mlp": [4, 1]}},
        }
    )  # fmt: skip


def test_synthetic_rows_equal_the_generators_rows() -> None:
    """Bug caught: synthetic ids (already table rows) hashed again, or bags cut."""
    config = synthetic_config()
    ds = SyntheticDataset(config.data.synthetic, build_tables(config.model), num_samples=20)
    want = ds.read(np.arange(20))
    reader = RowReader(config, None)
    lengths = want.sparse.lengths.view(2, 20)
    values = want.sparse.values.split(lengths.sum(1).tolist())
    rows = [dict(zip(reader.dense_names, want.dense[i].tolist())) for i in range(20)]
    for f, name in enumerate(reader.sparse_names):
        for i, bag in enumerate(values[f].split(lengths[f].tolist())):
            rows[i][name] = bag.tolist()
    assert_same_batch(reader.batch(json_round_trip(rows)), want)


def good_criteo_row() -> dict[str, Any]:
    return {**dict.fromkeys(DENSE_FIELDS, 1), **dict.fromkeys(SPARSE_FIELDS, "68fd1e64")}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"I3": None, "C9": None}, None),  # the good case: nulls are missing values
        ({"I3": [1]}, "row 1, field 'I3': expected an integer or null, got a list"),
        ({"I3": {"a": 1}}, "row 1, field 'I3': expected an integer or null, got an object"),
        ({"I3": 1.5}, "row 1, field 'I3': expected an integer or null, got a number"),
        ({"I3": True}, "row 1, field 'I3': expected an integer or null, got a boolean"),
        ({"C2": 12}, "row 1, field 'C2': expected a string of hex digits or null, got an integer"),
        ({"C2": "xyz"}, "row 1, field 'C2': expected 1-8 hex digits, got 'xyz'"),
        ({"C2": "123456789"}, "row 1, field 'C2': expected 1-8 hex digits, got '123456789'"),
    ],
)
def test_a_wrong_type_names_the_row_and_field(
    change: dict[str, Any], message: str | None, raises_exactly: Any
) -> None:
    """Bug caught: a bad value read as something (a list's first item, a bool as 1)
    instead of refused, or an error that does not say which row and field."""
    reader = RowReader(criteo_config(), None)
    rows = [good_criteo_row(), {**good_criteo_row(), **change}]
    if message is None:
        assert reader.batch(rows).sparse.batch_size == 2
        return
    with raises_exactly(message):
        reader.parse(rows)


def test_missing_unknown_and_non_finite_features_are_refused(raises_exactly: Any) -> None:
    """Bug caught: a missing feature read as 0, an unknown one silently dropped, a NaN
    or an overflow to inf passed to the model."""
    criteo = RowReader(criteo_config(), None)
    row = good_criteo_row()
    del row["C7"]
    with raises_exactly("row 0: missing feature 'C7' (1 missing)"):
        criteo.parse([row])
    with pytest.raises(RowError, match=r"^row 0: unknown feature 'C27'; the model reads I1, "):
        criteo.parse([{**good_criteo_row(), "C27": "1"}])
    criteo.parse([{**good_criteo_row(), "label": 1}])  # the label column is ignored
    synthetic = RowReader(synthetic_config(), None)
    good = {"dense0": 0.5, "dense1": 1, "dense2": -2.0, "C1": [1, 2], "C2": 3}
    assert synthetic.batch([good]).sparse.values.tolist() == [1, 2, 3]
    with raises_exactly("row 0, field 'dense1': nan is not a finite float32"):
        synthetic.parse(json.loads(json.dumps([{**good, "dense1": float("nan")}])))
    with raises_exactly("row 0, field 'dense2': 1e+300 is not a finite float32"):
        synthetic.parse([{**good, "dense2": 1e300}])
    with raises_exactly("row 0, field 'C2': id 20 is not a row of its table [0, 20)"):
        synthetic.parse([{**good, "C2": 20}])


def test_request_shape_and_row_count_are_checked(raises_exactly: Any) -> None:
    """Bug caught: a body that is not ``{"rows": [...]}`` or has too many rows read
    anyway (or crashing with a TypeError instead of a one-line error)."""
    reader = RowReader(criteo_config(), None, max_rows=2)
    with pytest.raises(TooManyRowsError, match=r"^the request has 3 rows; at most 2$"):
        reader.parse([good_criteo_row()] * 3)
    with raises_exactly("rows must be a list of objects, got an object"):
        reader.parse({"a": 1})
    with raises_exactly("row 0: expected an object of feature values, got a list"):
        reader.parse([[1, 2]])
    with raises_exactly('the request has no "rows"; a request is {"rows": [...]}'):
        parse_request({}, reader)
    with raises_exactly("unknown request field 'row'; a request is {\"rows\": [...]}"):
        parse_request({"rows": [], "row": 1}, reader)
    assert parse_request({"rows": []}, reader).rows == 0
