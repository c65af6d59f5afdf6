"""The call-capture engines behind a recording: native (C) when built, else Python.

Both keep the stack of calls in progress, put arguments when a call starts and the
rest of the row when it returns, read the pool's counters after top-level calls
outside free groups, and hand full batches to the recording. They write identical
rows (a test records one workload with each and compares the files); the native one
exists because the interpreter work per call is most of the recorder's overhead.

``KVREPLAY_RECORDER=python`` forces the Python engine."""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch

from kvreplay.recorder import layout, tensor_shim
from kvreplay.recorder.layout import (
    FINISH_CALL,
    FINISH_GROUP_BEGIN,
    FINISH_GROUP_END,
    FINISH_READ,
    FOLD_MAX,
    GROUP_CLOSED,
    GROUP_NESTED_MAX,
    GROUP_OPENED,
    GROUP_TARGET_BITS,
    K_NONE,
    ROW_BOUNDS,
    ROW_BOUNDS_TARGETS,
    ROW_FOLD_COUNT,
    ROW_FOLD_PATTERN,
    ROW_GROUP_AT,
    ROW_GROUP_TARGETS,
    ROW_WIDTH,
    VALUE_WIDTH,
)
from kvreplay.recorder.py_buffers import Names, RowBatch, encode
from kvreplay.recorder.raw_batch import NULL, RawBatch, RawValues

try:
    from kvreplay.recorder import _capture  # type: ignore[attr-defined]

    # A module built from another layout would write rows this version misreads.
    if _capture.LAYOUT != dict((name, int(value)) for name, value in layout.c_macros()):
        raise ImportError("kvreplay.recorder._capture was built from another layout.py; reinstall kvreplay")
    _capture.set_tensor_type(torch.Tensor)
except (ImportError, AttributeError):  # not built (a source checkout without a compiler), or stale
    _capture = None
# torch's C shim reads tensors ~30x faster than Python; off when it cannot be verified.
TENSOR_SHIM = _capture is not None and tensor_shim.install(_capture)

_NO_COUNTERS = (NULL, NULL, NULL)

Counters = tuple[Callable[[], int] | None, Callable[[], int] | None, Callable[[], int] | None]


def native_available() -> bool:
    return _capture is not None


def default_backend() -> str:
    """KVREPLAY_RECORDER's engine (BadInput for another word, or for native where it is
    not built), else native where it is built."""
    from kvreplay.errors import BadInput
    from kvreplay.limits import recorder_backend

    want = recorder_backend()
    if want == "native" and _capture is None:
        raise BadInput("KVREPLAY_RECORDER=native: the native recorder is not built here "
                       "(reinstall kvreplay with a C compiler, or use python)")
    return want or ("native" if _capture is not None else "python")


class Engine:
    """A capture engine plus the way to get a ``RowBatch`` out of it."""

    def __init__(self, backend: str, names: Names, counters: Counters, flush: Callable[[], None],
                 flush_rows: int, fail: Callable[[BaseException], None], *, flush_ns: int = 0,
                 raised: Callable[[], None] | None = None, counters_every: int = 1, fold_reads: bool = True) -> None:
        if backend == "native" and _capture is None:
            raise RuntimeError("the native recorder is not built; reinstall kvreplay with a C compiler")
        self.backend = backend
        self.names = names
        # The element code of a dtype is its position in Names.int_dtypes (int64 first, bool last).
        kwargs = dict(dtypes={d: (i, code) for code, (d, i) in enumerate(names.int_dtypes.items())},
                      cpu_id=names.device(torch.device("cpu")), name_ids=names.ids, name_id=names.id,
                      slow_put=lambda v: encode(v, names), counters=counters, flush=flush,
                      flush_rows=flush_rows, fail=fail, flush_ns=flush_ns, raised=raised,
                      counters_every=counters_every, fold_reads=fold_reads)
        self.impl: Any = _capture.Capture(**kwargs) if backend == "native" else PyCapture(**kwargs)

    def wrap(self, fn: Callable[..., Any], target: int, method: int, params: tuple[int, ...], finish: int,
             name: str, slot: int = -1) -> Callable[..., Any]:
        """``slot``: for a top-level counter read, which counter (0..2): such reads fold."""
        return self.impl.wrap(fn, target, method, params, finish, name, slot)

    @property
    def active(self) -> bool:
        return bool(self.impl.active)

    @active.setter
    def active(self, value: bool) -> None:
        self.impl.active = value

    @property
    def next_seq(self) -> int:
        return int(self.impl.next_seq)

    def take(self) -> RawBatch:
        """Everything captured since the last take, for the writer."""
        return self._raw(self.impl.take())

    def take_if_idle(self, quiet_s: float = 0.0, max_age_s: float = 0.0) -> RawBatch | None:
        """``take()`` from another thread: only between top-level calls, once the recorded
        thread has made no row for ``quiet_s`` (or the batch is ``max_age_s`` old), else None."""
        got = self.impl.take_if_idle(int(quiet_s * 1e9), int(max_age_s * 1e9))
        return None if got is None else self._raw(got)

    def _raw(self, got: Any) -> RawBatch:
        if self.backend != "native":
            return got.raw()
        rows, arg_count, args, result, excs = got  # the native engine's buffers, as bytes
        return RawBatch(rows, arg_count, RawValues(*args), RawValues(*result), excs, list(self.names.strings))

    @property
    def in_group(self) -> bool:
        return bool(self.impl.in_group)

    def reset(self) -> None:
        self.impl.reset()


def _packed(targets: list[int]) -> int:
    """Nested calls' target ids packed as layout.py says, or -1 when they do not fit."""
    if len(targets) > GROUP_NESTED_MAX:
        return -1
    packed = 0
    for t in reversed(targets):
        if t + 1 >= 1 << GROUP_TARGET_BITS:
            return -1
        packed = (packed << GROUP_TARGET_BITS) | (t + 1)
    return packed


def _plain(rows: Any, at: int) -> bool:
    """The row at ``at`` raised nothing and holds no fold of any kind."""
    return (rows[at + 7] < 0 and not rows[at + ROW_FOLD_COUNT] and rows[at + ROW_GROUP_AT] < 0
            and not rows[at + ROW_BOUNDS])


def _none_answers(result_head: Any, start: int, count: int) -> bool:
    return all(result_head[start + k * VALUE_WIDTH] == K_NONE for k in range(count))


def empty_group_targets(rows: Any, start: int, arg_count: Any, args_from: int, result_head: Any, results_from: int,
                        begin_mid: int, end_mid: int) -> int:
    """The packed targets (layout.py) of an empty free group's nested calls, read from
    the rows its begin and end put since ``start`` (the end's own row not yet put); -1
    when those rows are not exactly one begin, its nested begins, then the end's nested
    ends, every one without arguments, exception, fold or answer."""
    if any(arg_count[args_from:]) or any(result_head[k] != K_NONE
                                         for k in range(results_from, len(result_head), VALUE_WIDTH)):
        return -1
    before: list[int] = []
    after: list[int] = []
    top = False
    for at in range(start, len(rows), ROW_WIDTH):
        depth, target, method = rows[at + 2], rows[at + 3], rows[at + 4]
        if not _plain(rows, at):
            return -1
        if depth == 0:
            if top or method != begin_mid:
                return -1
            top = True
        elif depth == 1 and method == (end_mid if top else begin_mid):
            (after if top else before).append(target)
        else:
            return -1
    if not top or before != after:
        return -1
    return _packed(before)


def opened_group(rows: Any, start: int, arg_count: Any, args_from: int, result_head: Any, results_from: int,
                 begin_mid: int) -> tuple[int, int]:
    """(nested begins, their packed targets) of the free group begun at ``start`` when
    the call finishing now (its row not yet put) is the first in it: the rows since are
    the begin's nested begins, the begin, then only rows nested in that call, and the
    begin and its nested begins took no argument and answered None. (-1, -1) otherwise."""
    before: list[int] = []
    at, n = start, len(rows)
    while at < n and rows[at + 2] == 1 and rows[at + 4] == begin_mid and _plain(rows, at):
        before.append(rows[at + 3])
        at += ROW_WIDTH
    if at >= n or rows[at + 2] != 0 or rows[at + 4] != begin_mid or not _plain(rows, at):
        return -1, -1
    if any(rows[r + 2] == 0 for r in range(at + ROW_WIDTH, n, ROW_WIDTH)):
        return -1, -1
    k = len(before)
    if (len(arg_count) - args_from < k + 1 or any(arg_count[args_from:args_from + k + 1])
            or len(result_head) - results_from < (k + 1) * VALUE_WIDTH
            or not _none_answers(result_head, results_from, k + 1)):
        return -1, -1
    packed = _packed(before)
    return (k, packed) if packed >= 0 else (-1, -1)


def closed_group(rows: Any, anchor: int, arg_count: Any, result_head: Any, begin_mid: int,
                 end_mid: int) -> tuple[int, int]:
    """(nested ends, their packed targets) of the free group ending now (its row not yet
    put) right after the top-level call at ``anchor``, a call in the group: the rows
    after that call's are only the end's nested ends, the call folds nothing yet, and the
    end and its nested ends took no argument and answered None. (-1, -1) otherwise."""
    if (anchor < 0 or rows[anchor + 4] == begin_mid or rows[anchor + 7] >= 0 or rows[anchor + ROW_FOLD_COUNT]
            or rows[anchor + ROW_GROUP_AT] >= 0 or rows[anchor + ROW_BOUNDS] & GROUP_CLOSED):
        return -1, -1
    after: list[int] = []
    for at in range(anchor + ROW_WIDTH, len(rows), ROW_WIDTH):
        if rows[at + 2] != 1 or rows[at + 4] != end_mid or not _plain(rows, at):
            return -1, -1
        after.append(rows[at + 3])
    k = len(after)
    if (len(arg_count) < k + 1 or any(arg_count[len(arg_count) - k - 1:])
            or not _none_answers(result_head, len(result_head) - k * VALUE_WIDTH, k)):
        return -1, -1
    packed = _packed(after)
    if packed < 0 or (rows[anchor + ROW_BOUNDS] & GROUP_OPENED and rows[anchor + ROW_BOUNDS_TARGETS] != packed):
        return -1, -1  # one row holds one set of bound targets
    return k, packed


class PyCapture:
    """The Python engine: same constructor, same rows as the native ``Capture``."""

    def __init__(self, *, dtypes: dict[Any, tuple[int, int]], cpu_id: int, name_ids: dict[str, int],
                 name_id: Callable[[str], int], slow_put: Callable[[Any], Any], counters: Counters | None,
                 flush: Callable[[], None], flush_rows: int, fail: Callable[[BaseException], None],
                 flush_ns: int = 0, raised: Callable[[], None] | None = None, counters_every: int = 1,
                 fold_reads: bool = True) -> None:
        self.fold_reads = fold_reads
        self.names: Names = name_id.__self__  # type: ignore[attr-defined]
        self.counters_every = counters_every
        self.counter_tick = 0
        self.batch = RowBatch(self.names)
        self.counters = counters
        self.flush = flush
        self.flush_at = flush_rows * ROW_WIDTH
        self.flush_ns = flush_ns
        self.raised = raised
        self.batch_t0 = 0
        self.last_t1 = 0
        self.fail_cb = fail
        self.targets: list[int] = []  # targets of the calls in progress, innermost last
        self.seqs: list[int] = []
        self.next_seq = 0
        self.in_group = False
        self.active = True
        # Folding counter reads, as the native engine does (layout.py): what the counters
        # were last seen to be since the state last changed, the row folds go into (its
        # index in the batch's rows, -1: none) and that row's pattern so far.
        self.cur: list[int | None] = [None, None, None]
        self.anchor = -1
        self.pat: list[int] = []
        self.cycling = False
        # An empty free group folds too: where the buffers stood before its begin, the
        # row it would fold into (-1: none), and what was known of the counters then;
        # None once a call was made in the group. A group's bounds fold into its first
        # and last calls: the begin's method id tells the last call from the begin.
        self.group: tuple[tuple[int, ...], int, list[int | None], int] | None = None
        self.group_mid = -1
        self.busy = threading.Lock()  # held by the recorded thread for the length of a top-level call

    def take(self) -> RowBatch:
        b, self.batch = self.batch, RowBatch(self.names)
        self._forget()  # a batch stands alone: nothing after it folds into it or leans on it
        return b

    def _forget(self) -> None:
        self.anchor = -1
        self.cur = [None, None, None]
        self.group = None
        self.group_mid = -1

    def _group_begins(self, mid: int) -> None:
        """A top-level free group begins with no arguments: mark where, for its folds."""
        rows = self.batch.rows
        anchor = self.anchor if self.anchor >= 0 and rows[self.anchor + ROW_GROUP_AT] < 0 else -1
        self.group = (self.batch.mark(), anchor, list(self.cur), mid) if self.fold_reads else None
        self.group_mid = mid if self.fold_reads else -1

    def _fold_group(self, end_mid: int) -> bool:
        """The free group ending now (its end returned None, had no arguments) folds into
        the row before its begin when nothing happened in it: no call of the program's
        between begin and end, and on the sub-allocators the same empty pair."""
        if self.group is None or self.group[1] < 0:
            return False
        mark, anchor, cur, begin_mid = self.group
        self.group = None
        b = self.batch
        targets = empty_group_targets(b.rows, mark[0], b.arg_count, mark[1], b.result.head, mark[6], begin_mid,
                                      end_mid)
        if targets < 0:
            return False
        b.rewind(mark)
        b.rows[anchor + ROW_GROUP_AT] = b.rows[anchor + ROW_FOLD_COUNT]
        b.rows[anchor + ROW_GROUP_TARGETS] = targets
        self.anchor, self.cur, self.in_group = anchor, cur, False
        if self.counters_every > 0:
            self._counter_due()  # it counts as its row would have (its counters: those known before it)
        return True

    def _open_group(self) -> int:
        """The call finishing now is the first in a free group (its row not yet put):
        the group's begin rows go when they may fold into its row. Its packed targets, or -1."""
        mark, _, _, begin_mid = self.group  # type: ignore[misc]
        self.group = None
        b = self.batch
        k, packed = opened_group(b.rows, mark[0], b.arg_count, mark[1], b.result.head, mark[6], begin_mid)
        if k < 0:
            return -1
        del b.rows[mark[0]:mark[0] + (k + 1) * ROW_WIDTH]
        del b.arg_count[mark[1]:mark[1] + k + 1]
        del b.result.head[mark[6]:mark[6] + (k + 1) * VALUE_WIDTH]
        return packed

    def _close_group(self, end_mid: int) -> bool:
        """The free group ending now (its end returned None, had no arguments) folds into
        the row of the last call in it when nothing came between: the end's counters,
        read as its row would have read them, go into that row."""
        if not self.in_group or self.group_mid < 0:
            return False
        b, a = self.batch, self.anchor
        k, packed = closed_group(b.rows, a, b.arg_count, b.result.head, self.group_mid, end_mid)
        if k < 0:
            return False
        del b.rows[len(b.rows) - k * ROW_WIDTH:]
        del b.arg_count[len(b.arg_count) - k - 1:]
        del b.result.head[len(b.result.head) - k * VALUE_WIDTH:]
        self.in_group, self.group, self.group_mid = False, None, -1
        counters = self._read_counters() if self.counters_every > 0 and self._counter_due() else _NO_COUNTERS
        b.rows[a + 8:a + 11] = array("q", counters)
        b.rows[a + ROW_BOUNDS] |= GROUP_CLOSED
        b.rows[a + ROW_BOUNDS_TARGETS] = packed
        self.last_t1 = time.time_ns()
        self._learn(-1, None, None, counters)
        return True

    def _read_counters(self) -> tuple[int, int, int]:
        # Counter methods call each other; none of that is the program's call.
        self.active = False
        try:
            return tuple(NULL if f is None else int(f()) for f in self.counters)  # type: ignore[return-value,union-attr]
        finally:
            self.active = True

    def _fold(self, slot: int) -> bool:
        rows = self.batch.rows
        at = self.anchor + ROW_FOLD_COUNT
        n = rows[at]
        if n == 0:
            self.pat, self.cycling = [], False
        pat = self.pat
        if self.cycling:
            if pat[n % len(pat)] != slot:
                return False
        elif pat and pat[0] == slot:
            self.cycling = True
        else:
            if slot in pat or len(pat) == FOLD_MAX:
                return False
            pat.append(slot)
            packed = 0
            for k in reversed(pat):
                packed = packed * 4 + k + 1
            rows[self.anchor + ROW_FOLD_PATTERN] = packed
        rows[at] = n + 1
        return True

    def _learn(self, slot: int, result: Any, exc: BaseException | None, counters: tuple[int, int, int]) -> None:
        if slot >= 0 and exc is None and type(result) is int and -(2**63) <= result < 2**63:
            self.cur[slot] = result
        else:
            self.cur = [None if v == NULL else v for v in counters]

    def take_if_idle(self, quiet_ns: int = 0, max_age_ns: int = 0) -> RowBatch | None:
        if not self.busy.acquire(blocking=False):
            return None
        try:
            if not len(self.batch):
                return None
            now = time.time_ns()
            if now - self.last_t1 < quiet_ns and not (max_age_ns and now - self.batch_t0 >= max_age_ns):
                return None
            return self.take()
        finally:
            self.busy.release()

    def _flush_if_old(self, finish: int) -> None:
        """The native engine's flush_if_old: an old batch goes before a state-changing
        top-level call, so what folds into that call's row finds it in the same batch."""
        if not self.flush_ns or not self.batch.rows or self.in_group or finish not in (FINISH_CALL, FINISH_GROUP_BEGIN):
            return
        # a group's begin may fold into the row before it: it goes first only when much older
        if time.time_ns() - self.batch_t0 >= self.flush_ns * (5 if finish == FINISH_GROUP_BEGIN else 1):
            self.flush()

    def reset(self) -> None:
        self.batch = RowBatch(self.names)  # a half-appended row would misalign the columns
        self._forget()

    def _fail(self, exc: BaseException) -> None:
        was = self.active
        self.active = False
        self.reset()
        if was:
            self.fail_cb(exc)

    def wrap(self, fn: Callable[..., Any], tid: int, mid: int, pids: tuple[int, ...], finish: int,
             name: str, slot: int = -1) -> Callable[..., Any]:
        cap = self
        targets, seqs = self.targets, self.seqs
        time_ns = time.time_ns
        end = self._end

        busy = self.busy

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if not cap.active or (targets and targets[-1] == tid):
                return fn(*args, **kwargs)
            if targets:
                return record_call(args, kwargs)
            with busy:  # a top-level call: take_if_idle from another thread waits it out
                if cap.flush_ns:
                    try:
                        cap._flush_if_old(finish)
                    except Exception as exc:  # never break the recorded program
                        cap._fail(exc)
                        return fn(*args, **kwargs)
                return record_call(args, kwargs)

        def record_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            seq = cap.next_seq
            cap.next_seq = seq + 1
            parent = seqs[-1] if seqs else -1
            # A top-level counter read may fold (layout.py): no row if its value is no news.
            may_fold = (slot >= 0 and cap.fold_reads and not seqs and not args and not kwargs and cap.anchor >= 0
                        and cap.cur[slot] is not None)
            if finish == FINISH_GROUP_BEGIN and not seqs:
                if args or kwargs:
                    cap.group, cap.group_mid = None, -1
                else:
                    cap._group_begins(mid)
            try:
                if len(args) > len(pids):
                    names = cap.names
                    ids = pids + tuple(names.id(f"arg{i}") for i in range(len(pids), len(args)))
                else:
                    ids = pids
                cap.batch.begin(args, ids, kwargs)
            except Exception as exc:
                cap._fail(exc)
                return fn(*args, **kwargs)
            targets.append(tid)
            seqs.append(seq)
            t0 = time_ns()
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                targets.pop()
                seqs.pop()
                end(finish, seq, parent, tid, mid, t0, None, exc, slot)
                raise
            targets.pop()
            seqs.pop()
            if (may_fold and cap.active and type(result) is int and cap.anchor >= 0 and result == cap.cur[slot]
                    and cap.next_seq == seq + 1 and cap._fold(slot)):
                cap.batch.arg_count.pop()  # its (empty) arguments were put: a folded read has none
                return result
            if (finish == FINISH_GROUP_END and result is None and not seqs and not args and not kwargs and cap.active
                    and (cap._fold_group(mid) or cap._close_group(mid))):
                return result
            end(finish, seq, parent, tid, mid, t0, result, None, slot)
            return result

        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        recorded.__name__ = name
        return recorded

    def _counter_due(self) -> bool:
        self.counter_tick += 1
        if self.counter_tick < self.counters_every:
            return False
        self.counter_tick = 0
        return self.counters is not None

    def _end(self, finish: int, seq: int, parent: int, tid: int, mid: int, t0: int, result: Any,
             exc: BaseException | None, slot: int = -1) -> None:
        if not self.active:
            return  # disabled while this call was in progress
        try:
            t1 = time.time_ns()
            depth = len(self.seqs)
            if not depth and finish >= FINISH_GROUP_BEGIN:
                self.in_group = finish == FINISH_GROUP_BEGIN and exc is None
                if finish == FINISH_GROUP_END:
                    self.group, self.group_mid = None, -1
            counters = _NO_COUNTERS
            if (not depth and not self.in_group and finish != FINISH_READ and self.counters_every > 0
                    and self._counter_due()):
                counters = self._read_counters()
            opened = -1
            if not depth and self.in_group and finish < FINISH_GROUP_BEGIN and self.group is not None:
                opened = self._open_group() if exc is None else -1
                self.group = None
            b = self.batch
            if not b.rows:
                self.batch_t0 = t1
            b.add(seq, parent, depth, tid, mid, t0, t1, result, exc, counters)
            if depth:
                return
            if opened >= 0:
                b.rows[len(b.rows) - ROW_WIDTH + ROW_BOUNDS] = GROUP_OPENED
                b.rows[len(b.rows) - ROW_WIDTH + ROW_BOUNDS_TARGETS] = opened
            self.anchor = len(b.rows) - ROW_WIDTH
            self.last_t1 = t1
            self._learn(slot, result, exc, counters)
            if exc is not None and self.raised is not None:
                self.raised()
            elif len(b.rows) >= self.flush_at:
                self.flush()
        except Exception as err:  # never break the recorded program
            self._fail(err)
