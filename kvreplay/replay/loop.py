"""The replay run loop every family's replayer shares.

``ReplayLoop.run`` walks the trace's top-level calls, hands each to the family's
``step`` (issue it on the build, compare, check), stops where asked (the first finding,
a call the build cannot make, the end of a segment), settles the checker and makes the
report. A family's replayer subclasses it and says, through the hooks below, how it
steps a call (``step``), where its calls come from (``calls_to_replay``) and, for one
that replays segments of a trace, where a segment ends (``ends_at``)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvreplay.builds.resolve import load_build, resolve_device
from kvreplay.check.rules import ViolationLog
from kvreplay.contract.registry import family
from kvreplay.errors import BadInput, one_of
from kvreplay.replay.compare import json_value
from kvreplay.replay.divergence import Divergence
from kvreplay.replay.report import MODES, ReplayReport
from kvreplay.replay.timeline import Timeline
from kvreplay.trace.format import GAP_TARGET, TopCall, parse_json
from kvreplay.trace.reader import TraceReader


def plain(v: Any) -> Any:
    """Ids compare as tuples whichever sequence carried them (a list in one, a tuple in the other)."""
    return tuple(v) if isinstance(v, list) else v


@contextlib.contextmanager
def few_collections() -> Iterator[None]:
    """A replay makes and drops a few short-lived objects per call (views, dicts,
    results); the collector's default pace (every 700 allocations) spends a fifth of
    a checked replay's own time finding nothing to free. Collect less often while
    replaying; the previous thresholds come back after."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], 20_000), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


class Unsupported(Exception):
    """Stands for a call the build could not be asked to make."""


UNSUPPORTED = Unsupported()


class ReplayLoop:
    """What every replayer keeps and does around its ``step``. A subclass's constructor
    sets ``reader``, ``build_spec``, ``mode``, ``device``, ``checker`` (or None),
    ``timeline``, ``keep`` and ``stop_at_first``, and calls ``_start_loop`` first."""

    nested_args = False  # whether ``step`` needs the nested rows' arguments decoded
    replays_segments = False  # whether it can start at a checkpoint and end at one (replay --jobs)
    reader: Any
    build_spec: str
    mode: str
    device: str
    checker: Any
    timeline: Any
    keep: int
    stop_at_first: bool

    def _start_loop(self) -> None:
        self.divergences: list[Divergence] = []
        self.div_counts: Counter[str] = Counter()
        self.translated: Counter[str] = Counter()  # recorded methods the build lacks, replayed translated
        self.calls = 0
        # The first call the build cannot make that changes the pool's state: every call
        # after it would replay on a state the recording never had, so the replay stops.
        self.unsupported: str | None = None
        self.capacity_call: int | None = None  # where the build's own capacity assertion fired
        self.start_after = -1  # replay only rows with a seq above this (after a gap)
        self.ended_at: int | None = None  # the checkpoint row a segment replay ended at

    # -- hooks ----------------------------------------------------------------------
    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        """Issue one recorded call; returns what the build returned or raised."""
        raise NotImplementedError

    def calls_to_replay(self) -> Iterable[TopCall]:
        return self.reader.top_calls(device=self.device, nested_args=self.nested_args)

    def first_row(self) -> int:
        """The trace row the calls start at (a segment's checkpoint)."""
        return 0

    def ends_at(self, c: Any, row: int) -> bool:
        """Whether the replay ends at this gap or checkpoint row (a segment's end)."""
        return False

    # -- the opening every replayer shares ------------------------------------------------
    def _open(self, trace: Any, build: Any, *, mode: str, device: str, stop_at_first: bool, keep: int,
              reader: TraceReader | None, checked: bool, whole: str = "") -> None:
        """The loop's counters, the trace (its rows checked unless the caller did) and
        what the report names. ``whole``: the family's name where its traces replay only
        whole (no start after a gap)."""
        self._start_loop()
        self.mode = one_of("mode", mode, MODES)
        self.reader = reader or TraceReader(trace)
        if not checked:
            self.reader.check_calls()
        self.meta = self.reader.meta
        self._reads = family(self.meta.family).vocabulary.reads  # an unsupported read does not stop it
        if whole and self.reader.gaps():
            raise BadInput(f"{self.reader.path.name} has gaps where the recorder lost calls; a {whole} trace "
                           "replays only whole")
        self.build_spec = str(build)  # as the user gave it; a parsed spec is used as it is
        self.device = resolve_device(device)
        self.stop_at_first = stop_at_first
        self.keep = keep

    def _build(self, build: Any, device: str) -> Any:
        """The build, made for the trace's family and constructor arguments."""
        return load_build(build, self.meta.family, self.meta.ctor_args, device, self.meta.pool_class)

    def _watch(self, checker: Any, sizes: dict[str, int]) -> None:
        """The checker (or None) and the timeline of the sub-pools' use, with each
        violation marked on it where the checker finds it."""
        self.checker = checker
        self.timeline = tl = Timeline(sizes, self.reader.num_entries)
        if checker is not None:
            checker.log.listener = lambda v: tl.mark("violation", f"{v.invariant}/{v.rule}", v.call)

    def _unsupported(self, n: int, method: str, why: str) -> tuple[None, BaseException]:
        """A call the build cannot take: a divergence, and (but for one of the family's
        counter reads) where the replay stops."""
        self._diverge(n, method, "unsupported", method, None, why)
        if method not in self._reads and self.unsupported is None:
            self.unsupported = f"{why} (call #{n})"
        return None, UNSUPPORTED

    # -- shared -----------------------------------------------------------------------
    def _diverge(self, call: int, method: str, kind: str, expected: Any, actual: Any, message: str) -> None:
        self.div_counts[kind] += 1
        self.timeline.mark("divergence", kind, call)
        if self.div_counts[kind] <= self.keep:
            self.divergences.append(Divergence(call, method, kind, json_value(expected), json_value(actual), message))

    def found_something(self) -> bool:
        return bool(self.divergences) or bool(self.checker and self.checker.log.total)

    def run(self, progress: Callable[[int, int], None] | None = None,
            calls: Iterable[TopCall] | None = None) -> ReplayReport:
        """Replay every call (or ``calls``, already decoded as ``calls_to_replay``
        decodes them, e.g. for benchmarks). ``progress(rows done, rows in the trace)``
        is called now and then."""
        t0, c0 = time.perf_counter(), time.process_time()
        total = self.reader.num_rows
        last = rows = 0
        stopped = False
        step, start_after, stop_at_first = self.step, self.start_after, self.stop_at_first
        if calls is None:
            calls = self.calls_to_replay()
        first_row = self.first_row()
        with few_collections():
            for tc in calls:
                c = tc.call
                if c.target == GAP_TARGET:
                    if self.ends_at(c, first_row + rows):
                        self.ended_at = first_row + rows
                        break
                    rows += tc.rows
                    continue
                rows += tc.rows
                if c.seq <= start_after:
                    continue
                step(tc)
                last = tc.number
                if progress is not None and self.calls % 512 == 0:
                    progress(rows, total)
                if self.unsupported is not None or (stop_at_first and self.found_something()):
                    stopped = True
                    break
            ends = self.ended_at is None and not stopped  # a segment that ended at a checkpoint goes on elsewhere
            held = self.checker.finish(last) if self.checker and ends else {}
        if progress is not None:
            progress(total, total)
        report = self.report(time.perf_counter() - t0, held, stopped)
        report.cpu_s = time.process_time() - c0
        return report

    def report(self, wall: float, held: dict[str, int], stopped: bool) -> ReplayReport:
        return compose_report(
            trace=self.reader.source, build=self.build_spec, mode=self.mode, device=self.device,
            calls=self.calls, wall=wall, log=self.checker.log if self.checker else None,
            divergences=self.divergences, div_counts=dict(self.div_counts), capacity_call=self.capacity_call,
            held=held, stopped=stopped, translated=dict(self.translated), unsupported=self.unsupported,
            timeline=self.timeline.to_dict())


def compose_report(*, trace: str, build: str, mode: str, device: str, calls: int, wall: float,
                   log: ViolationLog | None, divergences: list[Divergence], div_counts: dict[str, int],
                   capacity_call: int | None, held: dict[str, int], stopped: bool, translated: dict[str, int],
                   unsupported: str | None, timeline: dict[str, Any] | None = None) -> ReplayReport:
    """A run's report from what its replay (or the segments of one) found."""
    violations = sorted(log.kept, key=lambda v: (v.call, v.detected_call)) if log else []
    first_v = log.first() if log else None
    first_d = min(divergences, key=lambda d: d.call) if divergences else None
    status = "violation" if violations else ("divergence" if divergences else "clean")
    message = ""
    if unsupported is not None:
        status = "violation" if violations else "unsupported"
        message = f"{unsupported}: the replay stops there, since every later call would meet a state " \
                  "the recording never had"
    after = None
    if capacity_call is not None and first_v is not None:
        after = capacity_call - first_v.call
    return ReplayReport(
        trace=trace, build=build, mode=mode, device=device,
        status=status, calls_replayed=calls, wall_s=wall,
        calls_per_s=calls / wall if wall > 0 else 0.0,
        violations=violations,
        violation_counts={f"{k[0]}/{k[1]}": n for k, n in (log.counts.items() if log else [])},
        divergences=sorted(divergences, key=lambda d: d.call), divergence_counts=dict(div_counts),
        first_violation=first_v, first_divergence=first_d, capacity_assert_call=capacity_call,
        capacity_assert_after_calls=after, held_at_end=held, stopped_early=stopped,
        translated=dict(translated), message=message, timeline=timeline or {},
    )


__all__ = ["UNSUPPORTED", "ReplayLoop", "Segment", "Unsupported", "compose_report", "few_collections", "plain",
           "start_point"]


@dataclass(frozen=True)
class Segment:
    """Where a segment replay starts (a checkpoint row, whose call numbers continue
    after ``number_from``) and the checkpoint rows it may end at: the first of them at
    or after ``end_row`` where the build's state is the recording's."""

    start_row: int
    number_from: int
    end_row: int | None  # None: to the end of the trace
    stop_rows: frozenset[int] = frozenset()


def start_point(reader: TraceReader, after_gap: bool) -> tuple[int, dict[str, Any] | None]:
    """(replay rows with seq above this, state to start from). A trace with gaps
    (calls the recorder lost) replays only from after its last gap, from the pool
    state recorded there, and only when asked to."""
    gaps = reader.gaps()
    if not gaps:
        return -1, reader.meta.initial_state
    for g in gaps:
        if not isinstance(g.args.get("lost_calls", 0), int) or not isinstance(g.args.get("state", ""), str):
            raise BadInput(f"{reader.path.name}: a gap row at row {g.seq} is damaged (lost_calls must be a number, "
                           "state a snapshot)")
    last = gaps[-1]
    lost = sum(g.args.get("lost_calls", 0) for g in gaps if g.args.get("lost_calls", 0) > 0)
    where = f"{len(gaps)} gap(s) where the recorder lost calls ({lost or 'an unknown number'} lost; last: " \
            f"{last.args.get('reason', '?')})"
    if not after_gap:
        raise BadInput(f"{reader.path.name} has {where}; replay --after-gap starts after the last one")
    if not last.args.get("state"):
        raise BadInput(f"{reader.path.name} has {where}; the last gap has no pool snapshot to start from")
    try:
        state = parse_json(last.args["state"], "the gap's snapshot")
    except ValueError:
        raise BadInput(f"{reader.path.name}: the last gap's pool snapshot is unreadable") from None
    return last.seq, state
