"""Rows as the recorder captures them, and the background thread that writes them.

The recording thread appends each call straight into per-column Python lists (a
``RowBatch``); nothing is encoded per value. Whole batches go to a writer thread
that turns every column into an Arrow array in C and writes Parquet row groups.
The file is written under a temporary name and renamed on ``close()``, so a reader
never sees a half-written trace under the final name."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvreplay.recorder.trace_format import (
    ARG_TYPE,
    PARQUET_OPTIONS,
    SCHEMA,
    VALUE_TYPE,
    TraceMeta,
    ValueColumns,
    list_offsets,
)


class RowBatch:
    """Complete top-level calls (with their nested calls), column by column.

    Arguments are appended when a call starts, which is ``seq`` order; the rest of
    a row when it returns, which puts nested rows before their parent. ``to_table``
    sorts the returned-order columns back into ``seq`` order."""

    __slots__ = ("seq", "parent", "depth", "target", "method", "t_start_ns", "t_end_ns", "arg_count", "arg_name",
                 "args", "result", "exc_type", "exc_msg", "available", "full_available", "swa_available")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, [])
        self.args = ValueColumns()
        self.result = ValueColumns()

    def __len__(self) -> int:
        return len(self.seq)

    def add(self, seq: int, parent: int, depth: int, target: str, method: str, t0: int, t1: int, result: Any,
            exc: BaseException | None, counters: tuple[int | None, int | None, int | None]) -> None:
        """Append the returned-order part of a row (its arguments are already in)."""
        self.seq.append(seq)
        self.parent.append(parent)
        self.depth.append(depth)
        self.target.append(target)
        self.method.append(method)
        self.t_start_ns.append(t0)
        self.t_end_ns.append(t1)
        self.result.put(result)
        if exc is None:
            self.exc_type.append(None)
            self.exc_msg.append(None)
        else:
            self.exc_type.append(type(exc).__name__)
            self.exc_msg.append(str(exc)[:1000])
        self.available.append(counters[0])
        self.full_available.append(counters[1])
        self.swa_available.append(counters[2])

    def to_table(self) -> pa.Table:
        order = np.argsort(np.asarray(self.seq, dtype=np.int64), kind="stable")
        cols = {
            "seq": pa.array(self.seq, pa.int64()),
            "parent": pa.array(self.parent, pa.int64()),
            "depth": pa.array(self.depth, pa.int8()),
            "target": pa.array(self.target, pa.string()),
            "method": pa.array(self.method, pa.string()),
            "t_start_ns": pa.array(self.t_start_ns, pa.int64()),
            "t_end_ns": pa.array(self.t_end_ns, pa.int64()),
            "result": pa.StructArray.from_arrays(self.result.fields(), fields=list(VALUE_TYPE)),
            "exc_type": pa.array(self.exc_type, pa.string()),
            "exc_msg": pa.array(self.exc_msg, pa.string()),
            "available": pa.array(self.available, pa.int64()),
            "full_available": pa.array(self.full_available, pa.int64()),
            "swa_available": pa.array(self.swa_available, pa.int64()),
        }
        take = pa.array(order)
        cols = {k: v.take(take) for k, v in cols.items()}
        arg_struct = pa.StructArray.from_arrays([pa.array(self.arg_name, pa.string()), *self.args.fields()],
                                                fields=list(ARG_TYPE))
        cols["args"] = pa.ListArray.from_arrays(list_offsets(self.arg_count), arg_struct)
        return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)


_STOP = object()


class TraceWriter:
    """Writes submitted batches to ``path`` from a daemon thread, a row group per
    ``rows_per_group`` rows."""

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

    def submit(self, batch: RowBatch) -> None:
        self._queue.put(batch)

    def _run(self) -> None:
        pending: list[pa.Table] = []
        rows = 0
        while True:
            item = self._queue.get()
            stop = item is _STOP
            if not stop and self.error is None:
                try:
                    table = item.to_table()
                    pending.append(table)
                    rows += table.num_rows
                except BaseException as exc:  # keep the recorded program alive; close() reports it
                    self.error = exc
            if pending and (stop or rows >= self.rows_per_group):
                self._write(pa.concat_tables(pending))
                pending, rows = [], 0
            if stop:
                return

    def _write(self, table: pa.Table) -> None:
        if self.error is not None:
            return
        try:
            self._writer.write_table(table, row_group_size=table.num_rows)
            self.rows_written += table.num_rows
        except BaseException as exc:
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
