"""``kvreplay ci``: replay a saved corpus against one build and hold it to the manifest.

Each (trace, expectation, mode) the manifest lists for the build is a case; a trace
with no expectation for the build must replay clean, and one of another pool family
is skipped. Cases run in parallel worker processes and every run is stored. A case
passes only when its expectation holds: a known-bad case that replays clean fails,
because it means the checker lost its teeth. Results render as JUnit XML and as a
Markdown summary a CI job can post (render.py)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.corpus.expectations import check_report
from kvreplay.corpus.manifest import MANIFEST, Expectation, load_manifest
from kvreplay.errors import BadInput, BuildUnsupported, FamilyMismatch
from kvreplay.fanout import iter_threads, iter_units
from kvreplay.jobs.stored_replay import StoredReplay, replay_and_store
from kvreplay.replay.dispatch import run_many
from kvreplay.replay.report import ReplayReport, describe
from kvreplay.replay.worker import as_sent
from kvreplay.store.db import open_store
from kvreplay.store.runs import record_run
from kvreplay.trace.hashing import content_hash
from kvreplay.trace.location import corpus_traces, is_remote, local_path
from kvreplay.trace.reader import TraceReader


@dataclass
class Case:
    trace: str  # corpus entry name (a directory corpus: the trace's path in it)
    file: str  # the trace as given: a path, or a URI under a remote corpus
    sha256: str  # "" in a directory corpus without a manifest: nothing to hold it to
    build: str
    mode: str
    expectation: Expectation | None  # None: no entry for this build, so it must be clean
    partition: dict[str, str] = field(default_factory=dict)  # hive keys on its path (host=..., rank=...)

    @property
    def name(self) -> str:
        return f"{self.trace}[{self.mode}]"

    def expected(self) -> str:
        return "clean" if self.expectation is None else self.expectation.describe()


@dataclass
class CaseResult:
    case: Case
    outcome: str  # pass | fail | skip | error
    problems: list[str] = field(default_factory=list)
    status: str = ""
    calls: int = 0
    wall_s: float = 0.0
    run_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = {"trace": self.case.trace, "build": self.case.build, "mode": self.case.mode,
                     "expected": self.case.expected(), "partition": self.case.partition}
        return d


def plan(corpus: str | Path, build: str) -> list[Case]:
    """The cases: from the manifest, or, for a directory of traces without one (a
    hive-partitioned fleet dump), every trace in it, which must replay clean."""
    root = local_path(corpus)  # a remote corpus is mirrored here first
    named = root / MANIFEST
    if root.is_dir() and (named.is_symlink() or named.exists()) and not named.is_file():
        # a manifest that is a directory, a FIFO, a dangling link: not "no manifest"
        raise BadInput(f"{named}: not a manifest file (a directory, a pipe or a broken link)")
    if root.is_dir() and not named.is_file():
        return [Case(t.name, t.location, "", build, "strict", None, t.partition) for t in corpus_traces(corpus)]
    cases = []
    remote = is_remote(str(corpus))
    for e in load_manifest(root):
        exps = [x for x in e.expect if x.build == build]
        # A remote corpus's traces are replayed (and stored) by their URIs, from the mirror.
        file = f"{str(corpus).rstrip('/')}/{e.file.relative_to(root).as_posix()}" if remote else str(e.file)
        for x in exps or [None]:
            for mode in (x.modes if x else ["strict"]):
                cases.append(Case(e.name, file, e.sha256, build, mode, x))
    return cases


class CaseTimeout(BaseException):
    """The case ran past its time limit. A BaseException, like KeyboardInterrupt: the
    replay takes what a build raises as a finding, and this must not be one."""


@contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise CaseTimeout in this (main) thread after ``seconds``: a build that loops
    forever fails its case instead of holding up the whole corpus."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"no result after {seconds:.0f} s (--timeout)")

    previous = signal.signal(signal.SIGALRM, expired)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)  # a timer already running (a caller's limit)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 0.001) if outer else 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class CaseUnit:
    """One case as a unit of work for a worker process or a Ray task."""

    case: Case
    device: str
    timeout_s: float | None


@dataclass
class CaseOutcome:
    result: CaseResult
    replayed: StoredReplay | None  # what the driver stores (None: nothing ran)


def run_case(unit: CaseUnit) -> CaseOutcome:
    """One case, wherever it runs, within its time limit; nothing is stored here."""
    t0 = time.perf_counter()
    try:
        with _time_limit(unit.timeout_s):
            return _run_case(unit.case, unit.device, t0)
    except CaseTimeout as exc:
        return CaseOutcome(CaseResult(unit.case, "error", [str(exc)], "timeout", wall_s=time.perf_counter() - t0),
                           None)


def _check_hash(case: Case) -> None:
    """The trace is the file its manifest entry names (BadInput if not)."""
    if case.sha256 and content_hash(local_path(case.file)) != case.sha256:
        raise BadInput(f"{Path(case.file).name} is not the file the manifest names (sha256 differs)")


def _run_case(case: Case, device: str, t0: float) -> CaseOutcome:
    try:
        _check_hash(case)
        res = replay_and_store(case.file, case.build, store=False, mode=case.mode, device=device)
    except (FamilyMismatch, BuildUnsupported) as exc:  # another pool family, or a kind of pool the build lacks
        return CaseOutcome(CaseResult(case, "skip", [str(exc)], wall_s=time.perf_counter() - t0), None)
    except BadInput as exc:
        return CaseOutcome(CaseResult(case, "error", [str(exc)], wall_s=time.perf_counter() - t0), None)
    return _outcome(case, res)


def check_build(build: str) -> None:
    """The build spec, checked once before any case runs or anything is stored: a spec
    that names nothing (or a release that does not exist) is one error, not one per case."""
    from kvreplay.builds.git_tree import resolve_commit
    from kvreplay.builds.releases import check_release
    from kvreplay.builds.spec import BuildSpec

    spec = BuildSpec.parse(build)
    if spec.kind == "release":
        check_release(spec.engine, spec.version)
    elif spec.kind == "git":
        assert spec.repo is not None
        resolve_commit(spec.repo, spec.rev)  # no such repository or revision: BadInput


def run_corpus(corpus: str | Path, build: str, *, jobs: int = 1, db: str | None = None, device: str = "cpu",
               timeout_s: float | None = None, ray: str | None = None,
               progress: Callable[[CaseResult, int, int], None] | None = None) -> list[CaseResult]:
    """Every case of the corpus for ``build``: ``jobs`` at a time in worker processes,
    or as Ray tasks (``ray``: an address, "local" for an instance started here). Only
    this process writes to the store, one run per case, as each result comes in."""
    if jobs < 1:
        raise BadInput("-j must be at least 1")
    check_build(build)
    cases = plan(corpus, build)
    if not cases:
        raise BadInput(f"{corpus}: the manifest lists no traces")
    st = open_store(db) if db != "" else None  # created or migrated once, before any work
    results = []
    try:
        if ray is None and not BuildSpec.parse(build).in_process:
            # A release or a git tree: a worker imports the build once for many cases
            outcomes = _in_build_workers(cases, build, jobs, device, timeout_s)
        else:
            units = [CaseUnit(c, device, timeout_s) for c in cases]
            # Spawned, not forked, local workers: no torch state from this process in them.
            outcomes = iter_units(run_case, units, jobs=jobs, ray=ray, start_method="spawn", on_error=_errored)
        for done, out in enumerate(outcomes, 1):
            res = out.result
            if st is not None and out.replayed is not None:
                rep = out.replayed
                res.run_id = record_run(st, rep.report, rep.trace, build_version=rep.build_version)
            results.append(res)
            if progress:
                progress(res, done, len(cases))
    finally:
        if st is not None:
            st.close()
    order = {id(c): k for k, c in enumerate(cases)}  # a worker build's come as they finish
    return sorted(results, key=lambda r: order.get(id(r.case), len(order)))


def _in_build_workers(cases: list[Case], build: str, jobs: int, device: str,
                      timeout_s: float | None) -> Iterator[CaseOutcome]:
    """The cases of a worker build (a release, a git tree), each outcome as it comes in.

    Importing a release costs seconds to tens of seconds, more than most replays; a case
    per process imported it once per case. Here the cases are dealt to ``jobs`` lanes,
    and each lane replays its traces, each in its case's mode, in one worker (a fresh one
    after a crash or a timeout). What a case needs checked before it replays (its file, its
    calls) is checked here, as a case's own worker would."""
    early: list[CaseOutcome] = []  # cases that fail their checks before any worker
    ready = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            _check_hash(case)
            reader = TraceReader(case.file)
            reader.check_calls()
        except BadInput as exc:
            early.append(CaseOutcome(CaseResult(case, "error", [str(exc)], wall_s=time.perf_counter() - t0), None))
            continue
        ready.append((case, reader))
    lanes = [lane for lane in (ready[k::jobs] for k in range(jobs)) if lane]
    spec = BuildSpec.parse(build)

    def lane(todo: list[tuple[Case, TraceReader]], put: Callable[[CaseOutcome], None]) -> None:
        pending = list(todo)  # what the worker has not answered yet

        def answered(report: ReplayReport, code_id: str) -> None:
            k = next((k for k, (c, _) in enumerate(pending)
                      if as_sent(c.file) == report.trace and c.mode == report.mode), None)
            if k is not None:
                case, reader = pending.pop(k)
                put(_outcome(case, StoredReplay(report, None, spec.resolved(code_id=code_id), reader)))

        while pending:
            t0 = time.perf_counter()
            try:
                run_many([c.file for c, _ in pending], spec, answered, modes=[c.mode for c, _ in pending],
                         device=device, **({} if timeout_s is None else {"timeout_s": timeout_s}))
            except (FamilyMismatch, BuildUnsupported, BadInput) as exc:
                # said of the first trace the worker had not answered; the rest go on in a new one
                case, _ = pending.pop(0)
                skip = isinstance(exc, (FamilyMismatch, BuildUnsupported))  # as _run_case: another kind of pool
                put(CaseOutcome(CaseResult(case, "skip" if skip else "error", [str(exc)],
                                           wall_s=time.perf_counter() - t0), None))

    yield from early
    yield from iter_threads(lane, lanes, jobs=len(lanes))


def _outcome(case: Case, res: StoredReplay) -> CaseOutcome:
    """A case's outcome from its replay: its expectation held or not."""
    r = res.report
    if r.status == "timeout":
        return CaseOutcome(CaseResult(case, "error", [r.message or "timeout"], "timeout", wall_s=r.wall_s), None)
    if r.status == "unsupported" and case.expectation is None:
        # a worker build (a release, a git tree) says so in its report, where a build in this
        # process raises: either way the build lacks what the trace needs, and the case is skipped
        return CaseOutcome(CaseResult(case, "skip", [r.message or "the build cannot replay this trace"], r.status,
                                      wall_s=r.wall_s), None)
    if case.expectation is not None:
        problems = check_report(r, case.expectation)
    else:
        problems = [] if r.status == "clean" else [
            f"no manifest expectation for {case.build}, so it must replay clean; got {r.status} "
            f"(first: {describe(r.first_violation or r.first_divergence)})"]
    return CaseOutcome(CaseResult(case, "fail" if problems else "pass", problems, r.status, r.calls_replayed,
                                  r.wall_s), res)


def _errored(unit: CaseUnit, exc: BaseException) -> CaseOutcome:
    """A worker that died (or a Ray task that failed): that case errored, the others go on."""
    return CaseOutcome(CaseResult(unit.case, "error", [f"{type(exc).__name__}: {exc}"]), None)


def ok(results: list[CaseResult]) -> bool:
    return all(r.outcome in ("pass", "skip") for r in results)
