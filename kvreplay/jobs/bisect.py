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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvreplay.builds.git_tree import resolve_commit
from kvreplay.builds.releases import expand_all
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


@dataclass(frozen=True)
class BisectOptions:
    """How each step of a bisect replays: into (and, ``use_cache``, from) the store at
    ``db``, in ``mode`` on ``device``, a git: build given ``timeout_s``, each replay's
    segments on ``jobs`` workers or on Ray."""

    db: str | None = None
    mode: str = "strict"
    device: str = "cpu"
    timeout_s: float = 1800.0
    use_cache: bool = True
    jobs: int = 1
    ray: str | None = None


def bisect(trace: str | Path, good: Candidate, order: list[Candidate], options: BisectOptions | None = None, *,
           failure: Failure | None = None, fixed: bool = False, on_step: Callable[[Step, int], None] | None = None,
           **option_values: Any) -> BisectResult:
    """Binary search ``order`` (oldest first; ``good``, the old end, comes before it)
    for the first build showing the failure (``failure``, else the one the bad end
    shows first), as ``git bisect`` does. With ``fixed``, the old end must show the
    failure and the new end must not, and the search is for the first build where it
    is gone (git's --term-old/--term-new). Each step replays as ``options`` says; its
    fields may be given by name instead (``db=``, ``mode=``, ``device=``, ...)."""
    opts = replace(options or BisectOptions(), **option_values)
    TraceReader(trace)  # a bad trace is a one-line error before any replay
    if not order:
        raise BadInput("nothing to bisect: no builds between the two ends")
    search = _Search(Prober(trace, **asdict(opts)), str(trace), good, order, fixed, on_step)
    target = search.check_ends(failure)
    lo, hi = search.narrow(target)
    return search.old_end_disproved(target, lo, hi) or search.result(target, lo, hi)


class _Search:
    """One bisect under way: the builds of ``order`` (``good``, the old end, at index -1)
    probed one step at a time, the step log, and the outcome of each index that took a side."""

    def __init__(self, prober: Prober, trace: str, good: Candidate, order: list[Candidate], fixed: bool,
                 on_step: Callable[[Step, int], None] | None) -> None:
        self.prober, self.trace, self.good, self.order = prober, trace, good, order
        self.fixed, self.on_step = fixed, on_step
        self.old, self.new = ("bad", "fixed") if fixed else ("good", "bad")  # the terms, as git's
        self.steps: list[Step] = []
        self.remaining = max(1, (len(order) - 1).bit_length())  # steps left, as each step's report says
        self.shows: dict[int, Outcome] = {}

    def run(self, i: int, cand: Candidate, target: Failure | None) -> tuple[str, Outcome]:
        o, cached, wall = self.prober.probe(cand.spec)
        if target is None:  # an end that names the target: does it fail at all?
            failing = o.status in ("violation", "divergence")
            verdict = ("bad" if failing else self.old if o.status == "clean" else "skip") if not self.fixed else \
                      ("bad" if failing else "skip")
            why = o.first or o.status
        else:
            verdict, why = _verdict(o, target, self.fixed)
        step = Step(i, cand.label, cand.spec, verdict, o.status, why, cached, wall)
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step, self.remaining)
        return verdict, o

    def check_ends(self, failure: Failure | None) -> Failure:
        """The failure to follow, once the failing end is seen to show it (and, with
        --fixed, the new end not to); BadInput when an end does not hold."""
        n, fixed = len(self.order), self.fixed
        failing_end = self.good if fixed else self.order[-1]
        if fixed and failure is not None:
            # Looking for the fix of a named failure: the old end is taken as broken, as
            # --good is taken as good (it may predate the API the failure needs).
            verdict, end_o, target = "bad", Outcome("violation", [], [], str(failure)), failure
        else:
            verdict, end_o = self.run(-1 if fixed else n - 1, failing_end, failure)
            target = failure or end_o.failure
        if verdict != "bad" or target is None:
            why = ("it replays clean there" if end_o.status == "clean"
                   else f"it could not be tested there ({end_o.first})" if end_o.status in UNTESTABLE
                   else f"it shows no {failure} there ({end_o.first})")
            which = "old end" if fixed else "bad end"
            raise BadInput(f"the {which} {failing_end.label} does not show the failure: {why}")
        self.shows[-1 if fixed else n - 1] = end_o
        if fixed:
            v, o = self.run(n - 1, self.order[-1], target)
            if v != "fixed":
                raise BadInput(f"the new end {self.order[-1].label} " + ("still shows " + str(target) +
                               f": {o.shows(target)}" if v == "bad" else f"could not be tested ({o.first})"))
            self.shows[n - 1] = o
        return target

    def narrow(self, target: Failure) -> tuple[int, int]:
        """(lo, hi): lo the last build known on the old side (-1 is --good), hi the first
        known on the new side, as near each other as the skips let them come."""
        lo, hi = -1, len(self.order) - 1
        skipped: set[int] = set()
        while hi - lo > 1:
            m = _next_probe(lo, hi, skipped)
            if m is None:
                break
            self.remaining = (hi - lo - 1 - len(skipped & set(range(lo + 1, hi)))).bit_length()
            v, o = self.run(m, self.order[m], target)
            if v == self.old:
                lo, self.shows[m] = m, o
            elif v == self.new:
                hi, self.shows[m] = m, o
            else:
                skipped.add(m)
        return lo, hi

    def old_end_disproved(self, target: Failure, lo: int, hi: int) -> BisectResult | None:
        """Where every build tested took the new side, the old end is probed too: the
        result when it is on the new side as well (nothing to look for), else None."""
        if hi - lo != 1 or lo != -1:
            return None
        n = len(self.order)
        if not self.fixed:
            # Everything tested was bad: make sure --good really is good before blaming the first.
            v, o = self.run(-1, self.good, target)
            if v == "bad":
                return BisectResult(self.trace, target, "already-bad", None, [], o.shows(target), o.detail,
                                    self.steps, n)
        elif -1 not in {st.index for st in self.steps}:
            # Everything tested was fixed: make sure the old end really shows the failure.
            v, o = self.run(-1, self.good, target)
            if v == "fixed":
                return BisectResult(self.trace, target, "already-fixed", None, [], o.first, o.detail, self.steps, n,
                                    True)
            if v == "bad":
                self.shows[-1] = o
        return None

    def result(self, target: Failure, lo: int, hi: int) -> BisectResult:
        cands = self.order[lo + 1:hi + 1]
        verdict = "found" if len(cands) == 1 else "range"
        shown = self.shows[lo if self.fixed else hi]  # an end's outcome, from check_ends, until a step took its side
        return BisectResult(self.trace, target, verdict, self.order[hi] if verdict == "found" else None, cands,
                            shown.shows(target), shown.detail_of(target), self.steps, len(self.order), self.fixed)


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


def search_order(builds: str | None, repo: str | Path | None, good: str | None, bad: str | None,
                 cls: str = "") -> tuple[Candidate, list[Candidate]]:
    """(the old end, the builds to search) as bisect's command line names them: ``builds``
    (comma-separated specs, oldest first, release ranges expanded), else the commits of
    ``repo`` after ``good`` up to ``bad`` (default HEAD)."""
    if builds:
        return build_candidates(expand_all([b.strip() for b in builds.split(",") if b.strip()]))
    if repo is None or good is None:
        raise BadInput("bisect needs --repo PATH --good REV [--bad REV], or --builds A,B,...")
    return git_candidates(repo, good, bad or "HEAD", cls)


__all__ = ["BisectOptions", "BisectResult", "Candidate", "Outcome", "Step", "bisect", "build_candidates",
           "first_parent_commits", "git_candidates", "search_order"]
