"""Trace format: lossless values, streaming reads, readable without kvreplay, clear errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from kvreplay.errors import TraceFormatError
from kvreplay.recorder.py_buffers import RowBatch
from kvreplay.recorder.raw_batch import NULL, RawBatch
from kvreplay.recorder.writer import TraceWriter
from kvreplay.trace.format import SCHEMA, TraceMeta
from kvreplay.trace.reader import TraceReader

META = TraceMeta(pool_class="x:Pool", family="paged", ctor_args={"size": 64, "page_size": 4})

VALUES = [
    None,
    True,
    False,
    0,
    -1,
    2**62,
    1.5,
    "text",
    torch.tensor([3, 1, 2], dtype=torch.int64),
    torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
    torch.tensor([True, False]),
    torch.empty((0,), dtype=torch.int64),
    torch.tensor(7, dtype=torch.int64),  # 0-d
    [1, 2, 3],
    (4, 5),
    [(torch.tensor([8, 9, 10]), 4), (torch.tensor([12], dtype=torch.int32), 8)],
]


def _batch(rows: list[tuple[int, tuple, object]]) -> RawBatch:
    """Rows (seq, argument values, result) appended the way the recorder does."""
    b = RowBatch()
    root, m = b.names.id("root"), b.names.id("m")
    for seq, values, result in rows:
        b.begin(values, tuple(b.names.id(f"a{i}") for i in range(len(values))))
        b.add(seq, -1, 0, root, m, seq, seq + 1, result, None, (1, NULL, NULL))
    return b.raw()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list) and a and isinstance(a[0], tuple):
        return len(a) == len(b) and all(_same(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_every_value_kind_round_trips_losslessly(tmp_path):
    path = tmp_path / "t.parquet"
    w = TraceWriter(path, META)
    w.submit(_batch([(0, tuple(VALUES), VALUES[8]), *[(i + 1, (v,), v) for i, v in enumerate(VALUES)]]))
    w.close()
    calls = list(TraceReader(path).calls())
    assert len(calls) == len(VALUES) + 1
    for i, v in enumerate(VALUES):
        assert _same(v, calls[0].args[f"a{i}"]), (v, calls[0].args[f"a{i}"])
        assert _same(v, calls[i + 1].result)


def test_reader_streams_in_batches_and_never_reads_the_whole_file(tmp_path):
    path = tmp_path / "big.parquet"
    w = TraceWriter(path, META, rows_per_group=1000)
    for start in range(0, 10_000, 500):
        w.submit(_batch([(s, (torch.arange(8),), None) for s in range(start, start + 500)]))
    w.close()
    r = TraceReader(path)
    assert r.num_rows == 10_000
    assert r._files[0].metadata.num_row_groups == 10
    it = r.iter_batches(batch_size=256)
    first = next(it)
    assert first.num_rows == 256
    seqs = [c.seq for c in r.calls(batch_size=777)]
    assert seqs == list(range(10_000))


def test_trace_reads_with_pandas_and_duckdb_without_kvreplay(tmp_path):
    path = tmp_path / "t.parquet"
    w = TraceWriter(path, META)
    w.submit(_batch([(0, (torch.tensor([4, 5, 6]),), torch.tensor([9]))]))
    w.close()
    import duckdb
    import pandas as pd

    df = pd.read_parquet(path)
    assert list(df["method"]) == ["m"] and list(df["args"][0][0]["data"]) == [4, 5, 6]
    con = duckdb.connect()
    n, data = con.execute(f"select count(*), any_value(result.data) from read_parquet('{path}')").fetchone()
    assert n == 1 and list(data) == [9]
    md = pq.read_schema(path).metadata
    assert json.loads(md[b"kvreplay.ctor_args"]) == {"size": 64, "page_size": 4}
    assert md[b"kvreplay.schema_version"] == b"4"


def test_writer_publishes_the_file_only_when_closed(tmp_path):
    path = tmp_path / "t.parquet"
    w = TraceWriter(path, META)
    w.submit(_batch([(0, (), None)]))
    assert not path.exists()
    w.close()
    assert path.exists() and not (tmp_path / "t.parquet.tmp").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_text("not parquet at all"), "not a readable Parquet file"),
        (lambda p: pq.write_table(pa.table({"x": [1]}), p), "not a readable kvreplay trace"),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path, make, message):
    p = tmp_path / "bad.parquet"
    make(p)
    with pytest.raises(TraceFormatError, match=message) as e:
        TraceReader(p)
    assert "\n" not in str(e.value)


def test_truncated_and_newer_traces_are_refused(tmp_path):
    good = tmp_path / "good.parquet"
    w = TraceWriter(good, META)
    w.submit(_batch([(i, (torch.arange(100),), None) for i in range(100)]))
    w.close()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(TraceFormatError, match="not a readable Parquet file"):
        TraceReader(cut)
    newer = tmp_path / "newer.parquet"
    table = pq.read_table(good)
    md = dict(table.schema.metadata)
    md[b"kvreplay.schema_version"] = b"99"
    pq.write_table(table.replace_schema_metadata(md), newer)
    with pytest.raises(TraceFormatError, match="schema version 99 is newer"):
        TraceReader(newer)


def test_schema_is_the_documented_one():
    text = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "trace-format.md").read_text()
    for field in SCHEMA:
        assert f"`{field.name}`" in text, f"column {field.name} is not documented"
    for key in META.to_parquet_metadata():
        assert f"`{key.decode()}`" in text, f"metadata key {key.decode()} is not documented"

