"""Background Parquet writer: the recording thread only appends tuples to a queue;
this thread encodes them into Arrow columns and writes row groups.

The file is written under a temporary name and renamed on ``close()``, so a
reader never sees a half-written trace under the final name."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from kvreplay.recorder.trace_format import (
    ARG_TYPE,
    PARQUET_OPTIONS,
    SCHEMA,
    VALUE_TYPE,
    ColumnBuilder,
    TraceMeta,
    list_offsets,
)


class Row(NamedTuple):
    seq: int
    parent: int
    depth: int
    target: str
    method: str
    t_start_ns: int
    t_end_ns: int
    arg_names: tuple[str, ...]
    arg_values: tuple[Any, ...]
    result: Any
    exc_type: str | None
    exc_msg: str | None
    available: int | None
    full_available: int | None
    swa_available: int | None
    device: str | None


def rows_to_table(rows: list[Row], meta: TraceMeta | None = None) -> pa.Table:
    """Encode rows column-wise into a table of SCHEMA."""
    args = ColumnBuilder()
    names: list[str] = []
    arg_counts: list[int] = []
    result = ColumnBuilder()
    for r in rows:
        arg_counts.append(len(r.arg_names))
        names.extend(r.arg_names)
        for v in r.arg_values:
            args.add(v)
        result.add(r.result)
    arg_struct = pa.StructArray.from_arrays([pa.array(names, pa.string()), *args.fields()], fields=list(ARG_TYPE))
    columns = {
        "seq": pa.array([r.seq for r in rows], pa.int64()),
        "parent": pa.array([r.parent for r in rows], pa.int64()),
        "depth": pa.array([r.depth for r in rows], pa.int8()),
        "target": pa.array([r.target for r in rows], pa.string()),
        "method": pa.array([r.method for r in rows], pa.string()),
        "t_start_ns": pa.array([r.t_start_ns for r in rows], pa.int64()),
        "t_end_ns": pa.array([r.t_end_ns for r in rows], pa.int64()),
        "args": pa.ListArray.from_arrays(list_offsets(arg_counts), arg_struct),
        "result": pa.StructArray.from_arrays(result.fields(), fields=list(VALUE_TYPE)),
        "exc_type": pa.array([r.exc_type for r in rows], pa.string()),
        "exc_msg": pa.array([r.exc_msg for r in rows], pa.string()),
        "available": pa.array([r.available for r in rows], pa.int64()),
        "full_available": pa.array([r.full_available for r in rows], pa.int64()),
        "swa_available": pa.array([r.swa_available for r in rows], pa.int64()),
    }
    schema = SCHEMA.with_metadata(meta.to_parquet_metadata()) if meta else SCHEMA
    return pa.Table.from_arrays([columns[f.name] for f in SCHEMA], schema=schema)


_STOP = object()


class TraceWriter:
    """Writes rows to ``path`` from a daemon thread, ``rows_per_group`` at a time."""

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int = 65536) -> None:
        self.path = Path(path)
        self.meta = meta
        self.rows_per_group = rows_per_group
        self.rows_written = 0
        self.error: BaseException | None = None
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(
            str(self._tmp), SCHEMA.with_metadata(meta.to_parquet_metadata()), **PARQUET_OPTIONS
        )
        self._thread = threading.Thread(target=self._run, name="kvreplay-writer", daemon=True)
        self._thread.start()

    def submit(self, rows: list[Row]) -> None:
        self._queue.put(rows)

    def _run(self) -> None:
        pending: list[Row] = []
        while True:
            item = self._queue.get()
            stop = item is _STOP
            if not stop:
                pending.extend(item)
            if pending and (stop or len(pending) >= self.rows_per_group):
                self._write(pending)
                pending = []
            if stop:
                return

    def _write(self, rows: list[Row]) -> None:
        if self.error is not None:
            return
        try:
            self._writer.write_table(rows_to_table(rows), row_group_size=len(rows))
            self.rows_written += len(rows)
        except BaseException as exc:  # keep the recorded program alive; close() reports it
            self.error = exc

    def close(self) -> Path:
        """Flush everything queued, finish the file and move it to its final name."""
        if self._closed:
            return self.path
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()
        self._writer.close()
        if self.error is not None:
            raise RuntimeError(f"trace writer failed: {self.error}") from self.error
        os.replace(self._tmp, self.path)
        return self.path
