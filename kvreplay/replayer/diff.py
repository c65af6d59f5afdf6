"""Differential replay: two builds fed the same recorded calls in lockstep, compared
with each other (not with the recording): the first call where they part, the
calls leading up to it, and how many calls of each method differ."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvreplay.errors import EXIT_CLEAN, EXIT_FOUND
from kvreplay.replayer.engine import Replayer, short_repr, top_calls


@dataclass
class CallSummary:
    seq: int
    method: str
    args: dict[str, str]
    base: str
    candidate: str


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

    @property
    def exit_code(self) -> int:
        return EXIT_FOUND if self.differing_calls else EXIT_CLEAN

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


def _outcome(result: Any, raised: BaseException | None) -> tuple[str, Any]:
    if raised is not None:
        return "raised", type(raised).__name__
    return "returned", result


def _differs(a: tuple[str, Any], b: tuple[str, Any], mode: str) -> str | None:
    if a[0] != b[0]:
        return "exception"
    if a[0] == "raised":
        return "exception" if a[1] != b[1] else None
    x, y = a[1], b[1]
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.numel() != y.numel():
            return "result"
        if mode == "strict" and not torch.equal(x.cpu().to(torch.int64), y.cpu().to(torch.int64)):
            return "result"
        return None
    if (x is None) != (y is None) or (not isinstance(x, torch.Tensor) and x != y):
        return "result"
    return None


def diff_builds(trace: str | Path, base: str, candidate: str, *, mode: str = "strict", context: int = 5,
                device: str = "cpu") -> DiffReport:
    """Replay ``trace`` on both builds and compare them call by call.

    strict: results must be equal; remap: only None-ness, lengths and exceptions
    (each build's indices are translated from the recording separately)."""
    a = Replayer(trace, base, mode=mode, device=device, check=False)
    b = Replayer(trace, candidate, mode=mode, device=device, check=False)
    recent: deque[CallSummary] = deque(maxlen=context)
    per_method: Counter[str] = Counter()
    first: CallSummary | None = None
    first_kind = None
    first_context: list[CallSummary] = []
    n = 0
    for tc in top_calls(a.reader, device=a.device):
        n += 1
        oa = _outcome(*a.step(tc))
        ob = _outcome(*b.step(tc))
        summary = CallSummary(tc.call.seq, tc.call.method, {k: short_repr(v) for k, v in tc.call.args.items()},
                              short_repr(oa[1]), short_repr(ob[1]))
        kind = _differs(oa, ob, mode)
        if kind:
            per_method[tc.call.method] += 1
            if first is None:
                first, first_kind, first_context = summary, kind, list(recent)
        recent.append(summary)
    return DiffReport(trace=str(a.reader.path), base=base, candidate=candidate, mode=mode, calls=n,
                      differing_calls=sum(per_method.values()), first=first, first_kind=first_kind,
                      context=first_context, per_method=dict(per_method.most_common()))
