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

from kvreplay.contract.record import load
from kvreplay.contract.registry import family, same_engine
from kvreplay.errors import BadInput, TraceFormatError
from kvreplay.trace.reader import TraceReader

OCCUPANCY_POINTS = 10


def _quantiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    s = sorted(values)
    return {"n": len(s), "mean": round(sum(s) / len(s), 2), "p50": float(s[len(s) // 2]),
            "p90": float(s[min(len(s) - 1, (9 * len(s)) // 10)]), "max": float(s[-1])}


def length(value: Any) -> int:
    """How many entries a per-request argument (a tensor or a list of numbers) has."""
    if hasattr(value, "numel"):
        return int(value.numel())
    if isinstance(value, (list, tuple)) and all(type(x) is int for x in value):
        return len(value)
    raise TypeError(f"a {type(value).__name__} where a tensor or a list of numbers belongs")


def total(value: Any) -> int:
    length(value)  # the same kinds only
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


@dataclass
class Figures:
    """What a profile gathers as it reads a trace's calls. The shared loop counts calls
    and occupancy; each family's hook (its record's ``profile``) fills the rest from
    its own calls."""

    extend: list[int] = field(default_factory=list)  # tokens newly taken per admitted request
    decode: list[int] = field(default_factory=list)  # requests per decode step
    freed: list[int] = field(default_factory=list)  # slots per free call
    groups: int = 0
    frees_in_groups: int = 0
    depth: int = 0  # free groups open now
    prefix: int = 0  # tokens already cached, over the admitted requests
    seqs: int = 0  # their whole lengths
    extended: int = 0  # requests admitted through a call that names each one's prefix
    request_ids: set[str] = field(default_factory=set)  # where a family names its requests
    step_allocs: int = 0  # requests served in the step still open

    def end_step(self) -> None:
        if self.step_allocs:
            self.decode.append(self.step_allocs)
        self.step_allocs = 0


def profile(path: str | os.PathLike[str], requests: int | None = None) -> TraceProfile:
    """The traffic profile of the trace at ``path`` (``requests``: the count, where
    the trace cannot tell it)."""
    reader = TraceReader(path)
    reader.check_calls()  # known methods, sane rows and values, before any figure is taken
    meta = reader.meta
    fam = family(meta.family)
    see = load(fam.profile) if fam.profile else None
    capacity = max(1, next(iter(fam.sizes_of(meta.ctor_args).values())))
    counter = fam.capacity_counter  # the first pool's, as capacity
    methods: Counter[str] = Counter()
    reads = 0
    used: list[float] = []
    f = Figures()
    c = None
    try:
        for c in reader.calls(top_level_only=True):
            m = c.method
            if m in fam.vocabulary.reads:
                reads += 1
            else:  # a sub-allocator's own top-level calls (the mamba family's) by target
                methods[m if c.target == "root" else f"{c.target}.{m}"] += 1
            available = c.counters.get(counter) if c.counters else None
            if available is not None:
                used.append(1.0 - available / capacity)
            if see is not None:
                see(f, c)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError, RuntimeError) as exc:
        where = f"the call at row {c.seq} ({c.method[:40]})" if c is not None else "a call"
        raise TraceFormatError(f"{reader.path}: {where} has arguments its method does not take "
                               f"({type(exc).__name__}: {str(exc)[:120]})") from None
    f.end_step()
    return _profile_of(str(path), meta.family, requests, methods, reads, used, f)


def _profile_of(path: str, family_name: str, requests: int | None, methods: Counter[str], reads: int,
                used: list[float], f: Figures) -> TraceProfile:
    step = max(1, len(used) // OCCUPANCY_POINTS)
    notes = []
    if requests is None and f.extended:
        requests = f.extended
        notes.append("requests counted from alloc_extend (one prefix_lens entry each)")
    elif requests is None and f.request_ids:
        requests = len(f.request_ids)
        notes.append("requests counted by the ids the family's calls name (one retracted, or refused room "
                     "after its match, may count again)")
    return TraceProfile(
        path=path, family=family_name, requests=requests, calls=sum(methods.values()) + reads,
        counter_reads=reads, calls_by_method=dict(methods), extend_tokens=_quantiles(f.extend),
        decode_batch=_quantiles(f.decode), free_groups=f.groups,
        frees_per_group=round(f.frees_in_groups / f.groups, 3) if f.groups else 0.0,
        freed_per_free=_quantiles(f.freed), prefix_hit=round(f.prefix / f.seqs, 4) if f.seqs else None,
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
