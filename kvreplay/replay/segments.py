"""Segment-parallel replay (replay --jobs N): a trace with checkpoints splits at some
of them into segments, each replayed from its checkpoint in its own worker, and the
segments' findings merge into one run, the run a serial replay gives.

A segment starts with the build and the invariant checker in the checkpoint's state
and replays until it reaches the checkpoint where the next segment starts. There it
compares the build's state (and the checker's, and in remap mode the page tables,
which must still be the identity) with the checkpoint's. Equal: the next segment,
started from that checkpoint, replays exactly what this one would have, so this one
stops. Not equal (the build went its own way: a divergence in strict mode, another
page choice in remap mode): it keeps going, checking again at each later segment
start, and the segments it overran are thrown away. So the merged run is always the
serial one; what parallelism a trace gets depends on how long the build stays on
the recorded path."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.check.rules import Violation, ViolationLog
from kvreplay.fanout import iter_units
from kvreplay.replay.divergence import Divergence
from kvreplay.replay.loop import Segment, compose_report
from kvreplay.replay.replayers import make_replayer, replayer_class
from kvreplay.replay.report import ReplayReport
from kvreplay.replay.timeline import merge as merge_timelines
from kvreplay.trace.reader import TraceReader

SEGMENTS_PER_JOB = 3  # more segments than workers: one slow stretch of a trace does not idle the others


@dataclass(frozen=True)
class SegmentUnit:
    trace: str
    build: str
    options: dict[str, Any]
    segment: Segment


@dataclass
class SegmentResult:
    start_row: int
    ended_at: int | None  # the checkpoint row it stopped at; None: it ran to the end
    stopped: bool  # stopped early (first finding, or a call the build cannot make)
    calls: int
    kept: list[Violation] = field(default_factory=list)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    div_counts: dict[str, int] = field(default_factory=dict)
    translated: dict[str, int] = field(default_factory=dict)
    capacity_call: int | None = None
    unsupported: str | None = None
    held: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    build_version: str = ""
    cpu_s: float = 0.0
    timeline: dict[str, Any] = field(default_factory=dict)


def plan(reader: TraceReader, jobs: int) -> list[Segment]:
    """Segments of about equal call counts, cut at the checkpoints nearest to the
    ideal cuts; one segment (the whole trace) when it has no checkpoints."""
    cps = reader.checkpoints()
    want = max(1, jobs * SEGMENTS_PER_JOB)
    if jobs <= 1 or not cps or want == 1:
        return [Segment(0, 0, None)]
    total = reader.count_calls()  # from the same scan as the checkpoints
    cuts = []
    for k in range(1, want):
        ideal = total * k / want
        best = min(cps, key=lambda cp: abs(cp.calls - ideal))
        if best not in cuts and 0 < best.calls < total:
            cuts.append(best)
    cuts.sort(key=lambda cp: cp.row)
    stops = frozenset(cp.row for cp in cuts)
    starts = [(0, 0)] + [(cp.row, cp.calls) for cp in cuts]
    ends = [cp.row for cp in cuts] + [None]
    return [Segment(row, number, end, stops) for (row, number), end in zip(starts, ends, strict=True)]


def replay_segment(unit: SegmentUnit) -> SegmentResult:
    """One segment, in whichever process or machine runs it."""
    import torch

    if unit.options.get("device", "cpu") in ("cpu", "auto"):
        torch.set_num_threads(1)
    r = make_replayer(unit.trace, unit.build, checked=True, segment=unit.segment, **unit.options)
    report = r.run()
    log = r.checker.log if r.checker else None
    return SegmentResult(
        start_row=unit.segment.start_row, ended_at=r.ended_at, stopped=report.stopped_early, calls=r.calls,
        kept=list(log.kept) if log else [], counts=dict(log.counts) if log else {},
        divergences=list(r.divergences), div_counts=dict(r.div_counts), translated=dict(r.translated),
        capacity_call=r.capacity_call, unsupported=r.unsupported, held=report.held_at_end, device=r.device,
        build_version=BuildSpec.parse(unit.build).resolved(pool=r.pool), cpu_s=report.cpu_s, timeline=report.timeline)


def merge(results: list[SegmentResult], *, trace: str, build: str, mode: str, keep: int, wall: float,
          checked: bool) -> ReplayReport:
    """The serial run, from the segments that make it up: from the first, each one's
    successor is the segment starting where it ended."""
    by_start = {r.start_row: r for r in results}
    chain = [by_start[0]]
    while chain[-1].ended_at is not None and not chain[-1].stopped:
        chain.append(by_start[chain[-1].ended_at])
    log = ViolationLog(keep=keep) if checked else None
    divergences: list[Divergence] = []
    div_counts: Counter[str] = Counter()
    translated: Counter[str] = Counter()
    kept_per_kind: Counter[str] = Counter()
    kept_per_rule: Counter[tuple[str, str]] = Counter()
    capacity_call = None
    for seg in chain:
        if log is not None:
            for v in seg.kept:  # each segment kept its first ones; the run keeps the first of all
                key = (v.invariant, v.rule)
                if kept_per_rule[key] < keep:
                    log.kept.append(v)
                    kept_per_rule[key] += 1
            for key, n in seg.counts.items():
                log.counts[key] = log.counts.get(key, 0) + n
        for d in seg.divergences:
            if kept_per_kind[d.kind] < keep:
                divergences.append(d)
                kept_per_kind[d.kind] += 1
        div_counts.update(seg.div_counts)
        translated.update(seg.translated)
        if capacity_call is None:
            capacity_call = seg.capacity_call
    last = chain[-1]
    return compose_report(
        trace=trace, build=build, mode=mode, device=last.device, calls=sum(s.calls for s in chain), wall=wall,
        log=log, divergences=divergences, div_counts=dict(div_counts), capacity_call=capacity_call,
        held=last.held, stopped=last.stopped, translated=dict(translated), unsupported=last.unsupported,
        timeline=merge_timelines([seg.timeline for seg in chain]))


def replay_segments(trace: str, build: str, *, jobs: int, ray: str | None = None,
                    progress: Callable[[int, int], None] | None = None, reader: TraceReader | None = None,
                    **options: Any) -> tuple[ReplayReport, str] | None:
    """The trace replayed in segments on ``jobs`` workers (or Ray), and the build's
    version; None when it cannot be split (no checkpoints, gaps, one job) and there
    is no Ray to send the whole to: the caller replays it serially."""
    reader = reader or TraceReader(trace)
    reader.checkpoints()  # the one scan that also counts the calls and looks for gaps
    whole = (reader.gaps() or reader.meta.initial_state is not None or options.get("after_gap")
             or not replayer_class(reader).replays_segments)
    # A start from a snapshot or after a gap: the checkpoints' checker states do not apply.
    segments = [Segment(0, 0, None)] if whole else plan(reader, jobs)
    if len(segments) == 1 and ray is None:
        return None
    t0 = time.perf_counter()
    units = [SegmentUnit(str(trace), build, dict(options), s) for s in segments]
    results = list(iter_units(replay_segment, units, jobs=jobs, ray=ray,
                              done=(lambda n, total: progress(n, total)) if progress else None))
    report = merge(results, trace=reader.source, build=build, mode=options.get("mode", "strict"),
                   keep=options.get("keep", 20), wall=time.perf_counter() - t0, checked=options.get("check", True))
    report.cpu_s = sum(r.cpu_s for r in results)  # every worker's, the overrun segments' too
    return report, results[0].build_version


__all__ = ["SegmentResult", "SegmentUnit", "merge", "plan", "replay_segment", "replay_segments"]
