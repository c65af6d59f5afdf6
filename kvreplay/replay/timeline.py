"""What a picture of a replay needs that its findings do not hold: how full each of
the build's sub-pools was over the calls, and where every violation and divergence
fell.

Occupancy is kept per bucket of ``stride`` calls as the lowest and highest use seen
in it, so a spike between two samples still shows; the stride makes at most
``MAX_BUCKETS`` buckets, whatever the trace's length. Finding positions are kept
exactly (call numbers, ``MAX_MARKS`` per rule or kind), since the one call that
went wrong must not be averaged away."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_BUCKETS = 2000
MAX_MARKS = 50_000


def stride_for(rows: int) -> int:
    """Calls per bucket for a trace of ``rows`` rows (rows bound the calls above, and
    every segment of one trace must agree on it)."""
    return max(1, -(-rows // MAX_BUCKETS))


class Timeline:
    """Filled by the replayer: ``see`` after each call whose counters were read,
    ``mark`` for each finding."""

    def __init__(self, sizes: dict[str, int], rows: int) -> None:
        self.sizes = dict(sizes)
        self.stride = stride_for(rows)
        n = -(-max(rows, 1) // self.stride) + 1
        self.lo: dict[str, list[int | None]] = {name: [None] * n for name in sizes}
        self.hi: dict[str, list[int | None]] = {name: [None] * n for name in sizes}
        self.marks: dict[str, dict[str, list[int]]] = {"violation": {}, "divergence": {}}
        self._seers = [(name, self.seer(name)) for name in sizes]

    def see(self, call: int, avail: dict[str, int]) -> None:
        for name, see_one in self._seers:
            see_one(call, avail[name])

    def seer(self, name: str) -> Callable[[int, int], None]:
        """``see`` for one sub-pool, taking its free count alone: a replay of a one-pool
        family calls it after every call, so it makes no dict and walks no list."""
        size, lo, hi, stride = self.sizes[name], self.lo[name], self.hi[name], self.stride

        def see_one(call: int, avail: int) -> None:
            b = (call - 1) // stride
            used = size - avail
            low = lo[b]
            if low is None:
                lo[b] = hi[b] = used
            elif used < low:
                lo[b] = used
            elif used > hi[b]:
                hi[b] = used
        return see_one

    def mark(self, group: str, key: str, call: int) -> None:
        """A finding of ``group`` (violation: key ``invariant/rule``; divergence: its kind)."""
        calls = self.marks[group].setdefault(key, [])
        if len(calls) < MAX_MARKS:
            calls.append(call)

    def to_dict(self) -> dict[str, Any]:
        last = max((i for lo in self.lo.values() for i, v in enumerate(lo) if v is not None), default=-1)
        return {"stride": self.stride, "sizes": self.sizes,
                "lo": {k: v[:last + 1] for k, v in self.lo.items()},
                "hi": {k: v[:last + 1] for k, v in self.hi.items()},
                "marks": {g: {k: list(v) for k, v in m.items()} for g, m in self.marks.items()}}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One timeline from those of consecutive segments of one replay, in call order."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    out: dict[str, Any] = {"stride": parts[0]["stride"], "sizes": dict(parts[0]["sizes"]), "lo": {}, "hi": {},
                           "marks": {"violation": {}, "divergence": {}}}
    for p in parts:
        for side, pick in (("lo", min), ("hi", max)):
            for name, values in p[side].items():
                acc = out[side].setdefault(name, [])
                if len(acc) < len(values):
                    acc.extend([None] * (len(values) - len(acc)))
                for i, v in enumerate(values):
                    if v is not None:
                        acc[i] = v if acc[i] is None else pick(acc[i], v)
        for group, marks in p["marks"].items():
            for key, calls in marks.items():
                acc = out["marks"].setdefault(group, {}).setdefault(key, [])
                acc.extend(calls[:MAX_MARKS - len(acc)])
    return out


__all__ = ["MAX_BUCKETS", "MAX_MARKS", "Timeline", "merge", "stride_for"]
