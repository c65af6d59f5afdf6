"""Differential replay: two builds fed the same recorded calls in lockstep, compared
with each other (not with the recording): the first call where they part, the
calls leading up to it, and how many calls of each method differ."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.errors import EXIT_CLEAN, EXIT_FOUND
from kvreplay.replay.compare import json_value, outcome_difference
from kvreplay.replay.replayers import make_replayer
from kvreplay.replay.timeline import MAX_MARKS


@dataclass
class CallSummary:
    call: int
    method: str
    args: dict[str, Any]
    base: Any  # JSON value, or the exception's type name
    candidate: Any


@dataclass
class DiffReport:
    trace: str
    base: str
    candidate: str
    mode: str
    calls: int
    differing_calls: int
    first: CallSummary | None
    first_kind: str | None
    context: list[CallSummary] = field(default_factory=list)
    per_method: dict[str, int] = field(default_factory=dict)
    # For the report, not in --json: each build's timeline, and the calls where they part.
    timelines: dict[str, dict[str, Any]] = field(default_factory=dict)
    differing: list[int] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_FOUND if self.differing_calls else EXIT_CLEAN

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["timelines"], d["differing"]
        d["exit_code"] = self.exit_code
        return d


def _shown(result: Any, raised: BaseException | None) -> Any:
    return {"raised": type(raised).__name__} if raised is not None else json_value(result)


def diff_builds(trace: str | Path, base: str, candidate: str, *, mode: str = "strict", context: int = 5,
                device: str = "cpu", progress: Callable[[int, int], None] | None = None) -> DiffReport:
    """Replay ``trace`` on both builds and compare them call by call.

    strict: results must be equal; remap: only None-ness, lengths and exceptions
    (each build's indices are translated from the recording separately).
    ``progress(rows done, rows in the trace)`` is called now and then."""
    a = make_replayer(trace, base, mode=mode, device=device, check=False)
    b = make_replayer(trace, candidate, mode=mode, device=device, check=False, reader=a.reader, checked=True)
    recent: deque[CallSummary] = deque(maxlen=context)
    per_method: Counter[str] = Counter()
    first: CallSummary | None = None
    first_kind = None
    first_context: list[CallSummary] = []
    differing: list[int] = []
    n = rows = 0
    total = a.reader.num_rows
    for tc in a.reader.top_calls(device=a.device):
        rows += tc.rows
        if not tc.number:
            continue  # a gap row: no call to make
        n += 1
        ra, xa = a.step(tc)
        rb, xb = b.step(tc)
        summary = CallSummary(tc.number, tc.call.method, {k: json_value(v) for k, v in tc.call.args.items()},
                              _shown(ra, xa), _shown(rb, xb))
        kind = outcome_difference((xa, ra), (xb, rb), mode)
        if kind:
            per_method[tc.call.method] += 1
            if len(differing) < MAX_MARKS:
                differing.append(tc.number)
            if first is None:
                first, first_kind, first_context = summary, kind, list(recent)
        recent.append(summary)
        if progress is not None and n % 512 == 0:
            progress(rows, total)
    if progress is not None:
        progress(total, total)
    return DiffReport(trace=a.reader.source, base=base, candidate=candidate, mode=mode, calls=n,
                      differing_calls=sum(per_method.values()), first=first, first_kind=first_kind,
                      context=first_context, per_method=dict(per_method.most_common()),
                      timelines={"base": a.timeline.to_dict(), "candidate": b.timeline.to_dict()},
                      differing=differing)
