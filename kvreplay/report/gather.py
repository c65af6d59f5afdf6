"""What a report reads from the trace itself: the recorded occupancy of each
sub-pool (bucketed as the replay's timeline is), and the calls around each finding
with their arguments summarised. A report whose trace is gone (moved, another
machine's) still draws the replayed side; ``TraceGone`` says why the rest is missing."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pyarrow.compute as pc

from kvreplay.contract.registry import family
from kvreplay.errors import KvreplayError
from kvreplay.replay.timeline import stride_for
from kvreplay.trace.format import GAP_TARGET
from kvreplay.trace.reader import FOLD_COLUMNS, TraceReader, folded_per_row

CONTEXT = 3  # calls shown on each side of a finding's call
SHOWN_VALUES = 6  # values of an index tensor shown before eliding the rest


class TraceGone(Exception):
    """The run's trace cannot be read here; the message says why."""


def open_trace(location: str) -> TraceReader:
    try:
        return TraceReader(location)
    except (KvreplayError, OSError) as exc:
        raise TraceGone(f"the trace {location} cannot be read here ({' '.join(str(exc).split())})") from None


def sizes_of(reader: TraceReader) -> dict[str, int]:
    return family(reader.meta.family).sizes_of(reader.meta.ctor_args)


def recorded_occupancy(reader: TraceReader, stride: int | None = None) -> dict[str, Any]:
    """{"stride", "sizes", "lo": {sub: [...]}, "hi": {...}}: the lowest and highest use
    the recording saw in each bucket of ``stride`` calls (None where no counter was
    recorded, inside free groups)."""
    sizes = sizes_of(reader)
    stride = stride or stride_for(reader.num_entries)
    column = family(reader.meta.family).counter_of
    cols = ["depth", "target"] + [column[s] for s in sizes] + list(FOLD_COLUMNS)
    buckets: list[np.ndarray] = []
    used: dict[str, list[np.ndarray]] = {s: [] for s in sizes}
    calls = 0
    for batch in reader.iter_batches(columns=cols):
        top = pc.and_(pc.equal(batch.column(0), 0), pc.not_equal(batch.column(1), GAP_TARGET))
        top_np = top.to_numpy(zero_copy_only=False)
        folded = folded_per_row(*batch.columns[2 + len(sizes):])
        # the call number of each top-level row: calls folded into a row come after it
        number = calls + np.cumsum(top_np + folded) - folded
        calls = int(number[-1] + folded[-1]) if len(number) else calls
        buckets.append(((number - 1) // stride)[top_np])
        for i, s in enumerate(sizes):
            col = batch.column(2 + i).to_numpy(zero_copy_only=False)
            used[s].append(np.where(np.isnan(col.astype(float)), np.nan, sizes[s] - col.astype(float))[top_np])
    n = calls // stride + 1 if calls else 0
    b = np.concatenate(buckets) if buckets else np.zeros(0, dtype=np.int64)
    out: dict[str, Any] = {"stride": stride, "sizes": sizes, "lo": {}, "hi": {}, "calls": calls}
    for s in sizes:
        u = np.concatenate(used[s]) if used[s] else np.zeros(0)
        ok = ~np.isnan(u)
        lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
        np.minimum.at(lo, b[ok], u[ok])
        np.maximum.at(hi, b[ok], u[ok])
        out["lo"][s] = [None if not np.isfinite(v) else int(v) for v in lo]
        out["hi"][s] = [None if not np.isfinite(v) else int(v) for v in hi]
    return out


def summarise(value: Any) -> Any:
    """A JSON-able short form of a recorded value: index tensors as their length, first
    values and range, so a call of 10,000 indices stays a line; a segment (slots and
    where they start in their request's row) as one string that says so."""
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.flatten()
        n = flat.numel()
        if n == 0:
            return "[] (0)"
        head = " ".join(str(int(v)) for v in flat[:SHOWN_VALUES].tolist())
        more = " ..." if n > SHOWN_VALUES else ""
        return f"[{head}{more}] ({n}; {int(flat.min())}..{int(flat.max())})"
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if _segment(value):
        return f"from {int(value[1])}: {summarise(value[0])}"
    if isinstance(value, (list, tuple)):
        return [summarise(v) for v in value[:SHOWN_VALUES]] + (["..."] if len(value) > SHOWN_VALUES else [])
    if isinstance(value, dict):
        return {str(k): summarise(v) for k, v in list(value.items())[:SHOWN_VALUES]}
    return str(value)[:200]


def _segment(value: Any) -> bool:
    import torch

    return (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], torch.Tensor)
            and isinstance(value[1], int) and not isinstance(value[1], bool))


def call_contexts(reader: TraceReader, calls: set[int], around: int = CONTEXT
                  ) -> tuple[dict[int, dict[str, Any]], dict[int, list[int]]]:
    """The calls around each call numbered in ``calls``: ``around`` state-changing calls
    on each side (counter reads skipped: a live server reads its counters thousands of
    times a second, and they would crowd out the calls that made the state). Returns
    each shown call (method, arguments and result summarised, counters after it) by
    number, and for each of ``calls`` the numbers to show with it, in order."""
    if not calls:
        return {}, {}
    pending = sorted(calls)
    last = pending[-1]
    reads = family(reader.meta.family).vocabulary.reads
    before: deque[Any] = deque(maxlen=around)  # the latest state-changing calls seen
    after: dict[int, int] = {}  # a call of ``calls`` -> state-changing calls still to take after it
    chosen: dict[int, Any] = {}
    shown: dict[int, list[int]] = {c: [] for c in calls}
    nxt = 0
    for tc in reader.top_calls(nested_args=False):
        n = tc.number
        if n > last and not after:
            break
        changing = tc.call.method not in reads
        for c in [c for c in after if changing]:
            chosen[n] = tc
            shown[c].append(n)
            after[c] -= 1
            if not after[c]:
                del after[c]
        while nxt < len(pending) and pending[nxt] == n:
            chosen[n] = tc
            for b in before:
                chosen[b.number] = b
            shown[n] = [b.number for b in before] + [n]
            after[n] = around
            nxt += 1
        if changing:
            before.append(tc)
    out = {}
    for n, tc in chosen.items():
        c = tc.call
        out[n] = {
            "call": n, "method": c.method,
            "args": {k: summarise(v) for k, v in c.args.items()},
            "result": summarise(c.result), "exc": c.exc_type,
            "counters": {k: v for k, v in c.counters.items() if v is not None},
            "nested": [f"{x.target}.{x.method}" for x in tc.nested],
        }
    return out, shown


__all__ = ["TraceGone", "call_contexts", "open_trace", "recorded_occupancy", "sizes_of", "summarise"]
