"""Find the first build that breaks a trace: binary search over a repository's
first-parent commits (each one a ``git:`` build replayed in its own worker) or over
an ordered list of any build specs.

A step's verdict follows ``git bisect run``: *good* when the replay is clean, *bad*
when it shows the failure seen at the bad end (the same invariant, or for a trace
with no violation there, the same divergence kind), *skip* when the build could not
be tested (unloadable, crashed, timeout) or failed in some other way. Skips next to
the culprit leave a candidate range instead of one commit.

Each outcome is stored as a run, and a build that names its code exactly (a ``git:``
build at a full commit, a ``builtin:`` build of this kvreplay version) is looked up
there first, so bisecting the same trace again replays nothing it has seen."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.builds.git_tree import resolve_commit
from kvreplay.builds.spec import BuildSpec
from kvreplay.errors import BadInput, BuildUnloadable
from kvreplay.jobs.stored_replay import replay_and_store
from kvreplay.replay.report import UNTESTABLE, Failure, ReplayReport, describe, firsts_by_rule, invariant_ids
from kvreplay.store.db import open_store
from kvreplay.store.models import Run
from kvreplay.store.runs import reusable_run
from kvreplay.trace.hashing import content_hash
from kvreplay.trace.location import local_path
from kvreplay.trace.reader import TraceReader


@dataclass
class Candidate:
    """One build in the search order: a commit, or a spec from ``--builds``."""

    spec: str
    label: str  # short hash, or the spec itself
    commit: str = ""
    subject: str = ""
    author_date: str = ""

    def describe(self) -> str:
        if self.commit:
            return f"{self.commit[:12]} {self.subject} ({self.author_date})"
        return self.spec


@dataclass
class Outcome:
    """What one replay showed, from a fresh report or a stored run."""

    status: str
    invariants: list[str]  # invariant ids with at least one violation
    divergence_kinds: list[str]
    first: str  # one line: the first violation or divergence, or why it could not run
    detail: str = ""  # that violation's or divergence's message
    calls_replayed: int = 0
    failure: Failure | None = None  # the failure it shows first
    rules: list[str] = field(default_factory=list)  # invariant/rule with at least one violation
    # invariant/rule (or divergence kind) -> its first violation (divergence): one line, and its message
    firsts: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_report(cls, r: ReplayReport) -> Outcome:
        item = r.first_violation or r.first_divergence
        firsts = firsts_by_rule(r.violations)
        for d in [r.first_divergence, *r.divergences]:
            if d is not None:
                firsts.setdefault(d.kind, d)
        return cls(r.status, r.invariants, r.divergence_kinds, *_first(item, r.message), r.calls_replayed,
                   Failure.first_in(r), r.rules, *_firsts(firsts))

    @classmethod
    def of_run(cls, run: Run) -> Outcome:
        item = run.violations[0] if run.violations else run.divergences[0] if run.divergences else None
        failure = None
        if item is not None:
            failure = Failure("violation", item.invariant) if run.violations else Failure("divergence", item.kind)
        firsts = firsts_by_rule(run.violations)
        for d in run.divergences:
            firsts.setdefault(d.kind, d)
        return cls(run.status, invariant_ids(run.violation_counts),
                   sorted(run.divergence_counts), *_first(item, run.message or ""), run.calls_replayed, failure,
                   sorted(run.violation_counts), *_firsts(firsts))

    @staticmethod
    def _key(target: Failure) -> str | None:
        # a violation of any rule of an invariant is the outcome's first one
        if target.rule is not None:
            return f"{target.id}/{target.rule}"
        return target.id if target.kind == "divergence" else None

    def detail_of(self, target: Failure) -> str:
        """The message of the target failure's first instance here."""
        return self.details.get(self._key(target) or "", self.detail)

    def shows(self, target: Failure) -> str:
        """One line for the target failure as this outcome shows it: a followed
        divergence is named even where a violation came first."""
        return self.firsts.get(self._key(target) or "", self.first)


def _firsts(firsts: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    return ({k: describe(v) for k, v in firsts.items()},
            {k: str(v["message"] if isinstance(v, dict) else getattr(v, "message", "")) for k, v in firsts.items()})


def _first(item: object, message: str) -> tuple[str, str]:
    """(one short line, the full message) for a first violation or divergence, else why."""
    if item is not None:
        return describe(item), str(getattr(item, "message", ""))
    return message.splitlines()[0] if message else "", message


@dataclass
class Step:
    index: int  # position in the search order
    label: str
    spec: str
    verdict: str  # good | bad | skip; with --fixed: bad | fixed | skip
    status: str
    why: str
    cached: bool
    wall_s: float


@dataclass
class BisectResult:
    trace: str
    target: Failure | None
    verdict: str  # found | range | already-bad | already-fixed (--fixed)
    first_bad: Candidate | None  # the first build showing the failure (with --fixed: the first without it)
    candidates: list[Candidate]  # the first bad is one of these (one when found)
    bad_shows: str  # the failure as the first bad build shows it
    bad_detail: str  # its message
    steps: list[Step] = field(default_factory=list)
    searched: int = 0  # builds in the search order
    fixed: bool = False  # searched for the fix: the old end fails, the new end does not

    @property
    def replays(self) -> int:
        return sum(not s.cached for s in self.steps)

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict in ("found", "range") else 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target"] = asdict(self.target) if self.target else None
        d["replays"] = self.replays
        d["exit_code"] = self.exit_code
        return d


def first_parent_commits(repo: Path, good: str, bad: str) -> list[Candidate]:
    """The commits after ``good`` up to and including ``bad`` on bad's first-parent
    line, oldest first."""
    good_c, bad_c = resolve_commit(repo, good), resolve_commit(repo, bad)
    if good_c == bad_c:
        raise BadInput(f"--good {good} and --bad {bad} are the same commit")
    try:
        out = subprocess.run(["git", "-C", str(repo), "log", "--first-parent", "--format=%H%x00%s%x00%aI", bad_c],
                             capture_output=True, text=True, check=True, timeout=600).stdout
    except subprocess.CalledProcessError as exc:
        raise BadInput(f"git log in {repo}: {exc.stderr.strip().splitlines()[-1:]}") from None
    found: list[Candidate] = []
    for line in out.splitlines():
        commit, subject, date = line.split("\0")
        if commit == good_c:
            return found[::-1]
        found.append(Candidate(spec="", label=commit[:12], commit=commit, subject=subject, author_date=date))
    raise BadInput(f"--good {good} ({good_c[:12]}) is not on the first-parent history of --bad {bad}")


def git_candidates(repo: str | Path, good: str, bad: str, cls: str = "") -> tuple[Candidate, list[Candidate]]:
    """(the good commit, the commits to search) as ``git:`` build specs."""
    path = Path(repo).expanduser().resolve()
    if not (path / ".git").exists() and not path.joinpath("HEAD").exists():
        raise BadInput(f"{repo}: not a git repository")
    if cls and ":" not in cls:
        raise BadInput(f"--class {cls!r}: expected MODULE:CLASS")
    suffix = f":{cls}" if cls else ""
    commits = first_parent_commits(path, good, bad)
    for c in commits:
        c.spec = f"git:{path}@{c.commit}{suffix}"
    g = resolve_commit(path, good)
    good_c = Candidate(spec=f"git:{path}@{g}{suffix}", label=g[:12], commit=g,
                       subject=_git_subject(path, g), author_date="")
    return good_c, commits


def _git_subject(repo: Path, commit: str) -> str:
    res = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%s", commit], capture_output=True,
                         text=True, timeout=60)
    return res.stdout.strip()


class Prober:
    """Replays one trace on builds, through the store's cache."""

    def __init__(self, trace: str | Path, *, db: str | None, mode: str, device: str, timeout_s: float,
                 use_cache: bool = True, jobs: int = 1, ray: str | None = None) -> None:
        self.trace = str(trace)
        self.hash = content_hash(local_path(trace))
        self.db = db
        self.mode = mode
        self.device = device
        self.timeout_s = timeout_s
        self.use_cache = use_cache
        self.jobs, self.ray = jobs, ray  # each step's replay: segments in parallel, or on Ray

    def cached(self, spec: str | BuildSpec) -> Outcome | None:
        """A stored run that may stand in for this step's replay (store/runs.py's rule)."""
        parsed = spec if isinstance(spec, BuildSpec) else BuildSpec.parse(spec)
        if not (self.use_cache and parsed.exact):
            return None
        st = open_store(self.db)
        try:
            run = reusable_run(st, self.hash, parsed, self.mode)
            return Outcome.of_run(run) if run is not None else None
        finally:
            st.close()

    def probe(self, spec: str) -> tuple[Outcome, bool, float]:
        """(outcome, whether it came from the store, seconds spent)."""
        t0 = time.perf_counter()
        parsed = BuildSpec.parse(spec)  # once per step, handed to the cache and the replay
        hit = self.cached(parsed)
        if hit is not None:
            return hit, True, time.perf_counter() - t0
        try:
            stored = replay_and_store(self.trace, parsed, db=self.db, mode=self.mode, device=self.device,
                                      timeout_s=self.timeout_s, jobs=self.jobs, ray=self.ray)
        except BuildUnloadable as exc:  # an in-process build (py:, sglang) that does not import
            return Outcome("unloadable", [], [], str(exc)), False, time.perf_counter() - t0
        return Outcome.of_report(stored.report), False, time.perf_counter() - t0


def _verdict(o: Outcome, target: Failure, fixed: bool) -> tuple[str, str]:
    """(good | bad | skip, why); with ``fixed``: (bad | fixed | skip, why). Looking
    for a break, a build is good only when clean; looking for a fix, a build is fixed
    once the target is gone, whatever else it shows."""
    if o.status in UNTESTABLE:
        return "skip", f"{o.status}: {o.first}"
    shown = target.shown_by(o)
    if fixed:
        if shown:
            return "bad", o.shows(target)
        others = ", ".join(o.rules or o.divergence_kinds)
        return "fixed", "clean" if o.status == "clean" else f"no {target}; shows {others}"
    if o.status == "clean":
        return "good", "clean"
    if shown:
        return "bad", o.shows(target)
    return "skip", f"fails differently ({', '.join(o.invariants + o.divergence_kinds)}): {o.first}"


def bisect(trace: str | Path, good: Candidate, order: list[Candidate], *, db: str | None = None,
           mode: str = "strict", device: str = "cpu", timeout_s: float = 1800.0, use_cache: bool = True,
           failure: Failure | None = None, fixed: bool = False, jobs: int = 1, ray: str | None = None,
           on_step: Callable[[Step, int], None] | None = None) -> BisectResult:
    """Binary search ``order`` (oldest first; ``good``, the old end, comes before it)
    for the first build showing the failure (``failure``, else the one the bad end
    shows first), as ``git bisect`` does. With ``fixed``, the old end must show the
    failure and the new end must not, and the search is for the first build where it
    is gone (git's --term-old/--term-new)."""
    TraceReader(trace)  # a bad trace is a one-line error before any replay
    if not order:
        raise BadInput("nothing to bisect: no builds between the two ends")
    prober = Prober(trace, db=db, mode=mode, device=device, timeout_s=timeout_s, use_cache=use_cache, jobs=jobs,
                    ray=ray)
    steps: list[Step] = []
    remaining = max(1, (len(order) - 1).bit_length())
    old, new = ("bad", "fixed") if fixed else ("good", "bad")

    def run(i: int, cand: Candidate, target: Failure | None) -> tuple[str, Outcome]:
        o, cached, wall = prober.probe(cand.spec)
        if target is None:  # an end that names the target: does it fail at all?
            failing = o.status in ("violation", "divergence")
            verdict = ("bad" if failing else old if o.status == "clean" else "skip") if not fixed else \
                      ("bad" if failing else "skip")
            why = o.first or o.status
        else:
            verdict, why = _verdict(o, target, fixed)
        step = Step(i, cand.label, cand.spec, verdict, o.status, why, cached, wall)
        steps.append(step)
        if on_step is not None:
            on_step(step, remaining)
        return verdict, o

    n = len(order)
    failing_end, failing_label = (good, good.label) if fixed else (order[-1], order[-1].label)
    if fixed and failure is not None:
        # Looking for the fix of a named failure: the old end is taken as broken, as
        # --good is taken as good (it may predate the API the failure needs).
        verdict, end_o, target = "bad", Outcome("violation", [], [], str(failure)), failure
    else:
        verdict, end_o = run(-1 if fixed else n - 1, failing_end, failure)
        target = failure or end_o.failure
    if verdict != "bad" or target is None:
        why = ("it replays clean there" if end_o.status == "clean" else f"it could not be tested there ({end_o.first})"
               if end_o.status in UNTESTABLE else f"it shows no {failure} there ({end_o.first})")
        which = "old end" if fixed else "bad end"
        raise BadInput(f"the {which} {failing_label} does not show the failure: {why}")
    shows = {(-1 if fixed else n - 1): end_o}
    if fixed:
        v, o = run(n - 1, order[-1], target)
        if v != "fixed":
            raise BadInput(f"the new end {order[-1].label} " + ("still shows " + str(target) + f": {o.shows(target)}"
                           if v == "bad" else f"could not be tested ({o.first})"))
        shows[n - 1] = o
    lo, hi = -1, n - 1  # lo: last known old-term build (-1 is --good), hi: first known new-term build
    skipped: set[int] = set()
    while hi - lo > 1:
        m = _next_probe(lo, hi, skipped)
        if m is None:
            break
        remaining = (hi - lo - 1 - len(skipped & set(range(lo + 1, hi)))).bit_length()
        v, o = run(m, order[m], target)
        if v == old:
            lo, shows[m] = m, o
        elif v == new:
            hi, shows[m] = m, o
        else:
            skipped.add(m)
    if hi - lo == 1 and lo == -1 and not fixed:
        # Everything tested was bad: make sure --good really is good before blaming the first.
        v, o = run(-1, good, target)
        if v == "bad":
            return BisectResult(str(trace), target, "already-bad", None, [], o.shows(target), o.detail, steps, n)
    if hi - lo == 1 and lo == -1 and fixed and -1 not in {st.index for st in steps}:
        # Everything tested was fixed: make sure the old end really shows the failure.
        v, o = run(-1, good, target)
        if v == "fixed":
            return BisectResult(str(trace), target, "already-fixed", None, [], o.first, o.detail, steps, n, True)
        if v == "bad":
            shows[-1] = o
    cands = order[lo + 1:hi + 1]
    verdict = "found" if len(cands) == 1 else "range"
    shown = shows[lo if fixed else hi] if (lo if fixed else hi) in shows else end_o
    return BisectResult(str(trace), target, verdict, order[hi] if verdict == "found" else None, cands,
                        shown.shows(target), shown.detail_of(target), steps, n, fixed)


def _next_probe(lo: int, hi: int, skipped: set[int]) -> int | None:
    """The untested index nearest the middle of (lo, hi), or None when only skips are left."""
    mid = (lo + hi) // 2
    for d in range(hi - lo):
        for m in (mid - d, mid + d):
            if lo < m < hi and m not in skipped:
                return m
    return None


def build_candidates(specs: list[str]) -> tuple[Candidate, list[Candidate]]:
    """``--builds A,B,C``: A is the good end, C the bad end."""
    specs = [s.strip() for s in specs if s.strip()]
    if len(specs) < 2:
        raise BadInput("--builds needs at least two specs, oldest (good) first, e.g. "
                       "--builds builtin:swa,builtin:swa@stale-tail")
    cands = [Candidate(spec=s, label=s) for s in specs]
    return cands[0], cands[1:]


__all__ = ["BisectResult", "Candidate", "Outcome", "Step", "bisect", "build_candidates",
           "first_parent_commits", "git_candidates"]
