"""The background thread that turns captured batches into Parquet row groups.

The recording thread fills capture buffers; whole batches come here, where
``to_table`` builds the Arrow columns with numpy and pyarrow. The file is written
under a temporary name and renamed on ``close()``, so a reader never sees a
half-written trace under the final name."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kvreplay.recorder.batch_table import RawBatch
from kvreplay.recorder.trace_format import PARQUET_OPTIONS, SCHEMA, TraceMeta

STOP = object()  # the queue item that ends a writer thread


class ParquetSink:
    """Turns batches into row groups of about ``rows_per_group`` rows in ``NAME.tmp``;
    ``finish()`` closes the file and moves it to its final name."""

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int = 16384) -> None:
        self.path = Path(path)
        self.rows_per_group = rows_per_group
        self.rows_written = 0
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(str(self.tmp), SCHEMA.with_metadata(meta.to_parquet_metadata()),
                                        **PARQUET_OPTIONS)
        self._pending: list[pa.Table] = []
        self._rows = 0

    def add(self, batch: RawBatch) -> None:
        table = batch.to_table()
        self._pending.append(table)
        self._rows += table.num_rows
        if self._rows >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            table = pa.concat_tables(self._pending)
            self._pending, self._rows = [], 0
            self._writer.write_table(table, row_group_size=table.num_rows)
            self.rows_written += table.num_rows

    def finish(self) -> Path:
        self._flush()
        self._writer.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Give up: close what can be closed and leave no file under the final name."""
        try:
            self._writer.close()
        except Exception:
            pass


class QueuedWriter:
    """What both writers share: batches queue up for one daemon thread (``_run``);
    ``_drain`` ends it once, after everything queued before it."""

    thread_name = "kvreplay-writer"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def submit(self, batch: RawBatch) -> None:
        self._queue.put(batch)

    def _run(self) -> None:
        raise NotImplementedError

    def _drain(self) -> bool:
        """Stop the thread after the queued batches; False when already closed."""
        if self._closed:
            return False
        self._closed = True
        self._queue.put(STOP)
        self._thread.join()
        return True


class TraceWriter(QueuedWriter):
    """Writes submitted batches from a daemon thread of the recording process.

    The thread competes with the recorded program for the GIL while it builds Arrow
    columns; ``ProcessTraceWriter`` avoids that and is the default."""

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int = 16384) -> None:
        super().__init__(path)
        self._sink = ParquetSink(path, meta, rows_per_group)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is STOP:
                return
            if self.error is None:
                try:
                    self._sink.add(item)
                except BaseException as exc:  # keep the recorded program alive; close() reports it
                    self.error = exc

    def close(self) -> Path:
        """Flush everything queued, finish the file and move it to its final name."""
        if not self._drain():
            return self.path
        if self.error is None:
            try:
                return self._sink.finish()
            except BaseException as exc:
                self.error = exc
        self._sink.abort()
        raise RuntimeError(f"trace writer failed: {self.error}") from self.error
