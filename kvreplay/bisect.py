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

from sqlalchemy import select

from kvreplay import __version__
from kvreplay.errors import BadInput, BuildUnloadable
from kvreplay.recorder.reader import TraceReader
from kvreplay.replayer.engine import UNTESTABLE, ReplayReport
from kvreplay.replayer.git_build import GitSpec, resolve_commit
from kvreplay.store.db import Store, open_store
from kvreplay.store.models import Build, Run, Trace
from kvreplay.store.runs import file_hash
from kvreplay.workflows import replay_and_store

CACHEABLE = frozenset({"clean", "violation", "divergence", "unloadable"})  # not crashed/timeout: may be flaky


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
    first_invariant: str | None = None
    first_divergence_kind: str | None = None

    @classmethod
    def of_report(cls, r: ReplayReport) -> Outcome:
        first, detail = _describe(r.first_violation, r.first_divergence, r.message)
        return cls(r.status, sorted({k.split("/")[0] for k in r.violation_counts}), sorted(r.divergence_counts),
                   first, detail, r.calls_replayed, r.first_violation.invariant if r.first_violation else None,
                   r.first_divergence.kind if r.first_divergence else None)

    @classmethod
    def of_run(cls, run: Run) -> Outcome:
        first, detail = _describe(run.violations[0] if run.violations else None,
                                  run.divergences[0] if run.divergences else None, run.message or "")
        return cls(run.status, sorted({k.split("/")[0] for k in run.violation_counts}),
                   sorted(run.divergence_counts), first, detail, run.calls_replayed,
                   run.violations[0].invariant if run.violations else None,
                   run.divergences[0].kind if run.divergences else None)


def _describe(v: Any, d: Any, message: str) -> tuple[str, str]:
    """(one short line, the full message) for a first violation, else a first divergence."""
    if v is not None:
        return f"{v.invariant}/{v.rule} at #{v.seq} {v.method}", v.message
    if d is not None:
        return f"{d.kind} divergence at #{d.seq} {d.method}", d.message
    return message.splitlines()[0] if message else "", message


@dataclass
class Target:
    """The failure a bad step must show: an invariant id, or a divergence kind."""

    kind: str  # violation | divergence
    id: str

    def shown_by(self, o: Outcome) -> bool:
        return self.id in (o.invariants if self.kind == "violation" else o.divergence_kinds)

    def __str__(self) -> str:
        return f"{self.id} {'violation' if self.kind == 'violation' else 'divergence'}"


@dataclass
class Step:
    index: int  # position in the search order
    label: str
    spec: str
    verdict: str  # good | bad | skip
    status: str
    why: str
    cached: bool
    wall_s: float


@dataclass
class BisectResult:
    trace: str
    target: Target | None
    verdict: str  # found | range | already-bad | no-failure
    first_bad: Candidate | None
    candidates: list[Candidate]  # the first bad is one of these (one when found)
    bad_shows: str  # the failure as the first bad build shows it
    bad_detail: str  # its message
    steps: list[Step] = field(default_factory=list)
    searched: int = 0  # builds in the search order

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


def _cacheable(spec: str) -> bool:
    if spec.startswith("git:"):
        rev = GitSpec.parse(spec).rev
        return len(rev) == 40 and all(ch in "0123456789abcdef" for ch in rev)
    return spec.startswith("builtin:")


class Prober:
    """Replays one trace on builds, through the store's cache."""

    def __init__(self, trace: str | Path, *, db: str | None, mode: str, device: str, timeout_s: float,
                 use_cache: bool = True) -> None:
        self.trace = str(trace)
        self.hash = file_hash(trace)
        self.db = db
        self.mode = mode
        self.device = device
        self.timeout_s = timeout_s
        self.use_cache = use_cache

    def cached(self, spec: str) -> Outcome | None:
        if not (self.use_cache and _cacheable(spec)):
            return None
        from sqlalchemy.orm import selectinload

        st: Store = open_store(self.db)
        try:
            with st.session() as s:
                q = (select(Run).join(Run.trace).join(Run.build)
                     .where(Trace.content_hash == self.hash, Build.spec == spec, Run.mode == self.mode,
                            Run.status.in_(CACHEABLE))
                     .options(selectinload(Run.violations), selectinload(Run.divergences))
                     .order_by(Run.id.desc()).limit(1))
                if spec.startswith("builtin:"):
                    q = q.where(Run.kvreplay_version == __version__)
                run = s.scalar(q)
                return Outcome.of_run(run) if run is not None else None
        finally:
            st.close()

    def probe(self, spec: str) -> tuple[Outcome, bool, float]:
        """(outcome, whether it came from the store, seconds spent)."""
        t0 = time.perf_counter()
        hit = self.cached(spec)
        if hit is not None:
            return hit, True, time.perf_counter() - t0
        try:
            stored = replay_and_store(self.trace, spec, db=self.db, mode=self.mode, device=self.device,
                                      timeout_s=self.timeout_s)
        except BuildUnloadable as exc:  # an in-process build (py:, sglang) that does not import
            return Outcome("unloadable", [], [], str(exc)), False, time.perf_counter() - t0
        return Outcome.of_report(stored.report), False, time.perf_counter() - t0


def _verdict(o: Outcome, target: Target) -> tuple[str, str]:
    if o.status == "clean":
        return "good", "clean"
    if o.status in UNTESTABLE:
        return "skip", f"{o.status}: {o.first}"
    if target.shown_by(o):
        return "bad", o.first
    return "skip", f"fails differently ({', '.join(o.invariants + o.divergence_kinds)}): {o.first}"


def target_of(o: Outcome) -> Target | None:
    """The failure at the bad end: its first violation's invariant, else its first divergence's kind."""
    if o.first_invariant:
        return Target("violation", o.first_invariant)
    if o.first_divergence_kind:
        return Target("divergence", o.first_divergence_kind)
    return None


def bisect(trace: str | Path, good: Candidate, order: list[Candidate], *, db: str | None = None,
           mode: str = "strict", device: str = "cpu", timeout_s: float = 1800.0, use_cache: bool = True,
           on_step: Callable[[Step, int], None] | None = None) -> BisectResult:
    """Binary search ``order`` (oldest first; ``good`` comes before it and is taken
    as good, like ``git bisect``) for the first build showing the failure of the last."""
    TraceReader(trace)  # a bad trace is a one-line error before any replay
    if not order:
        raise BadInput("nothing to bisect: no builds between good and bad")
    prober = Prober(trace, db=db, mode=mode, device=device, timeout_s=timeout_s, use_cache=use_cache)
    steps: list[Step] = []
    remaining = max(1, (len(order) - 1).bit_length())

    def run(i: int, cand: Candidate, target: Target | None) -> tuple[str, Outcome]:
        o, cached, wall = prober.probe(cand.spec)
        verdict, why = _verdict(o, target) if target else ("bad" if o.status in ("violation", "divergence")
                                                           else "good" if o.status == "clean" else "skip",
                                                           o.first or o.status)
        step = Step(i, cand.label, cand.spec, verdict, o.status, why, cached, wall)
        steps.append(step)
        if on_step is not None:
            on_step(step, remaining)
        return verdict, o

    n = len(order)
    verdict, bad_o = run(n - 1, order[-1], None)
    target = target_of(bad_o)
    if verdict != "bad" or target is None:
        why = "it replays clean there" if bad_o.status == "clean" else f"it could not be tested there ({bad_o.first})"
        raise BadInput(f"the bad end {order[-1].label} does not show a failure: {why}")
    shows = {n - 1: bad_o}
    lo, hi = -1, n - 1  # lo: last known good (-1 is --good), hi: first known bad
    skipped: set[int] = set()
    while hi - lo > 1:
        m = _next_probe(lo, hi, skipped)
        if m is None:
            break
        remaining = (hi - lo - 1 - len(skipped & set(range(lo + 1, hi)))).bit_length()
        v, o = run(m, order[m], target)
        if v == "good":
            lo = m
        elif v == "bad":
            hi, shows[m] = m, o
        else:
            skipped.add(m)
    if hi - lo == 1 and lo == -1:
        # Everything tested was bad: make sure --good really is good before blaming the first.
        v, o = run(-1, good, target)
        if v == "bad":
            return BisectResult(str(trace), target, "already-bad", None, [], o.first, o.detail, steps, n)
    cands = order[lo + 1:hi + 1]
    verdict = "found" if len(cands) == 1 else "range"
    return BisectResult(str(trace), target, verdict, order[hi] if verdict == "found" else None, cands,
                        shows[hi].first, shows[hi].detail, steps, n)


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


__all__ = ["BisectResult", "Candidate", "Outcome", "Step", "Target", "bisect", "build_candidates",
           "first_parent_commits", "git_candidates"]
