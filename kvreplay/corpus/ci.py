"""``kvreplay ci``: replay a saved corpus against one build and hold it to the manifest.

Each (trace, expectation, mode) the manifest lists for the build is a case; a trace
with no expectation for the build must replay clean, and one of another pool family
is skipped. Cases run in parallel worker processes and every run is stored. A case
passes only when its expectation holds: a known-bad case that replays clean fails,
because it means the checker lost its teeth. Results render as JUnit XML and as a
Markdown summary a CI job can post (render.py)."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.corpus.expectations import check_report
from kvreplay.corpus.manifest import Expectation, load_manifest
from kvreplay.errors import BadInput, FamilyMismatch
from kvreplay.replay.report import describe
from kvreplay.store.db import open_store
from kvreplay.stored_replay import replay_and_store
from kvreplay.trace.hashing import content_hash


@dataclass
class Case:
    trace: str  # corpus entry name
    file: str
    sha256: str
    build: str
    mode: str
    expectation: Expectation | None  # None: no entry for this build, so it must be clean

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
                     "expected": self.case.expected()}
        return d


def plan(corpus: str | Path, build: str) -> list[Case]:
    cases = []
    for e in load_manifest(corpus):
        exps = [x for x in e.expect if x.build == build]
        for x in exps or [None]:
            for mode in (x.modes if x else ["strict"]):
                cases.append(Case(e.name, str(e.file), e.sha256, build, mode, x))
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


def run_case(case: Case, db: str | None = None, device: str = "cpu", timeout_s: float | None = None) -> CaseResult:
    """One case, in this process (the worker's entry point), within ``timeout_s``."""
    t0 = time.perf_counter()
    try:
        with _time_limit(timeout_s):
            return _run_case(case, db, device, t0)
    except CaseTimeout as exc:
        return CaseResult(case, "error", [str(exc)], "timeout", wall_s=time.perf_counter() - t0)


def _run_case(case: Case, db: str | None, device: str, t0: float) -> CaseResult:
    try:
        if content_hash(case.file) != case.sha256:
            raise BadInput(f"{Path(case.file).name} is not the file the manifest names (sha256 differs)")
        res = replay_and_store(case.file, case.build, db=db, store=db != "", mode=case.mode, device=device)
    except FamilyMismatch as exc:  # another pool family: not this build's trace
        return CaseResult(case, "skip", [str(exc)], wall_s=time.perf_counter() - t0)
    except BadInput as exc:
        return CaseResult(case, "error", [str(exc)], wall_s=time.perf_counter() - t0)
    r = res.report
    if case.expectation is not None:
        problems = check_report(r, case.expectation)
    else:
        problems = [] if r.status == "clean" else [
            f"no manifest expectation for {case.build}, so it must replay clean; got {r.status} "
            f"(first: {describe(r.first_violation or r.first_divergence)})"]
    return CaseResult(case, "fail" if problems else "pass", problems, r.status, r.calls_replayed, r.wall_s,
                      res.run_id)


def run_corpus(corpus: str | Path, build: str, *, jobs: int = 1, db: str | None = None, device: str = "cpu",
               timeout_s: float | None = None,
               progress: Callable[[CaseResult, int, int], None] | None = None) -> list[CaseResult]:
    """Every case of the corpus for ``build``, ``jobs`` at a time in worker processes."""
    cases = plan(corpus, build)
    if not cases:
        raise BadInput(f"{corpus}: the manifest lists no traces")
    if jobs < 1:
        raise BadInput("-j must be at least 1")
    if db != "":
        # Create or migrate the database once, here: workers that all find it new
        # would race to create its schema.
        open_store(db).close()
    if jobs == 1:  # no worker processes to start: each one would import torch again
        results = []
        for done, case in enumerate(cases, 1):
            results.append(run_case(case, db, device, timeout_s))
            if progress:
                progress(results[-1], done, len(cases))
        return results
    slots: list[CaseResult | None] = [None] * len(cases)
    ctx = multiprocessing.get_context("spawn")  # no forked torch state in the workers
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(cases)), mp_context=ctx) as pool:
        futures = {pool.submit(run_case, c, db, device, timeout_s): i for i, c in enumerate(cases)}
        for done, fut in enumerate(cf.as_completed(futures), 1):
            i = futures[fut]
            try:
                res = fut.result()
            except Exception as exc:  # a worker died: that case errored, the others go on
                res = CaseResult(cases[i], "error", [f"{type(exc).__name__}: {exc}"])
            slots[i] = res
            if progress:
                progress(res, done, len(cases))
    return [r for r in slots if r is not None]


def ok(results: list[CaseResult]) -> bool:
    return all(r.outcome in ("pass", "skip") for r in results)
