"""The background thread that turns captured batches into Parquet row groups.

The recording thread fills ``RowBatch`` buffers; whole batches come here, where
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

from kvreplay.recorder.row_batch import RowBatch
from kvreplay.recorder.trace_format import PARQUET_OPTIONS, SCHEMA, TraceMeta

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
