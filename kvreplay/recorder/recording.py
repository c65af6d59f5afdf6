"""Record every call on a live allocator instance into a trace.

``record(pool, path)`` swaps the instance's public methods (and those of its
sub-allocators) for thin wrappers; the class is untouched, so other instances and
the allocator's behaviour are unchanged. A call the pool makes on itself (SWA
``free`` calling ``free_swa``) is not a new row; a call into a sub-allocator is a
nested row whose ``parent`` is the calling row. Rows are handed to a background
writer when their top-level call returns.

A recorded pool is driven by one thread at a time, as SGLang's scheduler drives its
allocator; concurrent callers would interleave their nesting."""

from __future__ import annotations

import atexit
import datetime as _dt
import functools
import inspect
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvreplay.contract.record import load
from kvreplay.contract.registry import ctor_args_of_pool, family, family_of_pool
from kvreplay.errors import BadInput
from kvreplay.limits import writer_kind
from kvreplay.recorder.capture import Engine, default_backend
from kvreplay.recorder.layout import FINISH_CALL, FINISH_GROUP_BEGIN, FINISH_GROUP_END, FINISH_READ
from kvreplay.recorder.py_buffers import Names
from kvreplay.recorder.raw_batch import RawBatch
from kvreplay.recorder.rotation import PartClock, PartStart, Rotation
from kvreplay.recorder.writer import DEFAULT_MAX_QUEUED_ROWS, TraceWriter, WriterFailed, rows_of, span_of
from kvreplay.recorder.writer_child import unpin
from kvreplay.recorder.writer_process import ProcessTraceWriter
from kvreplay.trace import snapshot as pool_snapshot
from kvreplay.trace.format import COUNTERS, CheckpointRecord, GapRecord, TraceMeta
from kvreplay.version import __version__

log = logging.getLogger("kvreplay.recorder")

# how the capture engine finishes each call that is more than a call: a group's brackets
# (sglang's free groups: the capture keeps their depth) and a family's counter reads
_GROUP_FINISH = {"free_group_begin": FINISH_GROUP_BEGIN, "free_group_end": FINISH_GROUP_END}

_open: weakref.WeakSet[Recording] = weakref.WeakSet()


def pool_class_name(pool: Any) -> str:
    # A wire over an engine's object (families/vllm/wire.py) names the engine's class.
    recorded = getattr(pool, "recorded_class", None)
    if isinstance(recorded, str):
        return recorded
    cls = type(pool)
    return f"{cls.__module__}:{cls.__qualname__}"


def _source_version(pool: Any) -> dict[str, str]:
    out = {"kvreplay": __version__, "torch": str(torch.__version__)}  # not TorchVersion: plain str pickles
    top = pool_class_name(pool).split(".")[0].split(":")[0]
    mod = __import__(top)
    ver = getattr(mod, "__version__", None)
    if ver and top != "kvreplay":
        out[top] = str(ver)
    return out


def _check_checkpoints(pool: Any) -> None:
    # a checkpoint is a snapshot of the pool and of its checker: a family whose pool cannot
    # be snapshotted (vLLM's manager, the hybrid request pool) has neither
    fam = family(family_of_pool(pool))
    if not (fam.snapshots and fam.checker):
        raise BadInput(f"{fam.name} traces take no checkpoints (its pools cannot be snapshotted): "
                       "record it with --checkpoint-every 0")


class Recording:
    """An active recording of one allocator instance; ``close()`` finishes the file."""

    def __init__(
        self,
        pool: Any,
        path: str | os.PathLike[str] | None,
        *,
        rank: str = "",
        extra: dict[str, Any] | None = None,
        rows_per_group: int = 16384,
        rows_per_batch: int = 4096,
        backend: str | None = None,
        writer: str | None = None,
        snapshot: bool | None = None,
        flush_s: float = 0.1,
        max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS,
        rotate_rows: int = 0,
        rotate_s: float = 0.0,
        keep_parts: int = 0,
        keep_bytes: int = 0,
        counters_every: int = 1,
        checkpoint_every: int = 0,
        fold_reads: bool = True,
    ) -> None:
        self.pool = pool
        if checkpoint_every > 0:
            _check_checkpoints(pool)
        if snapshot is None:  # attach: a pool already in use starts its trace with its state
            snapshot = not is_fresh(pool)
        self.meta = TraceMeta(
            pool_class=pool_class_name(pool),
            family=family_of_pool(pool),
            ctor_args=ctor_args_of_pool(pool),
            source_version=_source_version(pool),
            host=socket.gethostname(),
            pid=os.getpid(),
            rank=rank,
            start_time=_dt.datetime.now(_dt.timezone.utc).isoformat(),
            initial_state=pool_snapshot.take(pool) if snapshot else None,
            extra=dict(extra or {}),
        )
        self.max_queued_rows = max_queued_rows
        # Either cut > 0: PATH is a directory of parts, each starting from a snapshot (rotation.py).
        self.rotation = Rotation(rotate_rows, rotate_s, keep_parts, keep_bytes)
        self._parts = PartClock(self.rotation) if self.rotation.on and path is not None else None
        # Only the slot families' pools snapshot; another family's parts are chained.
        self._part_snapshots = family(self.meta.family).snapshots
        # No path: the batches stay with a subclass (the flight recorder keeps them in memory).
        self._writer = None if path is None else self._open(writer or writer_kind() or "process",
                                                            path, rows_per_group)
        self._names = Names()
        self._lock = threading.Lock()  # batches reach the writer in call order, from either thread
        self._gap: GapRecord | None = None  # calls dropped, not yet marked in the trace
        self._stopped_by: GapRecord | None = None
        self._last_delivered = -1
        self._held: list[RawBatch] = []  # batches the idle flusher could not hand over (_deliver)
        self.lost_calls = 0
        self._engine = Engine(backend or default_backend(), self._names, self._counter_readers(pool),
                              self._flush, rows_per_batch, self._failed, flush_ns=int(flush_s * 1e9),
                              raised=self._raised, counters_every=counters_every, fold_reads=fold_reads)
        self._patched: list[tuple[Any, str]] = []
        fam = family(self.meta.family)
        self._methods = fam.methods
        self._reads = fam.vocabulary.reads
        self._counter_slots = {name: k for k, name in enumerate(fam.counter_reads)}  # a read -> its column
        self._finish = {**_GROUP_FINISH, **{m: FINISH_READ for m in self._reads}}
        # Checkpoints need a writer (the flight recorder keeps its own snapshots).
        self._checkpoints = _Checkpointer(self, checkpoint_every) if checkpoint_every > 0 and path else None
        self._patch(pool, "root")
        for target, attr in fam.sub_allocators:
            sub = getattr(pool, attr, None)
            if sub is not None and sub is not pool:
                self._patch(sub, target)
        _open.add(self)
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if flush_s > 0:
            self._flusher = threading.Thread(target=self._flush_when_idle, args=(flush_s,), daemon=True,
                                             name="kvreplay-flusher")
            self._flusher.start()

    @property
    def calls_recorded(self) -> int:
        return self._engine.next_seq

    @property
    def backend(self) -> str:
        """``native`` or ``python``: which capture engine records the calls."""
        return self._engine.backend

    @staticmethod
    def _counter_readers(pool: Any) -> tuple[Callable[[], int] | None, ...]:
        # Bound before patching, so reading counters is never itself recorded.
        reads = family(family_of_pool(pool)).counter_reads
        # one reader per counter column: a family that fills fewer leaves the rest unread
        return tuple(getattr(pool, n, None) for n in reads) + (None,) * (len(COUNTERS) - len(reads))

    def _patch(self, obj: Any, target: str) -> None:
        for name in self._methods:
            if target != "root" and name in self._reads:
                continue  # a sub-pool's counters are already in the parent row's counters
            fn = getattr(obj, name, None)
            if fn is None or not callable(fn):
                continue
            try:
                params = tuple(name for name, p in inspect.signature(fn).parameters.items()
                               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
            except (TypeError, ValueError):
                params = ()
            ids = self._names
            slot = self._counter_slots.get(name, -1) if target == "root" else -1
            wrapped = self._engine.wrap(fn, ids.id(target), ids.id(name), tuple(ids.id(p) for p in params),
                                        self._finish.get(name, FINISH_CALL), name, slot)
            if target == "root" and self._checkpoints is not None:
                wrapped = self._checkpoints.wrap(wrapped, name, params)
            setattr(obj, name, wrapped)
            self._patched.append((obj, name))

    def _open(self, kind: str, path: str | os.PathLike[str], rows_per_group: int) -> Any:
        return _open_writer(kind, path, self.meta, rows_per_group, self.max_queued_rows, self.rotation)

    def _flush(self) -> None:
        with self._lock:
            self._deliver(self._engine.take())
            if self._parts is not None and self._parts.due() and not self._engine.in_group:
                self._new_part()

    def _new_part(self) -> None:
        """End the part here, between two calls of the recorded thread (the only place
        the pool's state is that of the calls written): the next part starts from the
        pool's snapshot now, taken as device copies and encoded on the writer's side."""
        assert self._parts is not None
        self._parts.restart()
        if self._stopped_by is not None:
            return
        if self._gap is not None:  # lost calls before the snapshot belong to the part that ends
            self._writer.submit(self._gap)
            self._gap = None
        # a pool the snapshot cannot read (or a family without one): the part is chained
        self._writer.submit(PartStart("", self._pending_state() if self._part_snapshots else None))

    def _pending_state(self) -> Callable[[], str] | None:
        """The pool's state now, as device copies the writer's side encodes; None when the
        snapshot cannot read this pool."""
        try:
            return functools.partial(_state_json, pool_snapshot.capture(self.pool))
        except Exception:
            return None

    def _deliver(self, batch: RawBatch, idle: bool = False) -> None:
        """Hand a batch to the writer without ever waiting for it. When its queue is
        full the batch is dropped, and a gap row (with the pool's state now, right
        after the dropped calls) goes in ahead of the next batch that fits.

        ``idle``: the idle flusher's batch, taken between two calls of the recorded
        thread, which may have gone on since: the pool's state now is not the state
        right after the batch. So a batch it cannot hand over is held (up to the
        queue's size) for the recorded thread's next delivery to send or drop."""
        pending, self._held = [*self._held, *([batch] if (rows_of(batch)[1] == 0).any() else [])], []
        if not pending:
            return
        sent = 0
        while sent < len(pending):
            if self._gap is not None:
                if not self._writer.offer(self._gap):
                    break
                self._gap = None
            if not self._writer.offer(pending[sent]):
                break
            self._last_delivered = span_of(*rows_of(pending[sent]))[1]
            if self._parts is not None:
                self._parts.add(len(pending[sent]))
            sent += 1
        rest = pending[sent:]
        if not rest:
            return
        if idle and sum(len(b) for b in rest) <= self.max_queued_rows:
            self._held = rest
            return
        spans = [span_of(*rows_of(b)) for b in rest]
        self._drop((spans[0][0], spans[-1][1], sum(s[2] for s in spans)), "the trace writer's queue was full",
                   snapshot=not idle)

    def _drop(self, span: tuple[int, int, int], reason: str, snapshot: bool = True) -> None:
        pending = self._pending_state() if snapshot else None  # none readable: the gap is still marked
        first, last, lost = span
        gap = GapRecord(first, last, lost, reason, "", time.time_ns(), pending)
        self._gap = gap if self._gap is None else self._gap.merged(gap)
        self.lost_calls += lost

    def _checkpoint(self, calls: int, checker_state: str) -> None:
        """Write a checkpoint row after top-level call ``calls``: the rows so far go to
        the writer first, so the checkpoint sits exactly between two calls."""
        with self._lock:
            self._deliver(self._engine.take())
            if self._parts is not None and self._parts.due():  # outside a group, as checkpoints are
                self._new_part()
            if self._gap is not None or self._stopped_by is not None:
                return  # calls were lost: a checkpoint would stand after a hole, not a call
            pending = self._pending_state()
            if pending is None:  # a pool the snapshot cannot read has no checkpoints
                return
            seq = self._engine.next_seq - 1
            self._writer.submit(CheckpointRecord(seq, seq, 0, "checkpoint", "", time.time_ns(), pending,
                                                 calls=calls, checker=checker_state))

    def _raised(self) -> None:
        """A top-level call raised: get its row to the writer now (the program may be dying)."""
        self._flush()

    def _flush_when_idle(self, every_s: float) -> None:
        # Calls finished while the program is idle (no next call to trigger a flush)
        # still reach the writer within about every_s: a SIGKILL loses no older call.
        unpin()  # this thread only: off the core an engine pinned its compute to
        while not self._stop.wait(every_s):
            if self._parts is not None and self._parts.due():
                # A part ends only on the recorded thread (its snapshot must fall between two
                # calls): leave the batch to it, which flushes it within flush_s of its next row.
                continue
            with self._lock:
                # Only once the recorded thread went quiet (half a period without a row): while
                # it makes calls it hands its batch over itself, before a state-changing call
                # (which the reads and empty group after it fold into). Never a batch older
                # than a few periods.
                batch = self._engine.take_if_idle(every_s / 2, 5 * every_s)
                if batch is not None:
                    self._deliver(batch, idle=True)

    def _failed(self, exc: BaseException) -> None:
        log.error("kvreplay recorder failed; recording disabled", exc_info=exc)
        # Whatever was captured and not yet handed over is gone, and nothing more will be.
        self._stopped_by = GapRecord(self._last_delivered + 1, -1, -1,
                                     f"the recorder stopped: {type(exc).__name__}: {exc}", "", time.time_ns())

    def _stop_capture(self) -> None:
        """Restore the instance's methods and stop the idle flusher."""
        if self._patched:
            self._engine.active = False
            for obj, name in self._patched:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            self._patched = []
        _open.discard(self)
        self._stop.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()

    def close(self) -> Path:
        """Stop recording, restore the instance's methods, flush and finish the file."""
        self._stop_capture()
        self._deliver(self._engine.take())  # with whatever the idle flusher held
        if self._gap is not None:
            self._writer.submit(self._gap)
        if self._stopped_by is not None:
            self._writer.submit(self._stopped_by)
        return self._writer.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Checkpointer:
    """Counts top-level calls and, every ``every`` of them (at the first moment outside
    a free group), has the recording write a checkpoint. It keeps an invariant checker
    on the recorded pool, fed as a replay feeds its own, because a checkpoint must
    carry what the checker knows (which tokens the caller holds) for a replay started
    there to check exactly as one from the start. That costs the checker's time per
    call, so checkpoints are asked for, not on by default."""

    def __init__(self, rec: Recording, every: int) -> None:
        from kvreplay.check.pool_view import view_of

        self.rec, self.every = rec, every
        fam = family_of_pool(rec.pool)
        view = view_of(rec.pool, fam)
        view.sub_available()  # binds the counter reads now, before the pool's methods are recorded
        # the family's own checker, by its record: a checkpoint keeps the state a replay's would have
        self.checker = load(family(fam).checker)(view, full_check_every=0, keep=0)
        self.depth = 0
        self.calls = 0
        self.due = False
        self.broken = False

    def wrap(self, fn: Callable[..., Any], name: str, params: tuple[str, ...]) -> Callable[..., Any]:
        if name in self.rec._reads:  # numbered like every top-level call, but nothing to check
            def counted(*a: Any, **k: Any) -> Any:
                if self.depth:
                    return fn(*a, **k)
                try:
                    return fn(*a, **k)
                finally:
                    self._done()
            return counted

        def checked(*a: Any, **k: Any) -> Any:
            if self.depth or self.broken:
                if not self.depth:
                    self.calls += 1
                return fn(*a, **k)
            args = {**dict(zip(params, a, strict=False)), **k}
            pre = self._safely(self.checker.before, name, args)
            self.depth += 1
            try:
                result = fn(*a, **k)
            except BaseException:
                self.depth -= 1
                self._safely(self.checker.after, self.calls + 1, name, args, None, True, pre, None)
                self._done()
                raise
            self.depth -= 1
            self._safely(self.checker.after, self.calls + 1, name, args, result, False, pre, None)
            self._done()
            return result
        return checked

    def _safely(self, step: Callable[..., Any], *args: Any) -> Any:
        """The recorded program never pays for the checker's trouble: checkpoints stop."""
        if self.broken:
            return None
        try:
            return step(*args)
        except Exception as exc:
            self.broken = True
            log.warning("kvreplay recorder: checkpoints stop (the checker could not follow: %s)", exc)
            return None

    def _done(self) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            self.due = True
        if self.due and not self.broken and not self.checker.in_group:
            self.due = False
            try:
                state = json.dumps(self.checker.state())
            except ValueError:  # something pending: the next call outside a group takes it
                self.due = True
                return
            self.rec._checkpoint(self.calls, state)


def _state_json(captured: dict[str, dict[str, Any]]) -> str:
    return json.dumps(pool_snapshot.encode(captured))


def is_fresh(pool: Any) -> bool:
    """Is the pool's state that of a new one built from the same arguments? (Then a
    trace needs no snapshot: replay builds the same.) Unknown classes count as used."""
    from kvreplay.builds.resolve import Build

    try:
        fresh = Build("", family_of_pool(pool), type(pool)).construct(ctor_args_of_pool(pool),
                                                                     device=getattr(pool, "device", "cpu"))
    except Exception:  # a class whose constructor is not the family's: snapshot to be safe
        return False
    return pool_snapshot.take(fresh) == pool_snapshot.take(pool)


def _open_writer(kind: str, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int,
                 max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS,
                 rotation: Rotation | None = None) -> TraceWriter | ProcessTraceWriter:
    """``process`` (default): a child process writes the file; ``thread``: a thread
    of this process does (no child, but it competes with the program for the GIL)."""
    if kind == "process":
        try:
            return ProcessTraceWriter(path, meta, rows_per_group, max_queued_rows, rotation)
        except OSError as exc:  # no usable interpreter to start (an embedded Python)
            log.warning("kvreplay: cannot start the writer process (%s); writing from a thread", exc)
    elif kind != "thread":
        raise ValueError(f"unknown trace writer {kind!r}: use 'process' or 'thread'")
    return TraceWriter(path, meta, rows_per_group, max_queued_rows, rotation)


def record(pool: Any, path: str | os.PathLike[str], **kwargs: Any) -> Recording:
    """Start recording ``pool`` into the Parquet trace ``path``."""
    return Recording(pool, path, **kwargs)


@atexit.register
def close_all() -> None:
    """Finish every open recording of this process (also run at interpreter exit)."""
    for rec in list(_open):
        try:
            rec.close()
        except WriterFailed as exc:  # a full disk, a killed writer: said in one line, the program goes on
            log.error("kvreplay: could not finish trace %s: %s", getattr(rec._writer, "path", "in memory"), exc)
        except Exception:
            log.exception("kvreplay: could not finish trace %s", getattr(rec._writer, "path", "in memory"))
