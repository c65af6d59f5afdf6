"""Commands that replay and read stored runs: replay, diff, runs, show."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from kvreplay.cli.base import (
    BUILD_HELP,
    DB_HELP,
    JOBS,
    JOBS_HELP,
    JSON_HELP,
    MANY,
    RAY_HELP,
    RUN_ID,
    TIMEOUT_S,
    URI_HELP,
    app,
    emit_json,
    out,
    progress,
    say,
    within,
)
from kvreplay.cli.render import STATUS_STYLE, render_report, render_stored, row
from kvreplay.cli.report_cmds import REPORT_HELP
from kvreplay.errors import (
    EXIT_ABORT_BISECT,
    EXIT_BAD_INPUT,
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_UNLOADABLE,
    BadInput,
    KvreplayError,
)

if TYPE_CHECKING:
    from kvreplay.jobs.stored_replay import StoredReplay
    from kvreplay.replay.report import Failure, ReplayReport

# Options are declared here, once, so each command's signature is a list of what it takes,
# one line each (as defaults, not Annotated: tests/test_hostile_config.py finds a numeric
# option's bound on its default).
DB = typer.Option(None, "--db", help=DB_HELP)
AS_JSON = typer.Option(False, "--json", help=JSON_HELP)

# -- replay's options ------------------------------------------------------------------------
REPLAYED_TRACE = typer.Argument(..., help="Trace file (Parquet) or rotated trace directory." + URI_HELP)
BUILD = typer.Option(..., "--build", "-b", help=BUILD_HELP)
MODE = typer.Option("strict", help="strict: any difference counts; remap: translate indices, "
                    "only None/length/exception differences count.")
WORKER_TIMEOUT = typer.Option(1800.0, "--timeout", callback=TIMEOUT_S,
                              help="git: builds: give up on the worker after this many "
                              "seconds (status timeout).")
DEVICE = typer.Option("auto", help="auto (cuda when available), cpu or cuda[:N].")
FULL_CHECK_EVERY = typer.Option(1000, callback=within(0, MANY, f"0 (only at the end) or N, at most {MANY}"),
                                help="Run the O(pool) checks every N calls (on a vLLM trace, N "
                                "calls that made a block-pool call; 0: only at the end).")
STOP_FIRST = typer.Option(False, "--stop-first/--go-on", help="Stop at the first violation or divergence.")
AFTER_GAP = typer.Option(False, "--after-gap", help="For a trace where the recorder lost calls: replay "
                         "only the calls after the last gap, from the pool state recorded there.")
NO_STORE = typer.Option(False, "--no-store", help="Do not write the run to the database.")
GIT_BISECT = typer.Option(False, "--git-bisect", help="For `git bisect run`: bad input exits 128 "
                          "(git aborts the bisect) instead of 2 (which git would take as bad).")
FAILURE = typer.Option(None, "--failure", help="Count only this invariant, invariant/rule or "
                       "divergence kind as a failure (exit 1); any other failure exits 125 (skip).")
FIXED = typer.Option(False, "--fixed", help="With --git-bisect, to find a fix (git bisect start "
                     "--term-old broken --term-new fixed): the failure exits 0 (old), its absence "
                     "exits 1 (new); needs --failure.")
WORKERS = typer.Option(1, "--jobs", "-j", callback=JOBS, help=JOBS_HELP)
RAY = typer.Option(None, "--ray", help=RAY_HELP, metavar="[ADDRESS]")
RUN_REPORT = typer.Option(None, "--report", help=REPORT_HELP)


@app.command()
def replay(
    trace: str = REPLAYED_TRACE,
    build: str = BUILD,
    mode: str = MODE,
    timeout: float = WORKER_TIMEOUT,
    device: str = DEVICE,
    full_check_every: int = FULL_CHECK_EVERY,
    stop_first: bool = STOP_FIRST,
    after_gap: bool = AFTER_GAP,
    db: str | None = DB,
    no_store: bool = NO_STORE,
    git_bisect: bool = GIT_BISECT,
    failure: str | None = FAILURE,
    fixed: bool = FIXED,
    jobs: int = WORKERS,
    ray: str | None = RAY,
    report_path: Path | None = RUN_REPORT,
    as_json: bool = AS_JSON,
) -> None:
    """Replay a trace on a build, check every invariant, store the run.

    Calls are numbered 1..N in the order the trace holds them; every
    finding names the call that created the bad state. Exit 0 when clean,
    1 on a violation or divergence, 125 when the build cannot be tested
    (it does not load, its worker crashed or timed out: git bisect run
    skips it). With git bisect: `git bisect run kvreplay replay
    T.parquet --build git:.@HEAD:pkg.mod:Pool --no-store --git-bisect`.
    """
    from kvreplay.builds.spec import BuildSpec
    from kvreplay.jobs.stored_replay import replay_and_store
    from kvreplay.replay.report import Failure

    if report_path is not None:
        from kvreplay.report.reports import check_report_path

        check_report_path(report_path)
    with _bad_input_aborts_bisect(git_bisect):
        wanted = Failure.parse(failure) if failure else None
        if fixed and (wanted is None or not git_bisect):
            raise BadInput("--fixed needs --git-bisect and --failure (the failure whose fix git bisect looks for)")
        spec = BuildSpec.parse(build)  # once: handed down parsed
        with progress(f"replay {Path(trace).name}", "rows") as cb:
            res = replay_and_store(trace, spec, db=db, store=not no_store, progress=cb, mode=mode, device=device,
                                   full_check_every=full_check_every, stop_at_first=stop_first,
                                   after_gap=after_gap, jobs=jobs, ray=ray, timeout_s=timeout)
    if report_path is not None:
        from kvreplay.report.reports import run_report, write_report

        write_report(run_report({**res.report.to_dict(), "run_id": res.run_id}, res.report.timeline), report_path)
        say(f"report: {report_path}", to_err=True)
    code = _followed_exit_code(res.report, wanted, fixed)
    _show_replay(res, code, failure, fixed, as_json)
    raise typer.Exit(code)


@contextmanager
def _bad_input_aborts_bisect(git_bisect: bool) -> Iterator[None]:
    """Under --git-bisect, bad input exits 128: git aborts the bisect (2 it would take as bad)."""
    try:
        yield
    except KvreplayError as exc:
        if git_bisect and exc.exit_code == EXIT_BAD_INPUT:
            exc.exit_code = EXIT_ABORT_BISECT
        raise


def _followed_exit_code(r: ReplayReport, wanted: Failure | None, fixed: bool) -> int:
    """The run's exit code, as --failure and --fixed have git bisect read it."""
    code = r.exit_code
    if fixed and wanted is not None and code in (EXIT_CLEAN, EXIT_FOUND):
        # git bisect run: 0 is the old term (still broken), 1 the new (fixed).
        return EXIT_CLEAN if wanted.shown_by(r) else EXIT_FOUND
    if wanted is not None and code == EXIT_FOUND:
        return EXIT_FOUND if wanted.shown_by(r) else EXIT_UNLOADABLE
    return code


def _show_replay(res: StoredReplay, code: int, failure: str | None, fixed: bool, as_json: bool) -> None:
    r = res.report
    if as_json:
        emit_json({**r.to_dict(), "run_id": res.run_id})
        return
    render_report(r)
    if res.run_id is not None:
        say(f"stored as run {res.run_id} (kvreplay show {res.run_id})")
    if fixed:
        say(f"{failure} {'still shows' if code == EXIT_CLEAN else 'is gone'}: exit {code} "
            f"({'old: broken' if code == EXIT_CLEAN else 'new: fixed'})")
    elif code != r.exit_code:
        say(f"no {failure} failure: exit {code} (skip)")


@app.command()
def diff(
    trace: str = typer.Argument(..., help="Trace file (Parquet)." + URI_HELP),
    base: str = typer.Option(..., "--base", help="Reference build."),
    candidate: str = typer.Option(..., "--candidate", help="Build under test."),
    mode: str = typer.Option("strict", help="strict or remap (see replay)."),
    context: int = typer.Option(5, callback=within(0, 10_000, "a number of calls from 0 to 10000"),
                                help="Calls to show before the first divergence."),
    device: str = typer.Option("cpu", help="Torch device."),
    report_path: Path | None = typer.Option(None, "--report", help=REPORT_HELP + " Both builds on one axis."),
    as_json: bool = AS_JSON,
) -> None:
    """Replay a trace on two builds in lockstep and show where they part.

    Exit 0 when they agree on every call, 1 otherwise.
    """
    from kvreplay.replay.compare import text_value
    from kvreplay.replay.diff import diff_builds
    from kvreplay.report.reports import check_report_path, diff_report, write_report

    if report_path is not None:
        check_report_path(report_path)
    with progress(f"diff {Path(trace).name}", "rows") as cb:
        d = diff_builds(trace, base, candidate, mode=mode, context=context, device=device, progress=cb)
    if report_path is not None:
        write_report(diff_report(d), report_path)
        say(f"report: {report_path}", to_err=True)
    if as_json:
        emit_json(d.to_dict())
        raise typer.Exit(d.exit_code)
    if d.first is None:
        say(f"{base} and {candidate} agree on all {d.calls} calls ({mode})")
        raise typer.Exit(0)
    say(f"{d.differing_calls} of {d.calls} calls differ ({mode}); first at call #{d.first.call} "
        f"{d.first.method} ({d.first_kind})")
    t = Table("call", "method", "arguments", base, candidate)
    for c in [*d.context, d.first]:
        row(t, f"#{c.call}", c.method, ", ".join(f"{k}={text_value(v)}" for k, v in c.args.items()),
            text_value(c.base), text_value(c.candidate), style="bold red" if c is d.first else None)
    out.print(t)
    t = Table("method", "differing calls")
    for m, n in d.per_method.items():
        row(t, m, n)
    out.print(t)
    raise typer.Exit(1)


@app.command()
def runs(
    trace: str | None = typer.Option(None, help="Only runs of traces whose path contains this (or hash prefix)."),
    build: str | None = typer.Option(None, help="Only runs on this build spec."),
    status: str | None = typer.Option(None, help="clean, violation, divergence, unloadable, unsupported, "
                                      "crashed or timeout."),
    limit: int = typer.Option(50, callback=within(1, 1_000_000, "a number of runs from 1 to 1000000"),
                              help="Most runs to list (newest first)."),
    db: str | None = DB,
    as_json: bool = AS_JSON,
) -> None:
    """List stored replay runs, newest first."""
    from kvreplay.errors import one_of
    from kvreplay.replay.report import STATUSES
    from kvreplay.store.db import open_store
    from kvreplay.store.runs import list_runs, run_to_dict

    if status is not None:
        one_of("status", status, STATUSES)
    st = open_store(db, existing=True)
    try:
        rows = [run_to_dict(r) for r in list_runs(st, trace=trace, build=build, status=status, limit=limit)]
    finally:
        st.close()
    if as_json:
        emit_json(rows)
        return
    t = Table("run", "trace", "build", "mode", "status", "calls", "violations", "first violation", "when")
    for r in rows:
        fv = r["first_violation"]
        row(t, r["run_id"], Path(r["trace"]).name, r["build"], r["mode"], r["status"], r["calls_replayed"],
            r["violation_total"], f"call #{fv['call']} {fv['invariant']}" if fv else "-",
            (r["started_at"] or "")[:19], style=STATUS_STYLE.get(r["status"]))
    out.print(t)


@app.command()
def show(
    run_id: int = typer.Argument(..., callback=RUN_ID, help="Run id (see kvreplay runs)."),
    show_all: bool = typer.Option(False, "--all", help="Every kept violation, not the first of each rule."),
    db: str | None = DB,
    as_json: bool = AS_JSON,
) -> None:
    """Show one stored run: its violations and divergences."""
    from kvreplay.store.db import open_store
    from kvreplay.store.runs import get_run, run_to_dict

    st = open_store(db, existing=True)
    try:
        d = run_to_dict(get_run(st, run_id), details=True)
    finally:
        st.close()
    if as_json:
        emit_json(d)
        return
    render_stored(d, show_all=show_all)
