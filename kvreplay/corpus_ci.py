"""``kvreplay ci``: replay a saved corpus against one build and hold it to the manifest.

Each (trace, expectation, mode) the manifest lists for the build is a case; a trace
with no expectation for the build must replay clean, and one of another pool family
is skipped. Cases run in parallel worker processes and every run is stored. A case
passes only when its expectation holds: a known-bad case that replays clean fails,
because it means the checker lost its teeth. Results render as JUnit XML and as a
Markdown summary a CI job can post."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput
from kvreplay.replayer.expectations import Expectation, check_report, load_manifest


@dataclass
class Case:
    trace: str  # corpus entry name
    file: str
    build: str
    mode: str
    expectation: Expectation | None  # None: no entry for this build, so it must be clean

    @property
    def name(self) -> str:
        return f"{self.trace}[{self.mode}]"

    def expected(self) -> str:
        x = self.expectation
        if x is None or x.status == "clean":
            return "clean"
        return "violation: " + ", ".join(v.describe() for v in x.violations)


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
                cases.append(Case(e.name, str(e.file), build, mode, x))
    return cases


def run_case(case: Case, db: str | None = None, device: str = "cpu") -> CaseResult:
    """One case, in this process (the worker's entry point)."""
    from kvreplay.workflows import replay_and_store

    t0 = time.perf_counter()
    try:
        res = replay_and_store(case.file, case.build, db=db, store=db != "", mode=case.mode, device=device)
    except BadInput as exc:
        if "pool but" in str(exc):  # another pool family: not this build's trace
            return CaseResult(case, "skip", [str(exc)], wall_s=time.perf_counter() - t0)
        return CaseResult(case, "error", [str(exc)], wall_s=time.perf_counter() - t0)
    r = res.report
    if case.expectation is not None:
        problems = check_report(r, case.expectation)
    else:
        problems = [] if r.status == "clean" else [
            f"no manifest expectation for {case.build}, so it must replay clean; got {r.status}"
            + (f" (first violation {r.first_violation.invariant}/{r.first_violation.rule} at #{r.first_violation.seq})"
               if r.first_violation else "")]
    return CaseResult(case, "fail" if problems else "pass", problems, r.status, r.calls_replayed, r.wall_s,
                      res.run_id)


def run_corpus(corpus: str | Path, build: str, *, jobs: int = 1, db: str | None = None, device: str = "cpu",
               progress: Callable[[CaseResult, int, int], None] | None = None) -> list[CaseResult]:
    """Every case of the corpus for ``build``, ``jobs`` at a time in worker processes."""
    cases = plan(corpus, build)
    if not cases:
        raise BadInput(f"{corpus}: the manifest lists no traces")
    if jobs < 1:
        raise BadInput("-j must be at least 1")
    if db != "":
        from kvreplay.store.db import open_store

        # Create or migrate the database once, here: workers that all find it new
        # would race to create its schema.
        open_store(db).close()
    results: list[CaseResult | None] = [None] * len(cases)
    ctx = multiprocessing.get_context("spawn")  # no forked torch state in the workers
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(cases)), mp_context=ctx) as pool:
        futures = {pool.submit(run_case, c, db, device): i for i, c in enumerate(cases)}
        for done, fut in enumerate(cf.as_completed(futures), 1):
            i = futures[fut]
            try:
                res = fut.result()
            except Exception as exc:  # a worker died: that case errored, the others go on
                res = CaseResult(cases[i], "error", [f"{type(exc).__name__}: {exc}"])
            results[i] = res
            if progress:
                progress(res, done, len(cases))
    return [r for r in results if r is not None]


def ok(results: list[CaseResult]) -> bool:
    return all(r.outcome in ("pass", "skip") for r in results)


def junit_xml(results: list[CaseResult], build: str) -> str:
    """JUnit XML: one testsuite per build, one testcase per trace and mode."""
    suite = ET.Element("testsuite", name=f"kvreplay {build}", tests=str(len(results)),
                       failures=str(sum(r.outcome == "fail" for r in results)),
                       errors=str(sum(r.outcome == "error" for r in results)),
                       skipped=str(sum(r.outcome == "skip" for r in results)),
                       time=f"{sum(r.wall_s for r in results):.3f}")
    for r in results:
        tc = ET.SubElement(suite, "testcase", classname=f"kvreplay.{build}", name=r.case.name, time=f"{r.wall_s:.3f}")
        if r.outcome in ("fail", "error"):
            el = ET.SubElement(tc, "failure" if r.outcome == "fail" else "error",
                               message=r.problems[0] if r.problems else r.outcome)
            el.text = f"expected {r.case.expected()}; replay status {r.status or 'none'}\n" + "\n".join(r.problems)
        elif r.outcome == "skip":
            ET.SubElement(tc, "skipped", message=r.problems[0] if r.problems else "skipped")
        ET.SubElement(tc, "system-out").text = f"{r.calls} calls, status {r.status}, run {r.run_id}"
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def markdown_summary(results: list[CaseResult], build: str) -> str:
    mark = {"pass": "✅", "fail": "❌", "error": "💥", "skip": "⏭️"}
    n = {k: sum(r.outcome == k for r in results) for k in mark}
    lines = [f"### kvreplay corpus on `{build}`: {'all expectations hold' if ok(results) else 'FAILED'}", "",
             f"{n['pass']} passed, {n['fail']} failed, {n['error']} errors, {n['skip']} skipped", "",
             "| | trace | mode | expected | got | calls |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {mark[r.outcome]} | {r.case.trace} | {r.case.mode} | {r.case.expected()} | "
                     f"{r.status or '-'} | {r.calls} |")
    bad = [r for r in results if r.outcome in ("fail", "error")]
    if bad:
        lines += ["", "**What did not hold:**", ""]
        lines += [f"- {r.case.name}: {p}" for r in bad for p in r.problems]
    return "\n".join(lines) + "\n"
