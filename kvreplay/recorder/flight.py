"""Flight-recorder mode: keep the last calls in memory, write them out only when
something goes wrong.

A day of decode traffic is too much to record; the minutes before a crash are what
a pool engineer needs. A ``FlightRecorder`` captures every call like a recording
does, but keeps captured batches in memory, cut into segments that each start with
a snapshot of the pool (``snapshot.capture``: device-side copies, no host sync). It
keeps the fewest segments that still hold the last ``calls`` top-level calls, so
memory stays bounded by about ``calls + snapshot_every`` calls.

``dump()`` writes the oldest kept segment's snapshot as the trace's
``initial_state`` and every call since, so the dump replays from its snapshot. It
happens by itself when a top-level allocator call raises (the dump ends with that
call), on a signal (``SIGUSR2`` by default), or on demand."""

from __future__ import annotations

import itertools
import os
import signal as signals
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvreplay.recorder.raw_batch import RawBatch
from kvreplay.recorder.recording import Recording, is_fresh, log
from kvreplay.recorder.writer import ParquetSink, rows_of
from kvreplay.trace import snapshot as pool_snapshot

_dumps = itertools.count()


@dataclass
class Segment:
    state: dict[str, Any] | None  # capture() at its start; None: the pool as built
    batches: list[RawBatch] = field(default_factory=list)
    calls: int = 0  # top-level calls


def top_level_calls(batch: RawBatch) -> int:
    _, depth, folded = rows_of(batch)  # top-level rows, and the calls folded into them
    return int((depth == 0).sum()) + int(folded.sum())


class FlightRecorder(Recording):
    """Records ``pool`` into memory; see the module docstring. ``dump_dir`` is where
    automatic dumps go (``kvreplay-flight-PID-N.parquet``)."""

    def __init__(self, pool: Any, dump_dir: str | os.PathLike[str], *, calls: int = 100_000,
                 snapshot_every: int | None = None, on_raise: bool = True,
                 signal: int | None = signals.SIGUSR2, **kwargs: Any) -> None:
        if calls < 1:
            raise ValueError("calls must be at least 1")
        self.dump_dir = Path(dump_dir)
        self.keep_calls = calls
        self.snapshot_every = snapshot_every or max(1, calls // 4)
        self.on_raise = on_raise
        self.dumps: list[Path] = []
        self._dump_threads: list[threading.Thread] = []
        self._segments: deque[Segment] = deque([Segment(None if is_fresh(pool) else pool_snapshot.capture(pool))])
        self._kept_calls = 0
        # Snapshots fall on batch boundaries: batches well under a snapshot interval.
        kwargs.setdefault("rows_per_batch", max(32, min(1024, self.snapshot_every // 2)))
        super().__init__(pool, None, snapshot=False, **kwargs)
        self._previous_handler: Any = None
        self._signal = signal
        if signal is not None:
            try:
                self._previous_handler = signals.signal(signal, self._on_signal)
            except ValueError:  # not the main thread: dumps on demand and on raise only
                self._signal = None

    def _deliver(self, batch: RawBatch, idle: bool = False) -> None:
        n = top_level_calls(batch)
        current = self._segments[-1]
        current.batches.append(batch)
        current.calls += n
        self._kept_calls += n
        # Not from the idle flusher: the recorded thread may have gone on since its batch
        # was taken, and the snapshot would be of a later state than the segment's start.
        if current.calls >= self.snapshot_every and not idle:
            self._segments.append(Segment(pool_snapshot.capture(self.pool)))
        while len(self._segments) > 1 and self._kept_calls - self._segments[0].calls >= self.keep_calls:
            self._kept_calls -= self._segments.popleft().calls

    def _raised(self) -> None:
        self._flush()
        if self.on_raise:
            self._dump_safely("exception")

    def _on_signal(self, signum: int, frame: Any) -> None:
        prev = self._previous_handler
        if self.calls_recorded == 0:  # an allocator that was never called has nothing to dump
            if callable(prev):
                prev(signum, frame)
            return
        # The handler may run while this thread holds the lock (mid-flush): dump from
        # another thread, which waits for it.
        t = threading.Thread(target=self._dump_safely, args=(f"signal {signum}",), name="kvreplay-flight-dump")
        self._dump_threads.append(t)
        t.start()
        if callable(prev):
            prev(signum, frame)

    def _dump_safely(self, reason: str) -> None:
        try:
            self.dump(reason=reason)
        except OSError as exc:  # a full disk, an out directory gone: one line, the program's own error matters
            log.error("kvreplay flight recorder: dump failed: %s", " ".join(str(exc).split()))
        except Exception:  # the program's own failure matters more than the dump
            log.exception("kvreplay flight recorder: dump failed")

    @property
    def calls_kept(self) -> int:
        return self._kept_calls

    def dump(self, path: str | os.PathLike[str] | None = None, *, reason: str = "on demand") -> Path:
        """Write the kept calls, from the oldest kept snapshot on, as a trace."""
        with self._lock:
            pending = self._engine.take_if_idle()  # not mid-call: a call's rows stay together
            if pending is not None:
                self._deliver(pending)
            first = self._segments[0]
            batches = [b for seg in self._segments for b in seg.batches]
            calls = self._kept_calls
            state = pool_snapshot.encode(first.state) if first.state is not None else None
        name = f"kvreplay-flight-{os.getpid()}-{next(_dumps)}.parquet"
        out = Path(path) if path is not None else self.dump_dir / name
        meta = replace(self.meta, initial_state=state,
                       extra={**self.meta.extra, "flight": {"reason": reason, "calls": calls,
                                                            "keep_calls": self.keep_calls}})
        sink = ParquetSink(out, meta)
        try:
            for b in batches:
                sink.add(b)
            sink.finish()
        except BaseException:
            sink.abort()
            raise
        self.dumps.append(out)
        return out

    def close(self) -> Path:  # type: ignore[override]
        """Stop recording (nothing is written); returns the dump directory."""
        if self._signal is not None:
            try:
                signals.signal(self._signal, self._previous_handler or signals.SIG_DFL)
            except ValueError:
                pass
            self._signal = None
        self._stop_capture()
        for t in self._dump_threads:
            t.join()
        return self.dump_dir


def flight_recorder(pool: Any, dump_dir: str | os.PathLike[str], **kwargs: Any) -> FlightRecorder:
    """Start a flight recorder on ``pool``; see ``FlightRecorder``."""
    return FlightRecorder(pool, dump_dir, **kwargs)


__all__ = ["FlightRecorder", "Segment", "flight_recorder", "top_level_calls"]
