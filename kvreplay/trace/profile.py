"""The shape of a trace's traffic, to set a live server's beside the workload model's.

``kvreplay synth`` stands in for a server; whether its traces look like a real one's
is a question of figures: calls per request by method, how many tokens an extend or
a decode step allocates, how frees are grouped, how full the pool runs over time,
and how much of the prompts the prefix cache served. ``profile`` computes them from
any trace (one decoding pass over its top-level calls); ``compare`` sets two side by
side with their ratio.

Requests are counted from the trace where it can say: each ``alloc_extend`` lists one
``prefix_lens`` entry per request it extends (a chunked prompt or a retracted request
counts again, as the server prefills it again). A token pool's ``alloc(n)`` says
nothing of requests: give the count."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.contract.registry import family, same_engine
from kvreplay.errors import BadInput, TraceFormatError
from kvreplay.pool_api import COUNTER_METHODS
from kvreplay.trace.reader import TraceReader

GROUP_METHODS = ("free_group_begin", "free_group_end")
OCCUPANCY_POINTS = 10


def _quantiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    s = sorted(values)
    return {"n": len(s), "mean": round(sum(s) / len(s), 2), "p50": float(s[len(s) // 2]),
            "p90": float(s[min(len(s) - 1, (9 * len(s)) // 10)]), "max": float(s[-1])}


def _length(value: Any) -> int:
    """How many entries a per-request argument (a tensor or a list of numbers) has."""
    if hasattr(value, "numel"):
        return int(value.numel())
    if isinstance(value, (list, tuple)) and all(type(x) is int for x in value):
        return len(value)
    raise TypeError(f"a {type(value).__name__} where a tensor or a list of numbers belongs")


def _total(value: Any) -> int:
    _length(value)  # the same kinds only
    return int(value.sum()) if hasattr(value, "sum") else int(sum(value))


@dataclass
class TraceProfile:
    path: str
    family: str
    requests: int | None
    calls: int  # top-level calls, counter reads included
    counter_reads: int
    calls_by_method: dict[str, int]  # state-changing methods only
    extend_tokens: dict[str, float]  # tokens newly allocated per request by alloc_extend
    decode_batch: dict[str, float]  # requests per alloc_decode step
    free_groups: int
    frees_per_group: float
    freed_per_free: dict[str, float]  # slots passed per free call
    prefix_hit: float | None  # share of extended requests' tokens already cached (prefix_lens / seq_lens)
    occupancy: list[float]  # used share of the (first) pool at evenly spaced points of the trace
    peak_occupancy: float
    notes: list[str] = field(default_factory=list)

    def per_request(self) -> dict[str, float]:
        if not self.requests:
            return {}
        return {m: round(n / self.requests, 3) for m, n in sorted(self.calls_by_method.items())}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["calls_per_request"] = self.per_request()
        return d


def profile(path: str | os.PathLike[str], requests: int | None = None) -> TraceProfile:
    """The traffic profile of the trace at ``path`` (``requests``: the count, where
    the trace cannot tell it)."""
    reader = TraceReader(path)
    reader.check_calls()  # known methods, sane rows and values, before any figure is taken
    meta = reader.meta
    fam = family(meta.family)
    capacity = max(1, next(iter(fam.sizes_of(meta.ctor_args).values())))
    counter = fam.capacity_counter  # the first pool's, as capacity
    methods: Counter[str] = Counter()
    reads = 0
    extend: list[int] = []
    decode: list[int] = []
    freed: list[int] = []
    groups = frees_in_groups = 0
    depth = 0
    prefix = seqs = 0
    extended = 0
    used: list[float] = []
    request_ids: set[str] = set()  # vLLM's family names its requests
    step_allocs = 0
    c = None
    try:
        for c in reader.calls(top_level_only=True):
            m = c.method
            if m in COUNTER_METHODS:
                reads += 1
            else:  # a sub-allocator's own top-level calls (the mamba family's) by target
                methods[m if c.target == "root" else f"{c.target}.{m}"] += 1
            available = c.counters.get(counter) if c.counters else None
            if available is not None:
                used.append(1.0 - available / capacity)
            if m == "free_group_begin":
                depth += 1
                groups += 1
            elif m == "free_group_end":
                depth = max(0, depth - 1)
            elif m.startswith("free"):
                if depth:
                    frees_in_groups += 1
                for name in ("free_index", "indices", "full_indices"):
                    if name in c.args:
                        freed.append(_length(c.args[name]))
                        break
                else:
                    segs = c.args.get("segments")
                    if isinstance(segs, (list, tuple)):  # (indices, start_pos) pairs
                        freed.append(sum(_length(seg[0]) for seg in segs if isinstance(seg, (list, tuple)) and seg))
            elif m == "alloc_extend" or m == "alloc_extend_swa_tail":
                p, s = c.args.get("prefix_lens"), c.args.get("seq_lens")
                if p is not None and s is not None:
                    n = _length(p)
                    extended += n
                    prefix += _total(p)
                    seqs += _total(s)
                    try:
                        extend.extend(int(x) for x in (s - p).tolist())
                    except (AttributeError, TypeError):
                        pass
            elif m == "alloc_decode":
                s = c.args.get("seq_lens")
                if s is not None:
                    decode.append(_length(s))
            elif m == "alloc_reqs":  # the mamba family: requests by number
                request_ids.update(str(r) for r in c.args.get("requests") or ())
            elif m == "alloc" and c.target == "root":
                n = c.args.get("need_size")
                if n is not None:
                    if type(n) is not int:
                        raise TypeError(f"need_size is a {type(n).__name__}, not a number")
                    extend.append(n)
            elif m == "new_step_starts":  # vLLM: a scheduler step; its running requests' allocations
                if step_allocs:
                    decode.append(step_allocs)
                step_allocs = 0
            elif m == "allocate_slots":
                rid, n = c.args.get("request_id"), c.args.get("num_new_tokens")
                hit = c.args.get("num_new_computed_tokens")
                if isinstance(rid, str):
                    request_ids.add(rid)
                if c.args.get("request_status") == "RUNNING":
                    step_allocs += 1
                elif isinstance(n, int) and isinstance(hit, int):  # an admission: the prompt past its cached prefix
                    extend.append(n)
                    prefix += hit
                    seqs += hit + n
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError, RuntimeError) as exc:
        where = f"the call at row {c.seq} ({c.method[:40]})" if c is not None else "a call"
        raise TraceFormatError(f"{reader.path}: {where} has arguments its method does not take "
                               f"({type(exc).__name__}: {str(exc)[:120]})") from None
    step = max(1, len(used) // OCCUPANCY_POINTS)
    notes = []
    if step_allocs:
        decode.append(step_allocs)
    if requests is None and extended:
        requests = extended
        notes.append("requests counted from alloc_extend (one prefix_lens entry each)")
    elif requests is None and request_ids:
        requests = len(request_ids)
        notes.append("requests counted by id (vLLM's allocate_slots, the mamba family's alloc_reqs)")
    return TraceProfile(
        path=str(path), family=meta.family, requests=requests, calls=sum(methods.values()) + reads,
        counter_reads=reads, calls_by_method=dict(methods), extend_tokens=_quantiles(extend),
        decode_batch=_quantiles(decode), free_groups=groups,
        frees_per_group=round(frees_in_groups / groups, 3) if groups else 0.0,
        freed_per_free=_quantiles(freed), prefix_hit=round(prefix / seqs, 4) if seqs else None,
        occupancy=[round(used[i], 4) for i in range(0, len(used), step)][:OCCUPANCY_POINTS],
        peak_occupancy=round(max(used), 4) if used else 0.0, notes=notes)


@dataclass
class Comparison:
    a: TraceProfile
    b: TraceProfile
    rows: list[tuple[str, float | None, float | None, float | None]]  # figure, a, b, b/a

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a.to_dict(), "b": self.b.to_dict(),
                "rows": [{"figure": f, "a": x, "b": y, "ratio": r} for f, x, y, r in self.rows]}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return round(b / a, 3)


def compare(a: TraceProfile, b: TraceProfile) -> Comparison:
    """Figure by figure, ``b`` against ``a`` (``a``: the live server, by convention).
    Only traffic of one engine compares: sglang's pools (token, paged, SWA) with each
    other, vLLM's manager with itself."""
    if not same_engine(a.family, b.family):
        raise BadInput(f"{b.path} records a {b.family} pool and {a.path} a {a.family} pool: their figures do not "
                       "compare (profile --against takes two traces of one engine)")
    rows: list[tuple[str, float | None, float | None, float | None]] = []
    pa, pb = a.per_request(), b.per_request()
    for m in sorted(set(pa) | set(pb)):
        x, y = pa.get(m, 0.0), pb.get(m, 0.0)
        rows.append((f"{m} per request", x, y, _ratio(x, y)))
    for name, key in (("extend tokens per request", "extend_tokens"), ("requests per decode step", "decode_batch"),
                      ("slots per free", "freed_per_free")):
        for q in ("mean", "p90"):
            x, y = getattr(a, key)[q], getattr(b, key)[q]
            rows.append((f"{name} ({q})", x, y, _ratio(x, y)))
    rows.append(("frees per free group", a.frees_per_group, b.frees_per_group,
                 _ratio(a.frees_per_group, b.frees_per_group)))
    rows.append(("prefix-cache hit share", a.prefix_hit, b.prefix_hit, _ratio(a.prefix_hit, b.prefix_hit)))
    rows.append(("peak occupancy", a.peak_occupancy, b.peak_occupancy, _ratio(a.peak_occupancy, b.peak_occupancy)))
    return Comparison(a, b, rows)
