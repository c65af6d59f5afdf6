"""Watching a recording as it is written (``kvreplay record --watch``).

The trace writer's process (writer_child.py) runs this module instead when the
recorded process's environment asks for it (``KVREPLAY_WATCH``): it writes the trace
exactly as the plain writer does, and also replays each batch, as soon as it has it,
on the class that recorded it, with the invariant checker on. All of it happens in
the writer's process, off the recorded program's core: the recorded program never
waits for the checker, whatever it finds or however far behind it falls.

What the watch finds goes, one JSON line each, to ``DIR/kvreplay-watch.jsonl`` (the
trace's directory), which ``kvreplay record`` follows and prints; its counters go to
``DIR/.kvreplay-metrics-NAME.json`` about once a second, which ``kvreplay record
--metrics-port`` serves in Prometheus's text format. ``KVREPLAY_WATCH=metrics``
writes the counters without checking.

A watcher that falls behind (more than ``MAX_BEHIND`` batches waiting) stops
checking rather than hold more memory, and says how many calls it did not check; so
does one that meets a gap (calls the recorder lost) without a snapshot to go on from."""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvreplay.contract.registry import family
from kvreplay.recorder import writer_child
from kvreplay.recorder.seal import open_append, replace_file, seal
from kvreplay.recorder.switches import FINDINGS_FILE, SEAL_ENV, WATCH_ENV
from kvreplay.trace.format import GAP_METHOD, GAP_TARGET, TraceMeta

MAX_BEHIND = 262_144  # rows waiting for the checker before it gives up (the recorder's own queue bound)
HOLE = object()  # in the checker's queue: batches were left out here
REQUEST_ARGS = ("request_id", "req_id", "rid", "request")  # "request": a wire's request number


def watch_build(meta: TraceMeta) -> str:
    """The build a watch replays on: the class that is being recorded, as installed
    here (the recording process's own meta names it; no trace from elsewhere does)."""
    from kvreplay.contract.registry import engine

    top = meta.pool_class.split(":")[0].split(".")[0]
    return top if engine(top) is not None else f"py:{meta.pool_class}"


class _Live:
    """What a replayer asks of its trace, for a trace that is still being written."""

    def __init__(self, path: Path, meta: TraceMeta) -> None:
        self.path, self.source, self.meta = path, str(path), meta
        self.num_entries = 1 << 40  # no end known: the timeline's buckets stay coarse

    def check_calls(self) -> int:
        return 0

    def gaps(self) -> list[Any]:
        return []


class Watcher:
    """Checks batches as the writer gets them; ``feed`` never blocks the writer."""

    def __init__(self, path: Path, meta: TraceMeta, check: bool = True) -> None:
        self.path, self.meta, self.check = path, meta, check
        self.out = path.parent
        self.name = path.name
        self.calls = self.rows = self.dropped = self.unchecked = self.checked = 0
        self.last_t_ns = 0
        self.violations: Counter[str] = Counter()
        self.divergences: Counter[str] = Counter()
        self.reported: set[str] = set()
        self.status = "watching" if check else "metrics only"
        self._queue: queue.Queue[Any] = queue.Queue()
        self._behind = 0  # rows in the queue (bounded by MAX_BEHIND)
        self._hole = False
        self._replayer: Any = None
        self._number = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvreplay-watch", daemon=True)
        self._thread.start()
        self._last_metrics = 0.0
        self.sink: Any = None  # the writer's ParquetSink, for its parts (writer_child attaches it)
        self.key = os.environ.get(SEAL_ENV, "")  # kvreplay record reads back only what this key sealed

    # -- the writer's side ---------------------------------------------------------------

    def feed(self, table: pa.Table) -> None:
        from kvreplay.trace.reader import calls_in

        n, t_end = calls_in(table)
        with self._lock:
            self.rows += table.num_rows
            self.calls += n
            self.last_t_ns = max(self.last_t_ns, t_end)
            self.dropped += _lost(table)
        # A batch the checker has no room for is not checked, and neither is anything
        # after it until a gap's snapshot gives a state to go on from: the HOLE tells it.
        with self._lock:
            room = self._behind + table.num_rows <= MAX_BEHIND
            if room:
                self._behind += table.num_rows
        if not room:
            self._hole = True
            self._uncheck(n + _lost(table))
        else:
            if self._hole:
                self._queue.put(HOLE)
                self._hole = False
            self._queue.put(table)
        self.metrics()

    def finish(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            # The writer ends with the recording; a checker still behind it (an engine slow to
            # import on a loaded machine) leaves the rest unchecked, and says so.
            with self._lock:
                left = max(0, self.calls - self.checked - self.unchecked)
                self.unchecked += left
            self._replayer = None
            self.status = "stopped: the recording ended before the checker caught up"
            self._emit({"kind": "watch-stopped", "reason": f"the recording ended {left:,} calls before the "
                        "checker caught up", "call": self._number})
        self.metrics(force=True)

    # -- the checker's side --------------------------------------------------------------

    def _start(self, state: Any) -> None:
        from kvreplay.replay.replayers import make_replayer

        try:
            r = make_replayer(self.path, watch_build(self.meta), reader=_Live(self.path, self.meta), checked=True,
                              start=(-1, state), device="cpu")
        except Exception as exc:  # a class this environment cannot build: write on, unchecked
            self._give_up(f"cannot replay {self.meta.pool_class} here ({type(exc).__name__}: {exc})")
            return
        if r.checker is not None:
            told = r.checker.log.listener

            def listener(v: Any) -> None:
                if told is not None:
                    told(v)
                self._violation(v)
            r.checker.log.listener = listener
        self._replayer = r
        self.status = "watching"

    def _run(self) -> None:
        # Built here, not before the writer starts: importing the engine takes seconds, and
        # the writer must be reading the pipe from the first moment (crash safety).
        if self.check:
            self._start(self.meta.initial_state)
        while (table := self._queue.get()) is not None:
            if table is HOLE:
                self._give_up(f"the checker fell {MAX_BEHIND:,} rows behind the writer")
                continue
            with self._lock:
                self._behind -= table.num_rows
            try:
                self._check(table)
            except Exception as exc:
                self._give_up(f"the checker failed ({type(exc).__name__}: {exc})")

    def _check(self, table: pa.Table) -> None:
        from kvreplay.trace.reader import decoded, grouped

        r = self._replayer
        nested = r.nested_args if r is not None else False  # as the replayer's own run decodes them
        reads = family(self.meta.family).counter_reads
        for tc in grouped(decoded(table.to_batches(), self.path, nested_args=nested, reads=reads), self._number):
            c = tc.call
            if c.target == GAP_TARGET:
                if c.method == GAP_METHOD:
                    lost = max(0, int(c.args.get("lost_calls", 0) or 0))
                    self._uncheck(lost)
                    state = c.args.get("state")
                    if not state:
                        self._give_up(f"the recorder lost {lost} calls at call #{self._number + 1}, with no "
                                      "snapshot to go on from")
                    else:  # the state right after the lost calls: checking goes on from there
                        self._restart(state)
                    r = self._replayer
                continue
            self._number = tc.number
            if r is None:
                self._uncheck(1)
                continue
            before = len(r.divergences)
            r.step(tc)
            self.checked += 1
            for d in r.divergences[before:]:  # the first few of each kind are kept: the first is reported
                self._divergence(d)
            self.divergences = r.div_counts

    def _uncheck(self, n: int) -> None:
        with self._lock:  # both the writer's thread and the checker's count here
            self.unchecked += n

    def _restart(self, state: str) -> None:
        from kvreplay.trace.format import parse_json

        self._replayer = None
        try:
            self._start(parse_json(state, "the gap's snapshot"))
        except ValueError as exc:
            self._give_up(str(exc))

    def _give_up(self, why: str) -> None:
        if self._replayer is None and self.status != "watching":
            return
        self._replayer = None
        self.status = f"stopped: {why}"
        self._emit({"kind": "watch-stopped", "reason": why, "call": self._number})

    # -- findings and counters -----------------------------------------------------------

    def _violation(self, v: Any) -> None:
        rule = f"{v.invariant}/{v.rule}"
        self.violations[rule] += 1
        if rule not in self.reported:  # the first of each rule; /metrics counts them all
            self.reported.add(rule)
            # the build is named here, by the process that recorded the class, for kvreplay
            # record's reproducer: a trace's footer never names what is imported
            self._emit({"kind": "violation", "rule": rule, "call": v.call, "method": v.method,
                        "message": v.message, "request": self._request(), "build": watch_build(self.meta)})

    def _divergence(self, d: Any) -> None:
        if f"divergence/{d.kind}" not in self.reported:
            self.reported.add(f"divergence/{d.kind}")
            self._emit({"kind": "divergence", "rule": d.kind, "call": d.call, "method": d.method,
                        "message": d.message, "request": self._request()})

    def _request(self) -> str | None:
        tc = getattr(self._replayer, "_current", None)
        args = getattr(getattr(tc, "call", None), "args", {}) or {}
        for k in REQUEST_ARGS:
            if isinstance(args.get(k), (str, int)):
                return str(args[k])[:200]
        return None

    def _emit(self, finding: dict[str, Any]) -> None:
        # strings cut short: the line stays one short write, never torn
        doc = {k: v[:1000] if isinstance(v, str) else v
               for k, v in {"trace": self.name, "t": time.time(), **finding}.items()}
        line = (json.dumps(seal(doc, self.key)) + "\n").encode()
        # one write of a short line to a file opened for appending: writers of several
        # traces share the file without interleaving their lines
        fd = open_append(self.out / FINDINGS_FILE)
        if fd is None:  # not a regular file any more: kvreplay record would not read it either
            return
        try:
            os.write(fd, line)
        except OSError:
            pass
        finally:
            os.close(fd)

    def metrics(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_metrics < 1.0:
            return
        self._last_metrics = now
        lag = max(0.0, time.time() - self.last_t_ns / 1e9) if self.last_t_ns else 0.0
        try:
            size = sum(p.stat().st_size for p in (self.path.glob("*.parquet*") if self.path.is_dir() else
                                                  [self.path, self.path.with_name(self.name + ".tmp")])
                       if p.exists())
        except OSError:
            size = 0
        sink = self.sink
        parts = len(sink.closed) if sink is not None and sink.rotating else 0
        retired = sink.retired if sink is not None else 0
        doc = {"trace": self.name, "calls": self.calls, "rows": self.rows, "bytes": size, "dropped": self.dropped,
               "parts": parts, "parts_retired": retired, "writer_rss_bytes": _rss(),
               "unchecked": self.unchecked, "checked": self.checked, "lag_s": round(lag, 3),
               "violations": dict(self.violations), "divergences": dict(self.divergences),
               "watching": self._replayer is not None, "status": self.status}
        # the counters are a courtesy: a file that cannot be replaced is left as it was
        replace_file(self.out / f".kvreplay-metrics-{self.name}.json", json.dumps(seal(doc, self.key)).encode())


def _rss() -> int:
    """This process's resident memory now (Linux), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _lost(table: pa.Table) -> int:
    """Calls the recorder lost, as the table's gap rows count them."""
    import pyarrow.compute as pc

    target, method = table.column("target"), table.column("method")
    gaps = pc.and_(pc.equal(target, GAP_TARGET), pc.equal(method, GAP_METHOD))
    if not pc.any(gaps).as_py():
        return 0
    return sum(max(0, a[0]["i"] or 0) for a in pc.filter(table.column("args"), gaps).to_pylist() if a)


if __name__ == "__main__":
    mode = os.environ.get(WATCH_ENV, "check")
    code = writer_child.main(sys.argv[1:], lambda meta: Watcher(Path(sys.argv[-1]), meta, check=mode != "metrics"))
    sys.stderr.flush()
    os._exit(code)  # as writer_child does: the recording process waits for this exit
