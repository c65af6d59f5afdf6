"""Shrink a failing trace to the few calls that still make a build fail.

The failure to keep is an invariant id on a kind of method (alloc, free, ...), or a
divergence kind, as the full trace shows it on the build. Candidates are replayed in
remap mode: once calls are gone the build hands out other slots than the recording
did, and remap translates the later frees to the slots it really handed out.

Removal keeps a trace that makes sense. Each call depends on the allocations that
handed out the slots it names (a free, an extend's ``last_loc``), so removing an
allocation removes those calls too, and a free group's begin and end go together.
The search (delta debugging, complements only) runs first over groups of calls tied
by those dependencies (roughly: requests), then over single calls, after two cheap
cuts: everything after the failure, and everything the failing call does not depend
on. The result is written by replaying the kept calls on the build with the recorder
on, so its indices are the ones the build hands out and it replays strict.

A vLLM trace (block ids, requests) shrinks the same way, by requests first: its
dependencies are a request's calls on its admission (``RequestDependencies``), and its
remap mode hands each request the build's own prefix hit (families/vllm/replayer.py)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvreplay.builds.spec import BuildSpec
from kvreplay.contract.record import Vocabulary
from kvreplay.contract.registry import family, method_kind
from kvreplay.errors import BadInput, KvreplayError
from kvreplay.recorder.recording import record
from kvreplay.replay.dispatch import replay
from kvreplay.replay.loop import start_point
from kvreplay.replay.replayers import make_replayer
from kvreplay.replay.report import Failure, describe
from kvreplay.trace.format import TopCall
from kvreplay.trace.location import is_remote, output_path, publish
from kvreplay.trace.reader import TraceReader


@dataclass
class MinimizeResult:
    trace: str
    build: str
    out: str
    failure: Failure
    calls_before: int  # top-level calls in the input
    calls_after: int
    tests: int  # candidate replays
    wall_s: float
    timed_out: bool
    reference: str | None  # the build every candidate had to stay clean on
    shows: str  # the failure as the minimal trace shows it (strict replay on the build)
    test_file: str | None = None
    sizes: list[int] = field(default_factory=list)  # the size after each reduction

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failure"] = asdict(self.failure)
        return d


def _index_tokens(tc: TopCall, page_size: int, slot_args: tuple[str, ...]) -> np.ndarray:
    """The full-pool slots a call names in its arguments (recorded values)."""
    parts: list[np.ndarray] = []
    args = tc.call.args
    for name in slot_args:
        v = args.get(name)
        if isinstance(v, torch.Tensor):
            parts.append(v.reshape(-1).to(torch.int64).numpy())
    segs = args.get("segments")
    if isinstance(segs, list):
        parts.extend(t.reshape(-1).to(torch.int64).numpy() for t, _ in segs)
    pages = args.get("page_ids")
    if isinstance(pages, torch.Tensor):
        p = pages.reshape(-1).to(torch.int64).numpy()
        parts.append((p[:, None] * page_size + np.arange(page_size)).reshape(-1))
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


class Dependencies:
    """Who depends on whom among a trace's top-level calls (by position)."""

    def __init__(self, calls: Sequence[TopCall], capacity: int, page_size: int, vocabulary: Vocabulary) -> None:
        n = len(calls)
        producer = np.full(capacity + 1, -1, dtype=np.int64)  # slot -> call that last handed it out
        self.needs: list[set[int]] = [set() for _ in range(n)]
        self.partner: dict[int, int] = {}
        open_groups: list[int] = []
        for i, tc in enumerate(calls):
            c = tc.call
            tokens = _index_tokens(tc, page_size, vocabulary.slot_args)
            if len(tokens):
                tokens = tokens[(tokens >= 0) & (tokens < len(producer))]
                self.needs[i] = {int(p) for p in np.unique(producer[tokens]) if p >= 0}
            if c.method in vocabulary.allocs and isinstance(c.result, torch.Tensor):
                r = c.result.reshape(-1).to(torch.int64).numpy()
                producer[r[(r >= 0) & (r < len(producer))]] = i
            elif c.method == "free_group_begin":
                open_groups.append(i)
            elif c.method == "free_group_end" and open_groups:
                b = open_groups.pop()
                self.partner[b], self.partner[i] = i, b
        self.users: list[list[int]] = [[] for _ in range(n)]
        for i, needs in enumerate(self.needs):
            for p in needs:
                self.users[p].append(i)

    def without(self, kept: list[int], drop: Sequence[int]) -> list[int]:
        """``kept`` less ``drop`` and everything that depends on a dropped call."""
        gone = self._reach(drop, self.users)
        return [i for i in kept if i not in gone]

    def cone(self, i: int) -> set[int]:
        """Call ``i`` and every call it transitively depends on (group partners included)."""
        return self._reach([i], self.needs)

    def _reach(self, start: Sequence[int], edges: Sequence[Any]) -> set[int]:
        """``start`` and all reachable from it along ``edges`` and free-group pairs."""
        seen: set[int] = set()
        todo = list(start)
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            todo.extend(edges[i])
            if i in self.partner:
                todo.append(self.partner[i])
        return seen

    def groups(self, kept: list[int]) -> list[list[int]]:
        """``kept`` split into groups tied by dependencies (union-find), in trace order."""
        parent = {i: i for i in kept}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for i in kept:
            for j in [*self.needs[i], *([self.partner[i]] if i in self.partner else [])]:
                if j in parent:
                    parent[find(i)] = find(j)
        by_root: dict[int, list[int]] = {}
        for i in kept:
            by_root.setdefault(find(i), []).append(i)
        return sorted(by_root.values(), key=lambda g: g[0])


class RequestDependencies(Dependencies):
    """Dependencies among a block-pool trace's calls (vLLM's manager): every later call
    of a request hangs on its admission (its first call and its first ``allocate_slots``);
    a scheduler's own free of blocks it popped hangs on that pop. The calls between
    admission and free do not hang on each other: each ``allocate_slots`` asks for the
    blocks the request needs up to its length, whichever growth came before it, so
    a decode step can go alone. Step boundaries, cache resets and evictions depend on
    nothing, and a prefix hit on another request's blocks is no dependency: remap mode
    hands the call the build's own hit."""

    def __init__(self, calls: Sequence[TopCall]) -> None:
        n = len(calls)
        self.needs = [set() for _ in range(n)]
        self.partner = {}
        admitted: dict[str, list[int]] = {}  # request -> its first call, its first allocate_slots
        popped: dict[int, int] = {}  # block id -> the pop that handed it to the scheduler
        for i, tc in enumerate(calls):
            c = tc.call
            rid = c.args.get("request_id")
            if isinstance(rid, str):
                anchors = admitted.setdefault(rid, [])
                self.needs[i].update(anchors)
                if not anchors or (len(anchors) == 1 and c.method == "allocate_slots"
                                   and calls[anchors[0]].call.method != "allocate_slots"):
                    anchors.append(i)
            if c.method == "pop_blocks_for_free" and isinstance(c.result, (tuple, list)):
                popped.update((b, i) for b in c.result)
            ids = c.args.get("block_ids")
            if c.target == "blocks" and isinstance(ids, (tuple, list)):
                self.needs[i].update(popped[b] for b in ids if b in popped)
        self.users = [[] for _ in range(n)]
        for i, needs in enumerate(self.needs):
            for p in needs:
                self.users[p].append(i)


class Subject:
    """A trace, a build and the failure to keep; ``fails`` replays a subset."""

    def __init__(self, trace: str | Path, build: str | BuildSpec, device: str = "cpu",
                 reference: str | BuildSpec | None = None) -> None:
        # Parsed once here and handed down to every candidate's replayer.
        spec = build if isinstance(build, BuildSpec) else BuildSpec.parse(build)
        ref = reference if isinstance(reference, BuildSpec) or reference is None else BuildSpec.parse(reference)
        if not spec.in_process or (ref is not None and not ref.in_process):
            raise BadInput("minimize replays thousands of candidates in-process; use a builtin:, py: or sglang "
                           "build (for a git: revision, py:MODULE:CLASS on a checkout of it)")
        self.trace = str(trace)
        self.build = spec
        self.reference = ref
        self.device = device
        self.reader = TraceReader(trace)
        self.reader.check_calls()  # once, not per candidate: candidates replay with checked=True
        self.meta = self.reader.meta
        self.allocs = family(self.meta.family).vocabulary.allocs
        self.slots = family(self.meta.family).slots  # else block ids (vLLM's manager)
        self.start = start_point(self.reader, after_gap=False)
        self.calls: list[TopCall] = []  # decoded up to the failure by first_failure
        self.deps: Dependencies | None = None
        self.tests = 0

    def _replayer(self, check: bool = True, build: BuildSpec | None = None) -> Any:
        return make_replayer(self.trace, build or self.build, mode="remap", device=self.device, keep=1 << 30,
                             check=check, reader=self.reader, start=self.start, checked=True)

    def first_failure(self, invariant: str | None = None) -> tuple[Failure, int]:
        """The failure of the trace to keep, and the position of the call showing it.
        Calls are decoded only up to there: nothing after it can matter."""
        r = self._replayer()
        log = r.checker.log
        found = None
        inv, _, rule = (invariant or "").partition("/")

        def wanted(v: Any) -> bool:  # ``invariant`` or ``invariant/rule``
            return invariant is None or (v.invariant == inv and (not rule or v.rule == rule))

        for i, tc in enumerate(self.reader.top_calls()):
            self.calls.append(tc)
            r.step(tc)
            if len(log.kept) and any(wanted(v) for v in log.kept):
                found = i
                break
        if found is None and self.calls:
            r.checker.finish(self.calls[-1].number)
        if self.slots:
            main = r.view.subs["full"] if "full" in r.view.subs else r.view.subs["pool"]
            self.deps = Dependencies(self.calls, main.capacity + main.page_size, main.page_size,
                                     family(self.meta.family).vocabulary)
        else:
            self.deps = RequestDependencies(self.calls)
        position = {tc.number: i for i, tc in enumerate(self.calls)}
        vs = sorted(log.kept, key=lambda v: (v.detected_call, v.call))
        vs = [v for v in vs if wanted(v)]
        if vs:
            v = vs[0]
            return Failure("violation", v.invariant, method_kind(v.method), rule or None), position.get(
                v.detected_call, len(self.calls) - 1)
        if invariant is None and r.divergences:
            d = min(r.divergences, key=lambda d: d.call)
            return Failure("divergence", d.kind, method_kind(d.method)), position[d.call]
        what = f"no {invariant} violation" if invariant else "no violation and no divergence (remap mode)"
        raise BadInput(f"{Path(self.trace).name} on {self.build}: {what}, so there is nothing to minimize")

    def fails(self, kept: Sequence[int], failure: Failure) -> bool:
        """Does the build still show ``failure`` on the calls at ``kept``, while the
        reference build (when there is one) shows no failure of that id at all?"""
        self.tests += 1
        if not self._shows(self.build, kept, failure, any_method=False):
            return False
        return self.reference is None or not self._shows(self.reference, kept, failure, any_method=True)

    def drive(self, r: Any, kept: Sequence[int]) -> Iterator[TopCall]:
        """Issue the calls at ``kept`` on ``r``, yielding each one issued. An allocation
        that hands out nothing (or another count than recorded) where the recording got
        slots takes down the calls that name those slots: they are skipped."""
        assert self.deps is not None
        dead: set[int] = set()
        needs = self.deps.needs
        for i in kept:
            if dead and not dead.isdisjoint(needs[i]):
                dead.add(i)
                continue
            tc = self.calls[i]
            result, _ = r.step(tc)
            if _lost(tc.call.method, tc.call.result, result, self.allocs):
                dead.add(i)
            yield tc

    def _shows(self, build: BuildSpec, kept: Sequence[int], failure: Failure, *, any_method: bool) -> bool:
        r = self._replayer(build=build)
        log = r.checker.log

        def hit(items: Sequence[Any]) -> bool:
            return failure.in_items(items, any_method=any_method)

        seen = 0
        last = -1
        for tc in self.drive(r, kept):
            last = tc.number
            if failure.kind == "violation":
                if len(log.kept) > seen:
                    if hit(log.kept[seen:]):
                        return True
                    seen = len(log.kept)
            elif hit(r.divergences):
                return True
        if failure.kind == "violation":
            r.checker.finish(last)
            return hit(log.kept[seen:])
        return False


def _lost(method: str, want: Any, got: Any, allocs: frozenset[str]) -> bool:
    """Did the build hand out nothing (or another count of slots) where the recording
    got something: slots from an allocation, or a vLLM manager's blocks, None meaning
    the request did not fit? The calls that use what it handed out are then moot."""
    if method in allocs and isinstance(want, torch.Tensor):
        return not (isinstance(got, torch.Tensor) and got.numel() == want.numel())
    return method == "allocate_slots" and want is not None and got is None


class _Clock:
    def __init__(self, timeout_s: float | None) -> None:
        self.t0 = time.perf_counter()
        self.deadline = None if timeout_s is None else self.t0 + timeout_s

    @property
    def up(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def ddmin(units: list[list[int]], kept: list[int], test: Callable[[list[int]], bool],
          without: Callable[[list[int], Sequence[int]], list[int]], clock: _Clock,
          on_size: Callable[[int], None]) -> list[int]:
    """Delta debugging over ``units`` (lists of call positions), removing complements:
    split into n chunks, drop the first chunk whose removal keeps the failure, refine n."""
    n = 2
    while len(units) >= 2 and not clock.up:
        size = max(1, len(units) // n)
        chunks = [units[i:i + size] for i in range(0, len(units), size)]
        reduced = False
        for chunk in chunks:
            if clock.up:
                break
            drop = [i for u in chunk for i in u]
            candidate = without(kept, drop)
            if len(candidate) < len(kept) and test(candidate):
                kept = candidate
                left = set(kept)
                units = [u2 for u in units if (u2 := [i for i in u if i in left])]
                n = max(n - 1, 2)
                reduced = True
                on_size(len(kept))
                break
        if not reduced:
            if n >= len(units):
                break
            n = min(len(units), n * 2)
    return kept


def minimize(trace: str | Path, build: str, out: str | Path, *, invariant: str | None = None,
             reference: str | None = "auto",
             emit_test: str | Path | None = None, timeout_s: float | None = None, device: str = "cpu",
             progress: Callable[[int, int, float], None] | None = None) -> MinimizeResult:
    """Write to ``out`` a smallest trace (that delta debugging finds) still showing
    the failure of ``trace`` on ``build``; see the module docstring for how."""
    out_uri = str(out)
    out, remote = output_path(out)  # a URI: written here, then put there
    if not remote and not is_remote(str(trace)) and out.resolve() == Path(trace).resolve():
        raise BadInput("-o must not be the input trace")
    if not out.parent.is_dir():
        raise BadInput(f"{out.parent}: no such directory for -o")
    clock = _Clock(timeout_s)
    spec = BuildSpec.parse(build)  # once, handed down to every candidate
    ref = spec.base if reference == "auto" else reference
    subject = Subject(trace, spec, device, ref)
    if emit_test is not None and not subject.slots:
        raise BadInput("--emit-test writes sglang allocator calls; for a vLLM trace the minimal trace itself is "
                       "the reproducer (kvreplay replay it)")
    failure, at = subject.first_failure(invariant)
    if subject.reference is not None and subject._shows(subject.reference, range(at + 1), failure, any_method=True):
        raise BadInput(f"the reference build {ref} shows the same {failure.id} failure on this trace; "
                       "pick a reference that replays it clean (--reference) or none (--reference none)")
    sizes: list[int] = []

    def on_size(n: int) -> None:
        sizes.append(n)
        if progress is not None:
            progress(n, subject.tests, clock.elapsed)

    def test(candidate: list[int]) -> bool:
        return subject.fails(candidate, failure)

    deps = subject.deps
    assert deps is not None
    kept = list(range(at + 1))  # nothing after the failure can matter to it
    housekeeping = family(subject.meta.family).housekeeping
    on_size(len(kept))
    for cut in (
        [i for i in kept if subject.calls[i].call.method not in family(subject.meta.family).vocabulary.reads],
        [i for i in kept if subject.calls[i].call.method not in housekeeping],
        sorted(deps.cone(at)),
    ):
        if len(cut) < len(kept) and not clock.up and test(cut):
            kept = cut
            on_size(len(kept))
    kept = ddmin(deps.groups(kept), kept, test, deps.without, clock, on_size)
    kept = ddmin([[i] for i in kept], kept, test, deps.without, clock, on_size)
    rebase(subject, kept, out, failure)
    check = replay(out, spec, mode="strict", device=device)
    shows, failing_call = _shown(check, failure)
    total = subject.reader.count_calls()
    if remote:
        publish(out, remote)
    result = MinimizeResult(str(trace), build, out_uri if remote else str(out), failure, total, len(kept),
                            subject.tests, clock.elapsed, clock.up, ref, shows, sizes=sizes)
    if emit_test is not None:
        from kvreplay.jobs.reproducer import write_reproducer

        result.test_file = str(write_reproducer(out, emit_test, build=build, failure=failure, source=str(trace),
                                                failing_call=failing_call, shows=shows.split(": ")[0]))
    return result


def _shown(report: Any, failure: Failure) -> tuple[str, int]:
    """How the minimal trace shows the failure, and at which call."""
    for item in [*report.violations, *report.divergences]:
        if failure.matches(item):
            return f"{describe(item)}: {item.message}", item.call
    raise BadInput(f"the minimal trace no longer shows {failure} when replayed strict on {report.build}; "
                   "the build may not be deterministic")


def rebase(subject: Subject, kept: Sequence[int], out: Path, failure: Failure) -> Path:
    """Replay the kept calls on the build with the recorder on: the written trace
    holds the slots the build handed out, so it replays strict. Written beside
    ``out`` and renamed, so a failure leaves no partial file."""
    r = subject._replayer(check=False)  # the checker reads counters through the pool: they would be recorded
    tmp = Path(tempfile.mkdtemp(prefix=".kvreplay-min-", dir=out.parent)) / out.name
    extra = {"minimized_from": Path(subject.trace).name, "minimized_on": subject.build.text,
             "minimized_failure": asdict(failure), "source_pool_class": subject.meta.pool_class}
    rec = record(r.pool, tmp, writer="thread", extra=extra)
    try:
        for _ in subject.drive(r, kept):
            pass
    finally:
        rec.close()
    tmp.replace(out)
    tmp.parent.rmdir()
    return out


def reproduce_findings(findings: list[dict[str, Any]], out: Path, timeout_s: float = 60.0,
                       progress: Callable[[str], None] | None = None,
                       traces: Sequence[Path] | None = None) -> list[dict[str, Any]]:
    """Beside each watched trace with a violation (``kvreplay record --watch``), a
    minimized reproducer of the first violation of each rule it found, on the class that
    recorded it: ``repro-TRACE-N.parquet``, at most ``timeout_s`` seconds of delta
    debugging each (what it has by then is written).

    The build is the one the finding names: the watching writer named the class the
    recording process handed it (and ``kvreplay record`` reads only findings its own
    writers sealed, recorder/seal.py). A trace's footer never chooses it: a trace whose
    footer names another class gets no reproducer. ``traces``: the traces this
    recording wrote (others in ``out`` are not its own)."""
    from kvreplay.jobs.watch import watch_build
    from kvreplay.trace.reader import TraceReader

    own = None if traces is None else {Path(t).name for t in traces}
    done: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for f in findings:
        name, rule, build = str(f.get("trace", "")), str(f.get("rule", "")), f.get("build")
        trace = out / name
        if (f.get("kind") != "violation" or (name, rule) in seen or "/" in name or name in ("", ".", "..")
                or not isinstance(build, str) or not trace.exists() or (own is not None and name not in own)):
            continue
        seen.add((name, rule))
        target = out / f"repro-{trace.stem}-{len([k for k in seen if k[0] == name])}.parquet"
        if progress is not None:
            progress(f"minimizing {rule} in {name} (at most {timeout_s:.0f} s)")
        try:
            if watch_build(TraceReader(trace).meta) != build:
                raise BadInput("the trace on disk names another class than the one its writer watched: not "
                               "replayed")
            res = minimize(trace, build, target, invariant=rule, timeout_s=timeout_s)
        except KvreplayError as exc:
            done.append({"trace": name, "rule": rule, "error": str(exc)})
            continue
        done.append({"trace": name, "rule": rule, "reproducer": str(target), "build": build, "calls": res.calls_after,
                     "from_calls": res.calls_before, "timed_out": res.timed_out})
    return done


__all__ = ["Dependencies", "MinimizeResult", "RequestDependencies", "Subject", "ddmin", "minimize", "rebase",
           "reproduce_findings"]
