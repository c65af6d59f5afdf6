"""Commands that search: bisect (which change broke or fixed a trace) and minimize
(the smallest trace that still fails)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvreplay.cli.base import (
    DB_HELP,
    JOBS,
    JOBS_HELP,
    JSON_HELP,
    RAY_HELP,
    TIMEOUT_S,
    URI_HELP,
    app,
    emit_json,
    say,
)
from kvreplay.errors import KvreplayError

if TYPE_CHECKING:
    from kvreplay.jobs.bisect import BisectResult, Candidate, Step


# Options are declared here, once, so each command's signature is a list of what it takes,
# one line each (as defaults, not Annotated: tests/test_hostile_config.py finds a numeric
# option's bound on its default).
AS_JSON = typer.Option(False, "--json", help=JSON_HELP)

# -- bisect's options ------------------------------------------------------------------------
BAD_TRACE = typer.Argument(..., help="Trace file (Parquet) that fails at the bad end." + URI_HELP)
REPO = typer.Option(None, "--repo", help="Git repository of the pool code.")
GOOD = typer.Option(None, "--good", help="A revision where the trace replays clean.")
BAD = typer.Option(None, "--bad", help="A later revision where it fails (default HEAD).")
POOL_CLASS = typer.Option("", "--class", help="MODULE:CLASS of the pool in the repository (default: the "
                          "tree's sglang allocator for the trace's family).")
BUILDS = typer.Option(None, "--builds", help="Instead of a repository: build specs in order, "
                      "oldest first, e.g. builtin:swa,builtin:swa@stale-tail or a release "
                      "range sglang==0.5.11..0.5.23 or vllm==0.26.0..0.32.0.")
FIXED = typer.Option(False, "--fixed", help="Look for the fix: the old end shows the failure, the new "
                     "end does not; name the first build (or commit) where it is gone.")
FAILURE = typer.Option(None, "--failure", help="The failure to follow: an invariant, "
                       "invariant/rule (that rule only) or divergence kind (default: the first "
                       "failure the failing end shows).")
STEP_MODE = typer.Option("strict", help="Replay mode for every step (strict or remap).")
STEP_DEVICE = typer.Option("auto", help="auto, cpu or cuda[:N].")
STEP_TIMEOUT = typer.Option(1800.0, "--timeout", callback=TIMEOUT_S,
                            help="A git: step running longer is a timeout (skipped).")
NO_CACHE = typer.Option(False, "--no-cache", help="Replay every step even when the store has it.")
DB = typer.Option(None, "--db", help=DB_HELP)
STEP_JOBS = typer.Option(1, "--jobs", "-j", callback=JOBS, help="Each step: " + JOBS_HELP[0].lower() + JOBS_HELP[1:])
STEP_RAY = typer.Option(None, "--ray", help="Each step's replay on Ray. " + RAY_HELP, metavar="[ADDRESS]")
STEP_LOG_REPORT = typer.Option(None, "--report", help="Also write an HTML page of the step log "
                               "here: the builds in search order, good, bad or skipped.")


@app.command("bisect")
def bisect_cmd(
    trace: str = BAD_TRACE,
    repo: Path | None = REPO,
    good: str | None = GOOD,
    bad: str | None = BAD,
    cls: str = POOL_CLASS,
    builds: str | None = BUILDS,
    fixed: bool = FIXED,
    failure: str | None = FAILURE,
    mode: str = STEP_MODE,
    device: str = STEP_DEVICE,
    timeout: float = STEP_TIMEOUT,
    no_cache: bool = NO_CACHE,
    db: str | None = DB,
    jobs: int = STEP_JOBS,
    ray: str | None = STEP_RAY,
    report_path: Path | None = STEP_LOG_REPORT,
    as_json: bool = AS_JSON,
) -> None:
    """Find the first commit (or build) where a trace starts failing, or
    with --fixed where it stops.

    Binary search over the first-parent commits after --good up to --bad,
    each replayed as a git: build in its own process, or over --builds
    (release ranges expand to every release in them). A step is good when
    clean, bad when it shows the failure (--failure, else the one the bad
    end shows first), and skipped when it cannot be tested (unloadable,
    unsupported, crashed, timeout) or fails differently. With --fixed the
    old end (--good, or the first of --builds) must show the failure, and
    a step is fixed as soon as the failure is gone. Results are stored,
    so bisecting the same trace again replays nothing it has seen.

    Exit 0 when the first bad (or fixed) build, or a range when skips
    hide it, is named; 1 when --good already fails; 2 on bad input.
    """
    from kvreplay.jobs.bisect import BisectOptions, bisect, search_order
    from kvreplay.replay.report import Failure
    from kvreplay.report.reports import bisect_report, check_report_path, write_report

    if report_path is not None:
        check_report_path(report_path)
    if builds and repo:
        raise KvreplayError("give --repo/--good/--bad or --builds, not both")
    target = Failure.parse(failure) if failure else None
    good_c, order = search_order(builds, repo, good, bad, cls)
    say(f"bisecting {Path(trace).name} over {len(order)} build(s) after {good_c.label}", to_err=True)
    options = BisectOptions(db=db, mode=mode, device=device, timeout_s=timeout, use_cache=not no_cache, jobs=jobs,
                            ray=ray)
    res = bisect(trace, good_c, order, options, failure=target, fixed=fixed, on_step=_say_step)
    if report_path is not None:
        write_report(bisect_report(res.to_dict()), report_path)
        say(f"report: {report_path}", to_err=True)
    if as_json:
        emit_json(res.to_dict())
    else:
        _say_bisect(res, good_c, order, fixed)
    raise typer.Exit(res.exit_code)


def _say_step(step: Step, left: int) -> None:
    src = "stored" if step.cached else f"{step.wall_s:.1f} s"
    say(f"  {step.label:<14} {step.verdict:<5} {step.why}  ({src}; ~{left} step(s) left)", to_err=True)


def _say_bisect(res: BisectResult, good_c: Candidate, order: list[Candidate], fixed: bool) -> None:
    """The verdict, then the step log."""
    what = "commit" if order[0].commit else "build"
    term = "fixed" if fixed else "bad"
    if res.verdict == "found":
        say(f"first {term} {what}: {res.first_bad.describe()}")
        say(f"  {'the build before it shows' if fixed else 'shows'} {res.bad_shows}")
        if res.bad_detail:
            say(f"  {res.bad_detail}")
    elif res.verdict == "range":
        say(f"the first {term} {what} is one of these (skipped steps hide which):")
        for c in res.candidates:
            say(f"  {c.describe()}")
    elif res.verdict == "already-fixed":
        say(f"the old end {good_c.label} does not show {res.target} either: nothing to look for ({res.bad_shows})")
    else:
        say(f"--good {good_c.label} already shows the failure: {res.bad_shows}")
    say("step log:")
    for st in res.steps:
        src = "store" if st.cached else f"{st.wall_s:.1f} s"
        say(f"  {st.label:<14} {st.verdict:<5} {st.why} ({src})")
    skips = sum(st.verdict == "skip" for st in res.steps)
    say(f"{len(res.steps)} steps over {res.searched} {what}s: {res.replays} replays, "
        f"{len(res.steps) - res.replays} from the store, {skips} skipped")


@app.command()
def minimize(
    trace: str = typer.Argument(..., help="Trace file (Parquet) that fails on --build." + URI_HELP),
    build: str = typer.Option(..., "--build", "-b", help="The build it fails on (builtin:, py: or sglang)."),
    out_path: str = typer.Option(..., "-o", "--out", help="Minimal trace to write (Parquet): a path or a URI."),
    emit_test: Path | None = typer.Option(None, "--emit-test", help="Also write a standalone pytest reproducer."),
    invariant: str | None = typer.Option(None, "--invariant", help="Keep this invariant's failure, or with "
                                         "invariant/rule that rule's (default: the first failure the trace "
                                         "shows)."),
    reference: str = typer.Option("auto", "--reference", help="A build every candidate must stay clean on, so the "
                                  "result shows the bug and not a misuse of the API (auto: a builtin variant's "
                                  "base pool; none: no such check)."),
    timeout: float | None = typer.Option(None, "--timeout", callback=TIMEOUT_S,
                                         help="Stop after this many seconds and write the "
                                         "smallest trace found so far."),
    device: str = typer.Option("cpu", help="Torch device for the candidate replays."),
    as_json: bool = AS_JSON,
) -> None:
    """Shrink a failing trace to a few calls that still fail the same way.

    Keeps the failure (same invariant on the same kind of method, or the
    same divergence kind) while removing calls by delta debugging.
    Removing an allocation removes the calls that name its slots; free
    groups stay balanced; the result is re-recorded on the build, so it
    replays strict. --emit-test writes a pytest file that builds the pool,
    makes the calls and asserts the invariant; run it on another build
    with KVREPLAY_BUILD=... Exit 0 when written, 2 on bad input (e.g. a
    clean trace).
    """
    from kvreplay.jobs.minimize import minimize as run_minimize

    def progress(size: int, tests: int, elapsed: float) -> None:
        if not as_json:
            say(f"  {size} calls  ({tests} candidates tried, {elapsed:.1f} s)", to_err=True)

    if invariant is not None:
        from kvreplay.check.rules import INVARIANTS, RULES
        from kvreplay.errors import one_of

        one_of("invariant", invariant, [*INVARIANTS, *RULES] if "/" in invariant else INVARIANTS)
    res = run_minimize(trace, build, out_path, invariant=invariant,
                       reference=None if reference == "none" else reference, emit_test=emit_test,
                       timeout_s=timeout, device=device, progress=progress)
    if as_json:
        emit_json(res.to_dict())
        raise typer.Exit(0)
    stop = " (stopped at --timeout)" if res.timed_out else ""
    say(f"{res.calls_before} -> {res.calls_after} calls in {res.wall_s:.1f} s, {res.tests} candidates{stop}")
    say(f"kept: {res.failure}" + (f", clean on {res.reference}" if res.reference else ""))
    say(f"wrote {res.out}: on {build} it shows {res.shows}")
    if res.test_file:
        say(f"wrote {res.test_file}: pytest {res.test_file}  (another build: KVREPLAY_BUILD=... pytest ...)")
    raise typer.Exit(0)
