"""The background thread that turns captured batches into Parquet row groups.

The recording thread fills capture buffers; whole batches come here, where
``to_table`` builds the Arrow columns with numpy and pyarrow. The file is written
under a temporary name and renamed on ``close()``, so a reader never sees a
half-written trace under the final name."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvreplay.recorder.layout import ROW_BOUNDS, ROW_FOLD_COUNT, ROW_GROUP_AT
from kvreplay.recorder.raw_batch import ROW_WIDTH, RawBatch
from kvreplay.recorder.rotation import ClosedPart, PartStart, Rotation, retire
from kvreplay.trace.format import (
    GAP_TARGET,
    PARQUET_OPTIONS,
    SCHEMA,
    GapRecord,
    TraceMeta,
    folded_calls,
    part_name,
)
from kvreplay.trace.reader import folded_per_row

STOP = object()  # the queue item that ends a writer thread
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def rows_of(item: RawBatch | GapRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, depth, top-level calls folded in) of a batch's rows, read straight from its buffer."""
    if isinstance(item, GapRecord):  # a lost gap row loses no call of its own
        return np.array([item.last_seq]), np.array([1]), np.array([0])
    rows = np.frombuffer(item.rows, dtype=np.int64).reshape(-1, ROW_WIDTH)
    return rows[:, 0], rows[:, 2], folded_calls(rows[:, ROW_FOLD_COUNT], rows[:, ROW_GROUP_AT], rows[:, ROW_BOUNDS])


def span_of(seq: np.ndarray, depth: np.ndarray, folded: np.ndarray) -> tuple[int, int, int]:
    """(first call, last call, calls) of rows that hold at least one top-level call:
    calls folded into a row came after it, and a fold into the last one after every row
    (its last call's number is a bound: a folded group's nested calls took numbers too)."""
    top = depth == 0
    return int(seq[top][0]), int(seq.max()) + int(folded[top][-1]), int(top.sum()) + int(folded.sum())


def _table_rows(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, depth, top-level calls folded in) of a written table's rows, gap rows given depth 1: they are not calls."""
    depth = table.column("depth").to_numpy().astype(np.int64)
    depth[pc.equal(table.column("target"), GAP_TARGET).to_numpy(zero_copy_only=False)] = 1
    folded = folded_per_row(table.column("folded_reads"), table.column("folded_group_at"),
                            table.column("folded_group_bounds"))
    return table.column("seq").to_numpy(), depth, folded


class ParquetSink:
    """Turns batches into row groups of about ``rows_per_group`` rows in ``NAME.tmp``;
    ``finish()`` closes the file and moves it to its final name.

    With a rotation (rotation.py), NAME is a directory of parts ``part-NNNNNN.parquet``.
    A part is closed and renamed where the recording sends a ``PartStart``, and the
    next starts from the snapshot that came with it: a part under its final name is
    complete and replays alone, so a writer that dies (with its process, or of a full
    disk) loses only the open part. Past the retention bound the oldest parts go.

    A failed write (a full disk) leaves pyarrow's writer closed and its file without a
    footer, unreadable. So the open part (the whole file, without rotation) is deleted,
    which also frees its space, and started again; the calls it held and the batch
    that failed become one gap row at the start of the new part. Rotation bounds what
    a full disk can cost to one part."""

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int = 16384,
                 rotation: Rotation | None = None, observe: Callable[[pa.Table], None] | None = None) -> None:
        self.path = Path(path)
        self.observe = observe  # shown every table the file takes, in order (kvreplay record --watch)
        self.meta = meta
        self.rows_per_group = rows_per_group
        self.rotation = rotation or Rotation()
        self.rotating = self.rotation.on
        self.rows_written = 0
        self.parts = 0
        self.calls_written = 0  # numbered calls in the parts so far (a part's first call is this + 1)
        self.closed: list[ClosedPart] = []  # closed parts still on disk, oldest first
        self.retired = self.retired_bytes = 0
        # Every part names its recording and its place in it: a reader refuses a directory
        # that mixes two recordings' parts or lacks one between two it holds.
        self.recording = uuid.uuid4().hex
        self._made_dir = False
        if self.rotating:
            if self.path.is_symlink() or (self.path.exists() and not self.path.is_dir()):
                # a link would take the parts out of the directory the recording writes to
                raise FileExistsError(f"{self.path} is a file or a link; a rotated trace is a directory of parts")
            self._made_dir = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer: pq.ParquetWriter | None = None
        self._file: BinaryIO | None = None  # the open part's file, which pyarrow does not close
        self._pending: list[pa.Table] = []
        self._rows = 0
        self._gap: GapRecord | None = None  # lost calls not yet marked in the file
        self.lost_calls = 0
        self._part_meta = meta
        if self.rotating:
            first = {"index": 0, "first_call": 1, "standalone": True, "recording": self.recording}
            self._part_meta = replace(meta, extra={**meta.extra, "part": first})
        self._standalone = True  # the open part needs no part before it
        try:
            self._open_part()
        except Exception:  # no room for even the file's first bytes: the first flush tries again
            self._writer = None

    def _open_part(self) -> None:
        """Open the next part under its temporary name: a new file, never one already
        there (a link or a FIFO planted under that name is replaced, not written
        through). A part that cannot be opened leaves no file."""
        if self.rotating:
            self.target = self.path / part_name(self.parts)
        else:
            self.target = self.path
        self.tmp = self.target.with_name(self.target.name + ".tmp")
        self._part_rows_written = 0
        self._part_holds: GapRecord | None = None  # what losing this part would lose, as a gap
        self._part_calls = 0
        try:
            self.tmp.unlink(missing_ok=True)  # a killed writer's (pids repeat), or a link: gone, not followed
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
            self._file = os.fdopen(fd, "wb")
            self._writer = pq.ParquetWriter(self._file, SCHEMA.with_metadata(self._part_meta.to_parquet_metadata()),
                                            **PARQUET_OPTIONS)
            self._file.flush()  # a disk with no room for the magic bytes fails here, not at the end
        except BaseException:
            try:
                self._close_writer()
            except Exception:
                pass  # the failure that got here is the one to report
            self.tmp.unlink(missing_ok=True)
            raise

    def _close_writer(self) -> None:
        """Close the open part's writer (writing its footer) and then its file."""
        writer, file, self._writer, self._file = self._writer, self._file, None, None
        try:
            if writer is not None:
                writer.close()
        finally:
            if file is not None:
                file.close()  # flushes what is buffered: a full disk shows here too

    def _restart_part(self, exc: BaseException) -> None:
        """The open part cannot be finished: delete it and open it again, its calls a gap."""
        if self._part_holds is not None:
            lost = replace(self._part_holds, reason=f"trace writer: {type(exc).__name__}: {exc}")
            self.lost_calls += self._part_calls
            self.calls_written -= self._part_calls
            self._gap = lost if self._gap is None else lost.merged(self._gap)
            self.rows_written -= self._part_rows_written
        try:
            self._close_writer()
        except Exception:
            pass  # closed by the failure already
        self.tmp.unlink(missing_ok=True)
        try:
            self._open_part()
        except Exception:  # still no room: the next flush tries again
            self._writer = None

    def _close_part(self) -> None:
        assert self._writer is not None
        self._close_writer()
        os.replace(self.tmp, self.target)
        self.parts += 1
        if self.rotating:
            self.closed.append(ClosedPart(self.target, self.target.stat().st_size, self._standalone))

    def _start_part(self, start: PartStart) -> None:
        """Close the open part (if it holds anything) and open the next from ``start``'s
        snapshot; then retire what the retention bound no longer keeps."""
        self._flush()
        state = None
        if start.state:
            try:
                state = json.loads(start.state)
            except ValueError:
                state = None
        if self._writer is not None and self._part_rows_written:
            try:
                self._close_part()
            except Exception as exc:  # the footer did not fit: the part is lost
                self._restart_part(exc)
                return
        elif self._writer is not None:  # nothing of it reached the disk: open it again with the new start
            try:
                self._close_writer()
            except Exception:
                pass
            self.tmp.unlink(missing_ok=True)
        part = {"index": self.parts, "first_call": self.calls_written + 1, "standalone": state is not None,
                "recording": self.recording}
        self._part_meta = replace(self.meta, initial_state=state, extra={**self.meta.extra, "part": part})
        self._standalone = state is not None
        try:
            self._open_part()
        except Exception:  # no room: the next flush tries again
            self._writer = None
        self._retire()

    def _retire(self) -> None:
        for part in retire(self.closed, self._standalone, self.rotation):
            try:
                part.path.unlink(missing_ok=True)
            except OSError:
                break  # still there: it still counts
            self.closed.remove(part)
            self.retired += 1
            self.retired_bytes += part.size

    def add(self, item: RawBatch | GapRecord | PartStart) -> None:
        """Queue a batch (or a gap) for the file. A batch that cannot be converted or
        written becomes a gap row: the calls are lost, the trace says so and goes on."""
        if isinstance(item, PartStart):
            if self.rotating:
                self._start_part(item)
            return
        try:
            table = item.to_table()
        except Exception as exc:
            self._lose(rows_of(item), exc)
            return
        self._pending.append(table)
        self._rows += table.num_rows
        if self.observe is not None:
            self.observe(table)
        if self._rows >= self.rows_per_group:
            self._flush()

    def _lose(self, rows: tuple[np.ndarray, np.ndarray, np.ndarray], exc: BaseException) -> None:
        if not (rows[1] == 0).any():
            return  # only a gap row was lost, and its caller keeps that gap
        first, last, n = span_of(*rows)
        gap = GapRecord(first, last, n, f"trace writer: {type(exc).__name__}: {exc}", "", time.time_ns())
        self.lost_calls += n
        self._gap = gap if self._gap is None else self._gap.merged(gap)

    def _flush(self) -> None:
        if not self._pending and self._gap is None:
            return
        gap, self._gap = self._gap, None
        if gap is not None:
            self._pending.insert(0, gap.to_table())  # the gap goes where the lost calls were
        table = pa.concat_tables(self._pending)
        self._pending, self._rows = [], 0
        try:
            if self._writer is None:  # the last restart could not open the part
                self._open_part()
            assert self._writer is not None and self._file is not None
            self._writer.write_table(table, row_group_size=table.num_rows)
            self._file.flush()  # a full disk fails this write, whose rows become the gap
        except Exception as exc:  # e.g. the disk is full: these rows are lost, later ones may not be
            self._gap = gap
            self._lose(_table_rows(table), exc)
            self._restart_part(exc)
            return
        self.rows_written += table.num_rows
        self._part_rows_written += table.num_rows
        seq, depth, folded = _table_rows(table)
        held = gap
        if (depth == 0).any():
            first, last, n = span_of(seq, depth, folded)
            self._part_calls += n
            self.calls_written += n
            calls = GapRecord(first, last, n, "", "", time.time_ns())
            held = calls if held is None else held.merged(calls)
        if held is not None:
            self._part_holds = held if self._part_holds is None else self._part_holds.merged(held)

    def finish(self) -> Path:
        self._flush()
        if self._gap is not None:  # the last write failed: one more try for its gap row
            self._flush()
        if self._gap is not None or self._writer is None:
            raise OSError(f"could not write {self.tmp}: {self._gap.reason if self._gap else 'no writer'}")
        if self.rotating and self.parts and not self._part_rows_written:
            try:
                self._close_writer()  # the part opened after the last rotation got nothing: drop it
            except Exception:
                pass  # its footer did not fit: nothing of it is kept either way
            self.tmp.unlink(missing_ok=True)
            return self.path
        self._close_part()
        if self.rotating:
            self._standalone = True  # no part follows the last: nothing depends on it
            self._retire()
        return self.path

    def abort(self) -> None:
        """Give up: close what can be closed and leave no file under the final name
        (nor the unfinished one: without its footer it cannot be read), nor the
        directory of parts it made when no part of it is left."""
        try:
            self._close_writer()
        except Exception:
            pass
        self.tmp.unlink(missing_ok=True)
        if self._made_dir:
            try:
                self.path.rmdir()  # only when empty: the parts written stay
            except OSError:
                pass


DEFAULT_MAX_QUEUED_ROWS = 1 << 18  # about 64 default batches (~50 MB) waiting for the writer


class WriterFailed(RuntimeError):
    """The trace could not be finished (a disk that stayed full, a writer that was
    killed). Expected of a recording that runs for days, so the recorded program
    reports it in one line, never with a traceback."""


class QueuedWriter:
    """What both writers share: batches queue up for one daemon thread (``_run``);
    ``_drain`` ends it once, after everything queued before it.

    The queue is bounded in rows: ``offer`` refuses a batch that would overflow it
    (the recording marks a gap and the program never waits); ``submit`` always queues."""

    thread_name = "kvreplay-writer"

    def __init__(self, path: str | os.PathLike[str], max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS) -> None:
        self.path = Path(path)
        self.error: BaseException | None = None
        self.max_queued_rows = max_queued_rows
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queued_rows = 0
        self._count_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def offer(self, item: RawBatch | GapRecord) -> bool:
        rows = _row_count(item)
        with self._count_lock:
            if self._queued_rows + rows > self.max_queued_rows:
                return False
            self._queued_rows += rows
        self._queue.put((item, rows))
        return True

    def submit(self, item: RawBatch | GapRecord) -> None:
        rows = _row_count(item)
        with self._count_lock:
            self._queued_rows += rows
        self._queue.put((item, rows))

    def _taken(self, rows: int) -> None:
        with self._count_lock:
            self._queued_rows -= rows

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


def settled(item: RawBatch | GapRecord | PartStart) -> RawBatch | GapRecord | PartStart:
    """A gap or a part's start with its state encoded, on the writer's side of the queue."""
    return item.settled() if isinstance(item, (GapRecord, PartStart)) else item


def _row_count(item: RawBatch | GapRecord | PartStart) -> int:
    # rows is bytes (C engine) or array('q') (Python engine): count bytes either way
    if isinstance(item, (GapRecord, PartStart)):
        return 1
    return memoryview(item.rows).nbytes // (8 * ROW_WIDTH)


class TraceWriter(QueuedWriter):
    """Writes submitted batches from a daemon thread of the recording process.

    The thread competes with the recorded program for the GIL while it builds Arrow
    columns; ``ProcessTraceWriter`` avoids that and is the default."""

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int = 16384,
                 max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS, rotation: Rotation | None = None) -> None:
        super().__init__(path, max_queued_rows)
        self._sink = ParquetSink(path, meta, rows_per_group, rotation)
        self._thread.start()

    def _run(self) -> None:
        while True:
            got = self._queue.get()
            if got is STOP:
                return
            item, rows = got
            if self.error is None:
                try:
                    self._sink.add(settled(item))  # a batch it cannot write becomes a gap row
                except BaseException as exc:  # keep the recorded program alive; close() reports it
                    self.error = exc
            self._taken(rows)

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
        raise WriterFailed(f"trace writer failed: {self.error}") from self.error
