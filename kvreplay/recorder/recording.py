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
import inspect
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvreplay
from kvreplay.recorder.row_batch import NULL, ROW_WIDTH, Names, RowBatch
from kvreplay.recorder.trace_format import TraceMeta
from kvreplay.recorder.writer import TraceWriter

log = logging.getLogger("kvreplay.recorder")

# State-changing calls and counter reads of the allocator API (DESIGN.md).
RECORDED_METHODS = (
    "alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail",
    "free", "free_page_ids", "free_segment", "free_segments", "free_full",
    "free_full_segment", "free_full_segments", "free_swa", "free_swa_segment",
    "free_group_begin", "free_group_end", "merge_and_sort_free", "clear",
    "set_full_to_swa_mapping", "clear_full_to_swa_mapping",
    "available_size", "full_available_size", "swa_available_size",
)
COUNTER_METHODS = frozenset({"available_size", "full_available_size", "swa_available_size"})
SUB_POOLS = (("full", "full_attn_allocator"), ("swa", "swa_attn_allocator"))
_GROUP_TOGGLES = frozenset({"free_group_begin", "free_group_end"})
_NO_COUNTERS = (NULL, NULL, NULL)

_open: weakref.WeakSet[Recording] = weakref.WeakSet()


def pool_class_name(pool: Any) -> str:
    cls = type(pool)
    return f"{cls.__module__}:{cls.__qualname__}"


def _source_version(pool: Any) -> dict[str, str]:
    out = {"kvreplay": kvreplay.__version__, "torch": torch.__version__}
    top = type(pool).__module__.split(".")[0]
    mod = __import__(top)
    ver = getattr(mod, "__version__", None)
    if ver and top != "kvreplay":
        out[top] = str(ver)
    return out


class Recording:
    """An active recording of one allocator instance; ``close()`` finishes the file."""

    def __init__(
        self,
        pool: Any,
        path: str | os.PathLike[str],
        *,
        rank: str = "",
        extra: dict[str, Any] | None = None,
        rows_per_group: int = 65536,
        rows_per_batch: int = 4096,
    ) -> None:
        from kvreplay.replayer.builds import ctor_args_of_pool, family_of_pool

        self.pool = pool
        self.meta = TraceMeta(
            pool_class=pool_class_name(pool),
            family=family_of_pool(pool),
            ctor_args=ctor_args_of_pool(pool),
            source_version=_source_version(pool),
            host=socket.gethostname(),
            pid=os.getpid(),
            rank=rank,
            start_time=_dt.datetime.now(_dt.timezone.utc).isoformat(),
            extra=dict(extra or {}),
        )
        self._writer = TraceWriter(path, self.meta, rows_per_group=rows_per_group)
        self._flush_at = rows_per_batch * ROW_WIDTH
        self._names = Names()
        self._begin_id = self._names.id("free_group_begin")
        self._batch = RowBatch(self._names)
        self._targets: list[str] = []  # targets of the calls in progress, innermost last
        self._seqs: list[int] = []
        self._next_seq = 0
        self._in_group = False
        self._active = True
        self._patched: list[tuple[Any, str]] = []
        self._read_counters = self._counter_reader(pool)
        self._patch(pool, "root")
        for target, attr in SUB_POOLS:
            sub = getattr(pool, attr, None)
            if sub is not None and sub is not pool:
                self._patch(sub, target)
        _open.add(self)

    @property
    def calls_recorded(self) -> int:
        return self._next_seq

    @staticmethod
    def _counter_reader(pool: Any) -> Callable[[], tuple[int, int, int]]:
        # Bound before patching, so reading counters is never itself recorded.
        a, f, s = (getattr(pool, n, None) for n in ("available_size", "full_available_size", "swa_available_size"))
        if a is not None and f is not None and s is not None:
            return lambda: (a(), f(), s())
        if a is not None and f is None and s is None:
            return lambda: (a(), NULL, NULL)
        return lambda: tuple(NULL if g is None else g() for g in (a, f, s))  # type: ignore[return-value]

    def _patch(self, obj: Any, target: str) -> None:
        for name in RECORDED_METHODS:
            if target != "root" and name in COUNTER_METHODS:
                continue  # a sub-pool's counters are already in the parent row's counters
            fn = getattr(obj, name, None)
            if fn is None or not callable(fn):
                continue
            try:
                params = tuple(p for p in inspect.signature(fn).parameters if p not in ("args", "kwargs"))
            except (TypeError, ValueError):
                params = ()
            setattr(obj, name, self._wrapper(target, name, fn, params))
            self._patched.append((obj, name))

    def _wrapper(self, target: str, method: str, fn: Callable[..., Any], params: tuple[str, ...]) -> Callable[..., Any]:
        rec = self
        targets, seqs = self._targets, self._seqs
        time_ns = time.time_ns
        names = self._names
        tid, mid = names.id(target), names.id(method)
        pids = tuple(names.id(p) for p in params)
        finish = self._finish_group_toggle if method in _GROUP_TOGGLES else (
            self._finish_read if method in COUNTER_METHODS else self._finish)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if not rec._active or (targets and targets[-1] == target):
                return fn(*args, **kwargs)
            seq = rec._next_seq
            rec._next_seq = seq + 1
            parent = seqs[-1] if seqs else -1
            try:
                rec._batch.begin(args, pids if len(args) <= len(pids) else rec._arg_ids(pids, len(args)), kwargs)
            except Exception:
                rec._fail()
                return fn(*args, **kwargs)
            targets.append(target)
            seqs.append(seq)
            t0 = time_ns()
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                targets.pop()
                seqs.pop()
                finish(seq, parent, tid, mid, t0, None, exc)
                raise
            targets.pop()
            seqs.pop()
            finish(seq, parent, tid, mid, t0, result, None)
            return result

        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        recorded.__name__ = method
        return recorded

    def _arg_ids(self, pids: tuple[int, ...], n: int) -> tuple[int, ...]:
        return pids + tuple(self._names.id(f"arg{i}") for i in range(len(pids), n))

    def _finish(self, seq: int, parent: int, target: int, method: int, t0: int, result: Any,
                exc: BaseException | None) -> None:
        """End a state-changing call's row; a top-level one outside a free group gets counters."""
        if not self._active:
            return  # disabled while this call was in progress
        try:
            t1 = time.time_ns()
            counters = _NO_COUNTERS
            depth = len(self._seqs)
            if not depth and not self._in_group:
                # Counter methods call each other; none of that is the program's call.
                self._active = False
                try:
                    counters = self._read_counters()
                finally:
                    self._active = True
            b = self._batch
            b.add(seq, parent, depth, target, method, t0, t1, result, exc, counters)
            if not depth and len(b.rows) >= self._flush_at:
                self._writer.submit(b)
                self._batch = RowBatch(self._names)
        except Exception:  # never break the recorded program
            self._fail()

    def _finish_read(self, seq: int, parent: int, target: int, method: int, t0: int, result: Any,
                     exc: BaseException | None) -> None:
        """A counter read changes nothing, so its row records no counters."""
        if not self._active:
            return
        try:
            self._batch.add(seq, parent, len(self._seqs), target, method, t0, time.time_ns(), result, exc,
                            _NO_COUNTERS)
        except Exception:
            self._fail()

    def _finish_group_toggle(self, seq: int, parent: int, target: int, method: int, t0: int, result: Any,
                             exc: BaseException | None) -> None:
        if not self._seqs and self._active:
            self._in_group = method == self._begin_id and exc is None
        self._finish(seq, parent, target, method, t0, result, exc)

    def _fail(self) -> None:
        if self._active:  # log once
            log.exception("kvreplay recorder failed; recording disabled")
        self._active = False
        self._batch = RowBatch(self._names)  # a half-appended row would misalign the columns

    def close(self) -> Path:
        """Stop recording, restore the instance's methods, flush and finish the file."""
        if self._patched:
            self._active = False
            for obj, name in self._patched:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            self._patched = []
        _open.discard(self)
        if len(self._batch):
            self._writer.submit(self._batch)
            self._batch = RowBatch(self._names)
        return self._writer.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record(pool: Any, path: str | os.PathLike[str], **kwargs: Any) -> Recording:
    """Start recording ``pool`` into the Parquet trace ``path``."""
    return Recording(pool, path, **kwargs)


@atexit.register
def _close_all() -> None:
    for rec in list(_open):
        try:
            rec.close()
        except Exception:
            log.exception("kvreplay: could not finish trace %s", rec._writer.path)
