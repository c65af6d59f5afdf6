"""Replay a trace against a build: issue the recorded top-level calls in order,
compare what the build does with what was recorded, and check invariants.

strict: any difference in results, counters or nested sub-allocator calls is a
divergence. remap: recorded indices are translated to the build's own (per page),
so a build with another free-slot policy replays; only semantic differences count
(None vs a tensor, lengths, exceptions)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvreplay.errors import EXIT_CLEAN, EXIT_FOUND, EXIT_UNLOADABLE, BadInput, BuildUnloadable
from kvreplay.recorder.reader import TraceReader
from kvreplay.recorder.recording import COUNTER_METHODS, RECORDED_METHODS, SUB_POOLS
from kvreplay.recorder.trace_format import GAP_TARGET, Call, Opaque
from kvreplay.replayer import builds
from kvreplay.replayer.invariants import ALLOCS, InvariantChecker, Violation
from kvreplay.replayer.pool_view import view_of
from kvreplay.replayer.remap import PageTable, Remapper
from kvreplay.replayer.translations import translate

MODES = ("strict", "remap")
# Outcomes that say nothing about the pool code (git: builds): they exit 125, which
# ``git bisect run`` and ``kvreplay bisect`` take as "skip this revision".
UNTESTABLE = frozenset({"unloadable", "crashed", "timeout"})


class Unsupported(Exception):
    """Stands for a call the build could not be asked to make."""


UNSUPPORTED = Unsupported()


@dataclass
class TopCall:
    """A recorded top-level call with the sub-allocator calls it made."""

    call: Call
    nested: list[Call] = field(default_factory=list)


def top_calls(reader: TraceReader, device: str | torch.device = "cpu") -> Iterator[TopCall]:
    current: TopCall | None = None
    for c in reader.calls(device=device):
        if c.depth == 0:
            if current is not None:
                yield current
            current = TopCall(c)
        elif current is not None:
            current.nested.append(c)
    if current is not None:
        yield current


@dataclass
class Divergence:
    seq: int
    method: str
    kind: str  # result | counter | exception | nested | unsupported
    expected: str
    actual: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReplayReport:
    trace: str
    build: str
    mode: str
    device: str
    status: str  # clean | violation | divergence
    calls_replayed: int
    wall_s: float
    calls_per_s: float
    violations: list[Violation]
    violation_counts: dict[str, int]
    divergences: list[Divergence]
    divergence_counts: dict[str, int]
    first_violation: Violation | None
    first_divergence: Divergence | None
    capacity_assert_seq: int | None
    capacity_assert_after_calls: int | None
    held_at_end: dict[str, int]
    stopped_early: bool = False
    message: str = ""  # why, for the statuses a git: worker can end in (unloadable, crashed, timeout)
    translated: dict[str, int] = field(default_factory=dict)  # calls replayed through an API translation

    @property
    def exit_code(self) -> int:
        if self.status in UNTESTABLE:
            return EXIT_UNLOADABLE
        return EXIT_CLEAN if self.status == "clean" else EXIT_FOUND

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplayReport:
        """The inverse of ``to_dict`` (a report that crossed a process boundary)."""
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields["violations"] = [Violation(**v) for v in d.get("violations", [])]
        fields["divergences"] = [Divergence(**v) for v in d.get("divergences", [])]
        fields["first_violation"] = Violation(**d["first_violation"]) if d.get("first_violation") else None
        fields["first_divergence"] = Divergence(**d["first_divergence"]) if d.get("first_divergence") else None
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


def short_repr(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        vals = v.reshape(-1)[:8].tolist()
        more = "..." if v.numel() > 8 else ""
        return f"tensor(len={v.numel()}, {vals}{more})"
    if isinstance(v, list) and v and isinstance(v[0], tuple):
        return f"segments({len(v)})"
    return repr(v)


def _same(a: Any, b: Any) -> bool:
    ta, tb = type(a) is torch.Tensor, type(b) is torch.Tensor
    if ta and tb:
        if a.dtype == b.dtype and a.device == b.device:
            return bool(torch.equal(a, b))  # also compares shapes
        return a.shape == b.shape and bool(torch.equal(a.to(torch.int64).cpu(), b.to(torch.int64).cpu()))
    if ta or tb or isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


class NestedCapture:
    """Collects a build's sub-allocator calls, as the recorder would see them."""

    def __init__(self, pool: Any) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self._stack: list[str] = []
        for target, attr in SUB_POOLS:
            sub = getattr(pool, attr, None)
            if sub is None or sub is pool:
                continue
            for name in RECORDED_METHODS:
                fn = getattr(sub, name, None)
                if fn is not None and name not in COUNTER_METHODS:
                    setattr(sub, name, self._wrap(target, name, fn))

    def _wrap(self, target: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        stack, calls = self._stack, self.calls

        def captured(*a: Any, **k: Any) -> Any:
            if stack and stack[-1] == target:
                return fn(*a, **k)
            stack.append(target)
            try:
                r = fn(*a, **k)
            finally:
                stack.pop()
            calls.append((target, name, r))
            return r

        return captured


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}: no CUDA device is available here")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise BadInput(f"--device {device}: no such CUDA device (this machine has {torch.cuda.device_count()})")
    elif device != "cpu":
        raise BadInput(f"--device {device}: use auto, cpu, cuda or cuda:N")
    return device


def load_build(spec: str, family: str, ctor: dict[str, Any], device: str, recorded_class: str = "") -> Any:
    build = builds.resolve(spec, family, recorded_class)
    bfam = build.family or builds.family_of_class(build.cls)
    if bfam != family:
        raise BadInput(f"the trace records a {family} pool but {spec} is a {bfam} pool")
    try:
        return build.construct(ctor, device=device)
    except (TypeError, ValueError, AttributeError, RuntimeError, AssertionError) as exc:
        raise BuildUnloadable(f"{spec} could not be constructed from the trace's arguments: {exc}") from None


def start_point(reader: TraceReader, after_gap: bool) -> tuple[int, dict[str, Any] | None]:
    """(replay calls with seq above this, state to start from). A trace with gaps
    (calls the recorder lost) replays only from after its last gap, from the pool
    state recorded there, and only when asked to."""
    gaps = reader.gaps()
    if not gaps:
        return -1, reader.meta.initial_state
    last = gaps[-1]
    lost = sum(g.args.get("lost_calls", 0) for g in gaps if g.args.get("lost_calls", 0) > 0)
    where = f"{len(gaps)} gap(s) where the recorder lost calls ({lost or 'an unknown number'} lost; last: " \
            f"{last.args.get('reason', '?')})"
    if not after_gap:
        raise BadInput(f"{reader.path.name} has {where}; replay --after-gap starts after the last one")
    if not last.args.get("state"):
        raise BadInput(f"{reader.path.name} has {where}; the last gap has no pool snapshot to start from")
    try:
        state = json.loads(last.args["state"])
    except ValueError:
        raise BadInput(f"{reader.path.name}: the last gap's pool snapshot is unreadable") from None
    return last.seq, state


def restore_snapshot(pool: Any, state: dict[str, Any], spec: str) -> None:
    """Put a trace's starting state (a mid-life attach, a flight-recorder dump) into the build."""
    from kvreplay.recorder import snapshot

    try:
        missing = snapshot.restore(pool, state)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise BadInput(f"the trace's starting snapshot is unreadable: {exc}") from None
    if missing:
        raise BuildUnloadable(f"{spec} cannot start from the trace's snapshot: it keeps no "
                              f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")


class Replayer:
    """One replay of one trace against one build; ``run`` drives it to the end."""

    def __init__(self, trace: str | Path, build: str, *, mode: str = "strict", device: str = "auto",
                 full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True,
                 keep: int = 20, after_gap: bool = False, reader: TraceReader | None = None,
                 start: tuple[int, dict[str, Any] | None] | None = None) -> None:
        """``reader`` and ``start`` (``start_point``'s answer) let a caller that replays
        one trace many times (minimize) open it and scan it for gaps once."""
        if mode not in MODES:
            raise BadInput(f"unknown mode {mode!r}; use strict or remap")
        self.reader = reader or TraceReader(trace)
        self.meta = self.reader.meta
        self.start_after, start_state = start or start_point(self.reader, after_gap)
        self.build_spec = build
        self.mode = mode
        self.device = resolve_device(device)
        self.pool = load_build(build, self.meta.family, self.meta.ctor_args, self.device, self.meta.pool_class)
        if start_state is not None:
            restore_snapshot(self.pool, start_state, build)
        self.view = view_of(self.pool, self.meta.family)
        self.checker = InvariantChecker(self.view, full_check_every=full_check_every, keep=keep) if check else None
        if self.checker is not None and start_state is not None:
            self.checker.adopt()
        self.capture = NestedCapture(self.pool) if mode == "strict" else None
        self.stop_at_first = stop_at_first
        self.divergences: list[Divergence] = []
        self.div_counts: Counter[str] = Counter()
        self.translated: Counter[str] = Counter()  # recorded methods the build lacks, replayed translated
        self.keep = keep
        self.remap: Remapper | None = None
        if mode == "remap":
            subs = self.view.subs
            main = subs["full"] if "full" in subs else subs["pool"]
            swa = subs.get("swa")
            self.remap = Remapper(PageTable(main.num_pages, main.page_size),
                                  PageTable(swa.num_pages, swa.page_size) if swa else None)
        self.calls = 0
        self.capacity_seq: int | None = None
        self._ordinal: dict[int, int] = {}

    def _translated(self, method: str) -> Callable[..., Any] | None:
        """The recorded method rewritten for a build that lacks it (translations.py)."""
        t = translate(self.pool, method)
        if t is None:
            return None
        self.translated[method] += 1
        pool = self.pool
        return lambda **args: t.call(pool, args)

    def _diverge(self, seq: int, method: str, kind: str, expected: Any, actual: Any, message: str) -> None:
        self.div_counts[kind] += 1
        if self.div_counts[kind] <= self.keep:
            self.divergences.append(Divergence(seq, method, kind, short_repr(expected), short_repr(actual), message))

    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        """Issue one recorded call; returns what the build returned or raised."""
        c = tc.call
        self.calls += 1
        self._ordinal[c.seq] = self.calls
        fn = getattr(self.pool, c.method, None)
        if fn is None or not callable(fn):
            fn = self._translated(c.method)
            if fn is None:
                self._diverge(c.seq, c.method, "unsupported", "method", "missing",
                              f"build {self.build_spec} has no method {c.method} and no translation applies")
                return None, UNSUPPORTED
        opaque = [k for k, v in c.args.items() if isinstance(v, Opaque)] if c.has_opaque else None
        if opaque:
            self._diverge(c.seq, c.method, "unsupported", "recordable arguments", ",".join(opaque),
                          f"argument(s) {', '.join(opaque)} were not recorded losslessly")
            return None, UNSUPPORTED
        args = self.remap.args(c.args) if self.remap else c.args
        pre = self.checker.before(c.method, args) if self.checker else None
        if self.capture:
            self.capture.calls.clear()
        raised: BaseException | None = None
        result: Any = None
        try:
            result = fn(**args)
        except Exception as exc:  # the build's own failure is a finding, not a crash
            raised = exc
        if c.method in COUNTER_METHODS and raised is None:
            # A pure read: nothing to check but what it returned.
            if self.mode == "strict" and not _same(c.result, result) or self.mode == "remap" and c.result != result:
                self._diverge(c.seq, c.method, "result", c.result, result, "counter read differs")
            return result, None
        # Inside a free group nothing reads availability: frees there take effect at its
        # end, the recorder stored no counters, and the checker settles at the end.
        in_group = self.checker.in_group if self.checker else c.counters.get("available") is None
        avail = None if in_group and c.method != "free_group_end" else self.view.sub_available()
        self._compare(tc, result, raised, avail)
        if self.checker:
            self.checker.after(c.seq, c.method, args, result, raised is not None, pre, avail)
        if self.capacity_seq is None and self._capacity_broken(raised, avail):
            self.capacity_seq = c.seq
        return result, raised

    def _capacity_broken(self, raised: BaseException | None, avail: dict[str, int] | None) -> bool:
        """sglang's own assertion: raised by the build, or true of its counters now
        (not read inside a free group, where nothing is released yet)."""
        if isinstance(raised, AssertionError) and "available_size" in str(raised):
            return True
        if avail is None:
            return False
        for name, sub in self.view.subs.items():
            if avail[name] > sub.size:
                return True
        return False

    def _compare(self, tc: TopCall, result: Any, raised: BaseException | None,
                 avail: dict[str, int] | None) -> None:
        c = tc.call
        got_exc = type(raised).__name__ if raised is not None else None
        if got_exc != c.exc_type:
            self._diverge(c.seq, c.method, "exception", c.exc_type or "no exception", got_exc or "no exception",
                          f"recorded {c.exc_type or 'a return'}, build gave {got_exc or 'a return'}"
                          + (f": {raised}" if raised is not None else ""))
            return
        if raised is not None:
            return
        if self.mode == "strict":
            if not _same(c.result, result):
                self._diverge(c.seq, c.method, "result", c.result, result, "result differs from the recording")
            else:
                self._compare_counters(c, avail)
                self._compare_nested(tc)
            return
        # remap: only what the caller could tell apart
        if (c.result is None) != (result is None):
            self._diverge(c.seq, c.method, "result", c.result, result, "None where the recording has a value, "
                          "or the reverse")
        elif isinstance(c.result, torch.Tensor) and isinstance(result, torch.Tensor):
            if c.result.numel() != result.numel():
                self._diverge(c.seq, c.method, "result", c.result, result, "result length differs")
            elif self.remap is not None:
                self.remap.full.learn(c.result, result)
                self._learn_swa(tc, result)

    def _learn_swa(self, tc: TopCall, result: torch.Tensor) -> None:
        if self.remap is None or self.remap.swa is None or tc.call.method not in ALLOCS:
            return
        rec = [n.result for n in tc.nested if n.target == "swa" and isinstance(n.result, torch.Tensor)]
        if not rec:
            return
        mapped = result[-rec[-1].numel():] if rec[-1].numel() else result[:0]
        self.remap.swa.learn(rec[-1], self.view.mapping[mapped])

    def _compare_counters(self, c: Call, avail: dict[str, int] | None) -> None:
        if c.counters.get("available") is None and c.counters.get("full_available") is None:
            return  # not recorded for this call
        got = self.view.counters(avail)
        want = (c.counters.get("available"), c.counters.get("full_available"), c.counters.get("swa_available"))
        if any(w is not None and w != g for w, g in zip(want, got, strict=True)):
            self._diverge(c.seq, c.method, "counter", want, got, "pool counters after the call differ")

    def _compare_nested(self, tc: TopCall) -> None:
        if self.capture is None or (not tc.nested and not self.capture.calls):
            return
        want = [(n.target, n.method, n.result) for n in tc.nested]
        got = self.capture.calls
        if [(t, m) for t, m, _ in want] != [(t, m) for t, m, _ in got]:
            self._diverge(tc.call.seq, tc.call.method, "nested",
                          ",".join(f"{t}.{m}" for t, m, _ in want), ",".join(f"{t}.{m}" for t, m, _ in got),
                          "the build's sub-allocator calls differ from the recording")
            return
        for (t, m, w), (_, _, g) in zip(want, got, strict=True):
            if not _same(w, g):
                self._diverge(tc.call.seq, tc.call.method, "nested", w, g, f"{t}.{m} returned something else")
                return

    def found_something(self) -> bool:
        return bool(self.divergences) or bool(self.checker and self.checker.log.total)

    def run(self, progress: Callable[[int, int], None] | None = None,
            calls: Iterable[TopCall] | None = None) -> ReplayReport:
        """Replay every call (or ``calls``, already decoded, e.g. for benchmarks)."""
        t0 = time.perf_counter()
        total = self.reader.num_rows
        last_seq = -1
        stopped = False
        rows = 0
        for tc in calls if calls is not None else top_calls(self.reader, device=self.device):
            if tc.call.seq <= self.start_after or tc.call.target == GAP_TARGET:
                continue
            self.step(tc)
            last_seq = tc.call.seq
            rows += 1 + len(tc.nested)
            if progress is not None and self.calls % 512 == 0:
                progress(rows, total)
            if self.stop_at_first and self.found_something():
                stopped = True
                break
        held = self.checker.finish(last_seq) if self.checker and not stopped else {}
        if progress is not None:
            progress(total, total)
        return self.report(time.perf_counter() - t0, held, stopped)

    def report(self, wall: float, held: dict[str, int], stopped: bool) -> ReplayReport:
        log = self.checker.log if self.checker else None
        violations = sorted(log.kept, key=lambda v: (v.seq, v.detected_seq)) if log else []
        first_v = log.first() if log else None
        first_d = min(self.divergences, key=lambda d: d.seq) if self.divergences else None
        status = "violation" if violations else ("divergence" if self.divergences else "clean")
        after = None
        if self.capacity_seq is not None and first_v is not None:
            after = self._ordinal.get(self.capacity_seq, 0) - self._ordinal.get(first_v.seq, 0)
        return ReplayReport(
            trace=str(self.reader.path), build=self.build_spec, mode=self.mode, device=self.device,
            status=status, calls_replayed=self.calls, wall_s=wall,
            calls_per_s=self.calls / wall if wall > 0 else 0.0,
            violations=violations,
            violation_counts={f"{k[0]}/{k[1]}": n for k, n in (log.counts.items() if log else [])},
            divergences=sorted(self.divergences, key=lambda d: d.seq), divergence_counts=dict(self.div_counts),
            first_violation=first_v, first_divergence=first_d, capacity_assert_seq=self.capacity_seq,
            capacity_assert_after_calls=after, held_at_end=held, stopped_early=stopped,
            translated=dict(self.translated),
        )


def replay(trace: str | Path, build: str, **kwargs: Any) -> ReplayReport:
    """Replay ``trace`` against ``build``; see Replayer for the options. ``git:`` builds
    run in a worker process (git_build.py); ``timeout_s`` bounds them."""
    progress = kwargs.pop("progress", None)
    if build.startswith("git:"):
        from kvreplay.replayer.git_build import replay_in_worker

        return ReplayReport.from_dict(replay_in_worker(trace, build, **kwargs)[0])
    kwargs.pop("timeout_s", None)
    return Replayer(trace, build, **kwargs).run(progress=progress)


__all__ = ["MODES", "UNTESTABLE", "Divergence", "ReplayReport", "Replayer", "TopCall", "replay", "top_calls"]
