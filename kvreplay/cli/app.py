"""The ``kvreplay`` command: parses options, calls the library, renders results.

Every command that reports something takes ``--json`` for scripts. Errors a user
can cause print one line and exit with the documented code (see ``--help``)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvreplay import __version__
from kvreplay.errors import (
    EXIT_ABORT_BISECT,
    EXIT_BAD_INPUT,
    EXIT_CRASH,
    EXIT_FOUND,
    EXIT_UNLOADABLE,
    KvreplayError,
)

EPILOG = (
    "Exit codes: 0 clean, 1 violation or divergence found, 2 bad input or usage, "
    "125 build could not be tested: unloadable, crashed or timed out (git bisect skips it), "
    "128 bad input under replay --git-bisect, >128 kvreplay crashed."
)

app = typer.Typer(
    name="kvreplay",
    help="Record, replay and check the KV-cache pool calls of LLM decode servers.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)
# The arguments of this invocation, so a trace can record the command that made it.
_argv: list[str] = []


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _version(value: bool) -> None:
    if value:
        out.print(f"kvreplay {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


@app.command()
def synth(
    scenario: str = typer.Argument(..., help="decode | disagg-mtp | radix-swa"),
    out_path: Path = typer.Option(..., "-o", "--out", help="Trace file to write (Parquet)."),
    requests: int = typer.Option(200, "--requests", "-n", help="Number of requests to run."),
    seed: int = typer.Option(0, help="Seed for the request generator and accept lengths."),
    workload: Path | None = typer.Option(
        None, help="Mooncake JSONL or Azure CSV request trace; default: seeded generator."
    ),
    build: str | None = typer.Option(None, help="Pool build to drive (default: the scenario's builtin pool)."),
    page_size: int = typer.Option(4, help="Tokens per page."),
    full_size: int = typer.Option(2048, help="Full-attention pool size in tokens (the paged pool's size)."),
    swa_size: int = typer.Option(512, help="SWA pool size in tokens."),
    window: int = typer.Option(32, help="Sliding-window size in tokens."),
    k: int = typer.Option(3, help="MTP draft tokens per step (disagg-mtp)."),
    block_tokens: int = typer.Option(16, help="Tokens per prefix-cache block (multiple of the page size)."),
    max_running: int = typer.Option(64, help="Most requests decoding at once."),
    length_scale: float = typer.Option(1.0, help="Scale a workload file's token lengths (e.g. 0.02)."),
    speedup: float = typer.Option(1.0, help="Divide a workload's arrival times by this."),
    device: str = typer.Option("cpu", help="Torch device for the pool."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Drive a pool the way an SGLang decode server does and record the
    trace.

    Example: kvreplay synth disagg-mtp --requests 2000 -o /tmp/t.parquet
    """
    from kvreplay.replayer.workload.synth import SynthConfig, synthesize

    cfg = SynthConfig(
        scenario=scenario, out=out_path, requests=requests, seed=seed, workload=workload, build=build,
        page_size=page_size, full_size=full_size, swa_size=swa_size, window=window, k=k,
        block_tokens=block_tokens, max_running=max_running, length_scale=length_scale, speedup=speedup,
        device=device,
    )
    command = "kvreplay " + " ".join(shlex.quote(a) for a in _argv)
    if as_json or not err.is_terminal:
        result = synthesize(cfg, command=command)
    else:
        from rich.progress import Progress

        with Progress(console=err, transient=True) as bar:
            task = bar.add_task(f"synth {scenario}", total=requests)
            result = synthesize(cfg, progress=lambda done, total: bar.update(task, completed=done), command=command)
    if as_json:
        _emit_json(result.__dict__)
        return
    out.print(
        f"wrote {result.path}: {result.calls} calls, {result.requests_done} requests, {result.steps} steps, "
        f"{result.retractions} retractions, {result.evictions} evictions in {result.wall_s:.1f}s ({result.build})"
    )


@app.command()
def inspect(
    trace: Path = typer.Argument(..., help="Trace file (Parquet)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Describe a trace: pool config, calls per method, time span, peak
    usage, size.
    """
    from kvreplay.recorder.summary import summarize

    s = summarize(trace)
    if as_json:
        _emit_json(s.to_dict())
        return
    m = s.meta
    out.print(f"[bold]{s.path}[/bold]  schema v{m['schema_version']}")
    out.print(f"pool      {m['pool_class']} ({m['family']})  {json.dumps(m['ctor_args'], sort_keys=True)}")
    out.print(f"recorded  host {m['host'] or '?'}  pid {m['pid']}  rank {m['rank'] or '-'}  at {m['start_time']}")
    out.print(f"versions  {', '.join(f'{k} {v}' for k, v in m['source_version'].items())}")
    if m.get("extra", {}).get("command"):
        out.print(f"made by   {m['extra']['command']}")
    out.print(
        f"calls     {s.top_level_calls} top-level, {s.nested_calls} nested; {s.exceptions} raised, "
        f"{s.none_results} out-of-memory (None)"
    )
    out.print(f"span      {s.time_span_s:.3f} s")
    out.print("peak use  " + ", ".join(f"{k} {v} tokens" for k, v in s.peak_used.items()))
    bpi = f"{s.bytes_per_index:.2f}" if s.bytes_per_index is not None else "-"
    out.print(f"size      {s.file_bytes} bytes, {s.recorded_indices} recorded indices, {bpi} bytes/index")
    table = Table("method", "top-level calls")
    for name, n in s.calls_per_method.items():
        table.add_row(name, str(n))
    out.print(table)
    for note in s.notes:
        out.print(f"note: {note}")


@app.command("builds")
def list_builds(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List the pool builds kvreplay can construct (builtin pools and bug
    variants).
    """
    from kvreplay.replayer.builds import BUILTINS

    rows = [{"spec": f"builtin:{b.name}", "family": b.family, "summary": b.summary} for b in BUILTINS.values()]
    if as_json:
        _emit_json(rows)
        return
    table = Table("build", "family", "what it is")
    for r in rows:
        table.add_row(r["spec"], r["family"], r["summary"])
    out.print(table)
    from kvreplay.replayer import sglang_adapter

    ver = sglang_adapter.version()
    out.print("Also: py:MODULE:CLASS (any importable allocator class); sglang (the installed sglang's allocator "
              f"for the trace's family{': sglang ' + ver + ' here' if ver else ': not installed here'}); "
              "git:REPO@REV[:MODULE:CLASS] (pool code at a revision, replayed in its own process).",
              highlight=False)


DB_HELP = (
    "Results database: SQLAlchemy URL or SQLite file "
    "(default: $KVREPLAY_DB, else ~/.local/share/kvreplay/kvreplay.db)."
)


def _progress_bar(label: str, enabled: bool):  # noqa: ANN202 - a context manager and a callback
    from contextlib import nullcontext

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    if not enabled or not err.is_terminal:
        return nullcontext(None)
    return Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total} rows"),
                    TimeRemainingColumn(), console=err, transient=True)


def _print_violation(v: Any) -> None:
    where = f"call #{v.seq} {v.method}"
    if v.detected_seq != v.seq:
        where += f" (seen at #{v.detected_seq})"
    idx = f" indices {v.indices}" if v.indices else ""
    out.print(f"  [red]{v.invariant}[/red]/{v.rule} at {where} " + escape(f"[{v.sub_pool}]{idx}: {v.message}"),
              highlight=False)


def render_report(r: Any) -> None:
    color = {"clean": "green", "violation": "red", "divergence": "yellow"}.get(r.status, "magenta")
    out.print(f"[bold]{r.trace}[/bold] on [bold]{r.build}[/bold] ({r.mode}, {r.device}): "
              f"[{color}]{r.status}[/{color}]  {r.calls_replayed} calls in {r.wall_s:.2f} s "
              f"({r.calls_per_s:,.0f} calls/s)", highlight=False)
    if getattr(r, "message", ""):
        out.print(f"  {escape(r.message)}", highlight=False)
    if r.violation_counts:
        t = Table("invariant/rule", "count", "first at call")
        firsts: dict[str, int] = {}
        for v in r.violations:
            firsts.setdefault(f"{v.invariant}/{v.rule}", v.seq)
        for k, n in sorted(r.violation_counts.items(), key=lambda kv: firsts.get(kv[0], 0)):
            t.add_row(k, str(n), str(firsts.get(k, "")))
        out.print(t)
    if r.first_violation:
        out.print("first violation:")
        _print_violation(r.first_violation)
        if r.capacity_assert_after_calls is not None:
            out.print(f"the build's own capacity assertion fires at call #{r.capacity_assert_seq}, "
                      f"{r.capacity_assert_after_calls} calls later")
        else:
            out.print("the build's own capacity assertion never fires on this trace")
    if r.divergence_counts:
        out.print("divergences: " + ", ".join(f"{k} {n}" for k, n in r.divergence_counts.items()))
        d = r.first_divergence
        out.print(f"  first at call #{d.seq} {d.method} ({d.kind}): expected {d.expected}, got {d.actual}",
                  highlight=False)
    if getattr(r, "translated", None):
        out.print("replayed through API translations (the build lacks these methods): "
                  + ", ".join(f"{m} x{n}" for m, n in r.translated.items()), highlight=False)
    if any(r.held_at_end.values()):
        held = ", ".join(f"{k} {v} slots" for k, v in r.held_at_end.items())
        out.print(f"still held by the caller at the end: {held}")


@app.command()
def replay(
    trace: Path = typer.Argument(..., help="Trace file (Parquet)."),
    build: str = typer.Option(..., "--build", "-b", help="Build to replay on: builtin:NAME, py:MODULE:CLASS, "
                              "sglang (the installed one) or git:REPO@REV[:MODULE:CLASS]."),
    mode: str = typer.Option("strict", help="strict: any difference counts; remap: translate indices, "
                             "only None/length/exception differences count."),
    timeout: float = typer.Option(1800.0, "--timeout", help="git: builds: give up on the worker after this many "
                                  "seconds (status timeout)."),
    device: str = typer.Option("auto", help="auto (cuda when available), cpu or cuda[:N]."),
    full_check_every: int = typer.Option(1000, help="Run the O(pool) checks every N calls (0: only at the end)."),
    stop_first: bool = typer.Option(False, "--stop-first/--go-on", help="Stop at the first violation or divergence."),
    after_gap: bool = typer.Option(False, "--after-gap", help="For a trace where the recorder lost calls: replay "
                                   "only the calls after the last gap, from the pool state recorded there."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    no_store: bool = typer.Option(False, "--no-store", help="Do not write the run to the database."),
    git_bisect: bool = typer.Option(False, "--git-bisect", help="For `git bisect run`: bad input exits 128 "
                                    "(git aborts the bisect) instead of 2 (which git would take as bad)."),
    failure: str | None = typer.Option(None, "--failure", help="Count only this invariant id or divergence kind "
                                       "as a failure (exit 1); any other failure exits 125 (skip)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Replay a trace on a build, check every invariant, store the run.

    Exit 0 when clean, 1 on a violation or divergence, 125 when the build
    cannot be tested (it does not load, its worker crashed or timed out:
    git bisect run skips it). With git bisect: `git bisect run kvreplay
    replay T.parquet --build git:.@HEAD:pkg.mod:Pool --no-store
    --git-bisect`. A git: build runs in its own process; if it crashes or
    hangs the run says so.
    """
    from kvreplay.workflows import replay_and_store

    try:
        with _progress_bar(f"replay {trace.name}", not as_json) as bar:
            task = bar.add_task("", total=1) if bar else None
            cb = (lambda done, total: bar.update(task, completed=done, total=total)) if bar else None
            extra = {"timeout_s": timeout} if build.startswith("git:") else {}
            res = replay_and_store(trace, build, db=db, store=not no_store, progress=cb, mode=mode, device=device,
                                   full_check_every=full_check_every, stop_at_first=stop_first,
                                   after_gap=after_gap, **extra)
    except KvreplayError as exc:
        if git_bisect and exc.exit_code == EXIT_BAD_INPUT:
            _fail(str(exc), EXIT_ABORT_BISECT)
        raise
    r = res.report
    code = r.exit_code
    if failure and code == EXIT_FOUND:
        shown = {k.split("/")[0] for k in r.violation_counts} | set(r.divergence_counts)
        code = EXIT_FOUND if failure in shown else EXIT_UNLOADABLE
    if as_json:
        d = r.to_dict()
        d["run_id"] = res.run_id
        _emit_json(d)
    else:
        render_report(r)
        if res.run_id is not None:
            out.print(f"stored as run {res.run_id} (kvreplay show {res.run_id})")
        if code != r.exit_code:
            out.print(f"no {failure} failure: exit {code} (skip)")
    raise typer.Exit(code)


@app.command()
def diff(
    trace: Path = typer.Argument(..., help="Trace file (Parquet)."),
    base: str = typer.Option(..., "--base", help="Reference build."),
    candidate: str = typer.Option(..., "--candidate", help="Build under test."),
    mode: str = typer.Option("strict", help="strict or remap (see replay)."),
    context: int = typer.Option(5, help="Calls to show before the first divergence."),
    device: str = typer.Option("cpu", help="Torch device."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Replay a trace on two builds in lockstep and show where they part.

    Exit 0 when they agree on every call, 1 otherwise.
    """
    from kvreplay.replayer.diff import diff_builds

    d = diff_builds(trace, base, candidate, mode=mode, context=context, device=device)
    if as_json:
        _emit_json(d.to_dict())
        raise typer.Exit(d.exit_code)
    if d.first is None:
        out.print(f"{base} and {candidate} agree on all {d.calls} calls ({mode})")
        raise typer.Exit(0)
    out.print(f"{d.differing_calls} of {d.calls} calls differ ({mode}); first at call #{d.first.seq} "
              f"{d.first.method} ({d.first_kind})", highlight=False)
    t = Table("call", "method", "arguments", base, candidate)
    for c in [*d.context, d.first]:
        style = "bold red" if c is d.first else None
        t.add_row(f"#{c.seq}", c.method, ", ".join(f"{k}={v}" for k, v in c.args.items()), c.base, c.candidate,
                  style=style)
    out.print(t)
    t = Table("method", "differing calls")
    for m, n in d.per_method.items():
        t.add_row(m, str(n))
    out.print(t)
    raise typer.Exit(1)


@app.command("bisect")
def bisect_cmd(
    trace: Path = typer.Argument(..., help="Trace file (Parquet) that fails at the bad end."),
    repo: Path | None = typer.Option(None, "--repo", help="Git repository of the pool code."),
    good: str | None = typer.Option(None, "--good", help="A revision where the trace replays clean."),
    bad: str | None = typer.Option(None, "--bad", help="A later revision where it fails (default HEAD)."),
    cls: str = typer.Option("", "--class", help="MODULE:CLASS of the pool in the repository (default: the "
                            "tree's sglang allocator for the trace's family)."),
    builds: str | None = typer.Option(None, "--builds", help="Instead of a repository: build specs in order, "
                                      "good first, bad last, e.g. builtin:swa,builtin:swa@stale-tail."),
    mode: str = typer.Option("strict", help="Replay mode for every step (strict or remap)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda[:N]."),
    timeout: float = typer.Option(1800.0, "--timeout", help="A git: step running longer is a timeout (skipped)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Replay every step even when the store has it."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Find the first commit (or build) where a trace starts failing.

    Binary search over the first-parent commits after --good up to --bad,
    each replayed as a git: build in its own process. A step is good when
    clean, bad when it shows the failure the bad end shows (same
    invariant, or same divergence kind), and skipped when it cannot be
    tested (unloadable, crashed, timeout) or fails differently. Results
    are stored, so bisecting the same trace again replays nothing it has
    seen.

    Exit 0 when the first bad commit (or a range, when skips hide it) is
    named, 1 when --good already fails, 2 on bad input.
    """
    from kvreplay.bisect import bisect, build_candidates, git_candidates

    if builds and repo:
        raise KvreplayError("give --repo/--good/--bad or --builds, not both")
    if builds:
        good_c, order = build_candidates(builds.split(","))
    elif repo is None or good is None:
        raise KvreplayError("bisect needs --repo PATH --good REV [--bad REV], or --builds A,B,...")
    else:
        good_c, order = git_candidates(repo, good, bad or "HEAD", cls)
    err.print(f"bisecting {trace.name} over {len(order)} build(s) after {good_c.label}", highlight=False)

    def on_step(step: Any, left: int) -> None:
        src = "stored" if step.cached else f"{step.wall_s:.1f} s"
        err.print(f"  {step.label:<14} {step.verdict:<5} {step.why}  ({src}; ~{left} step(s) left)",
                  markup=False, highlight=False, soft_wrap=True)

    res = bisect(trace, good_c, order, db=db, mode=mode, device=device, timeout_s=timeout,
                 use_cache=not no_cache, on_step=on_step)
    if as_json:
        _emit_json(res.to_dict())
        raise typer.Exit(res.exit_code)
    what = "commit" if order[0].commit else "build"
    say = lambda line: out.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    if res.verdict == "found":
        say(f"first bad {what}: {res.first_bad.describe()}")
        say(f"  shows {res.bad_shows}: {res.bad_detail}")
    elif res.verdict == "range":
        say(f"the first bad {what} is one of these (skipped steps hide which):")
        for c in res.candidates:
            say(f"  {c.describe()}")
    else:
        say(f"--good {good_c.label} already shows the failure: {res.bad_shows}")
    say("step log:")
    for st in res.steps:
        src = "store" if st.cached else f"{st.wall_s:.1f} s"
        say(f"  {st.label:<14} {st.verdict:<5} {st.why} ({src})")
    skips = sum(st.verdict == "skip" for st in res.steps)
    say(f"{len(res.steps)} steps over {res.searched} {what}s: {res.replays} replays, "
        f"{len(res.steps) - res.replays} from the store, {skips} skipped")
    raise typer.Exit(res.exit_code)


@app.command()
def minimize(
    trace: Path = typer.Argument(..., help="Trace file (Parquet) that fails on --build."),
    build: str = typer.Option(..., "--build", "-b", help="The build it fails on (builtin:, py: or sglang)."),
    out_path: Path = typer.Option(..., "-o", "--out", help="Minimal trace to write (Parquet)."),
    emit_test: Path | None = typer.Option(None, "--emit-test", help="Also write a standalone pytest reproducer."),
    invariant: str | None = typer.Option(None, "--invariant", help="Keep this invariant's failure (default: the "
                                         "first failure the trace shows)."),
    reference: str = typer.Option("auto", "--reference", help="A build every candidate must stay clean on, so the "
                                  "result shows the bug and not a misuse of the API (auto: a builtin variant's "
                                  "base pool; none: no such check)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Stop after this many seconds and write the "
                                         "smallest trace found so far."),
    device: str = typer.Option("cpu", help="Torch device for the candidate replays."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
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
    from kvreplay.minimize import minimize as run_minimize

    def progress(size: int, tests: int, elapsed: float) -> None:
        if not as_json:
            err.print(f"  {size} calls  ({tests} candidates tried, {elapsed:.1f} s)", highlight=False)

    res = run_minimize(trace, build, out_path, invariant=invariant,
                       reference=None if reference == "none" else reference, emit_test=emit_test,
                       timeout_s=timeout, device=device, progress=progress)
    if as_json:
        _emit_json(res.to_dict())
        raise typer.Exit(0)
    say = lambda line: out.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    stop = " (stopped at --timeout)" if res.timed_out else ""
    say(f"{res.calls_before} -> {res.calls_after} calls in {res.wall_s:.1f} s, {res.tests} candidates{stop}")
    say(f"kept: {res.failure}" + (f", clean on {res.reference}" if res.reference else ""))
    say(f"wrote {res.out}: on {build} it shows {res.shows}")
    if res.test_file:
        say(f"wrote {res.test_file}: pytest {res.test_file}  (another build: KVREPLAY_BUILD=... pytest ...)")
    raise typer.Exit(0)


@app.command()
def runs(
    trace: str | None = typer.Option(None, help="Only runs of traces whose path contains this (or hash prefix)."),
    build: str | None = typer.Option(None, help="Only runs on this build spec."),
    status: str | None = typer.Option(None, help="clean, violation or divergence."),
    limit: int = typer.Option(50, help="Most runs to list (newest first)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """List stored replay runs, newest first.
    """
    from kvreplay.store.db import open_store
    from kvreplay.store.runs import list_runs, run_to_dict

    st = open_store(db)
    try:
        rows = [run_to_dict(r) for r in list_runs(st, trace=trace, build=build, status=status, limit=limit)]
    finally:
        st.close()
    if as_json:
        _emit_json(rows)
        return
    t = Table("run", "trace", "build", "mode", "status", "calls", "violations", "first violation", "when")
    for r in rows:
        fv = r["first_violation"]
        t.add_row(str(r["id"]), Path(r["trace"]).name, r["build"], r["mode"], r["status"], str(r["calls_replayed"]),
                  str(r["violation_total"]), f"#{fv['seq']} {fv['invariant']}" if fv else "-",
                  (r["started_at"] or "")[:19])
    out.print(t)


@app.command()
def show(
    run_id: int = typer.Argument(..., help="Run id (see kvreplay runs)."),
    show_all: bool = typer.Option(False, "--all", help="Every kept violation, not the first of each rule."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show one stored run: its violations and divergences.
    """
    from kvreplay.store.db import open_store
    from kvreplay.store.runs import get_run, run_to_dict

    st = open_store(db)
    try:
        d = run_to_dict(get_run(st, run_id), details=True)
    finally:
        st.close()
    if as_json:
        _emit_json(d)
        return
    _render_stored(d, show_all=show_all)


def _render_stored(d: dict[str, Any], *, show_all: bool = False) -> None:
    out.print(f"run {d['id']}: {d['trace']} on {d['build']} ({d['mode']}, {d['device']}) -> {d['status']}, "
              f"{d['calls_replayed']} calls, {d['violation_total']} violations, "
              f"{d['divergence_total']} divergences", highlight=False)
    if d["capacity_assert_seq"] is not None:
        out.print(f"capacity assertion fires at call #{d['capacity_assert_seq']}"
                  + (f", {d['capacity_assert_after_calls']} calls after the first violation"
                     if d["capacity_assert_after_calls"] is not None else ""))
    elif d["violation_total"]:
        out.print("the build's own capacity assertion never fires on this trace")
    seen: set[str] = set()
    shown = 0
    for v in d["violations"]:
        key = f"{v['invariant']}/{v['rule']}"
        if not show_all and key in seen:
            continue
        seen.add(key)
        shown += 1
        where = f"#{v['seq']} {v['method']}" + (f" (seen at #{v['detected_seq']})"
                                                 if v["detected_seq"] != v["seq"] else "")
        out.print(f"  [red]{key}[/red] at {where} " + escape(f"[{v['sub_pool']}] indices {v['indices']}: "
                                                            f"{v['message']}"), highlight=False)
    if d["violations"]:
        out.print("counts: " + ", ".join(f"{k} {n}" for k, n in d["violation_counts"].items()))
        if not show_all and d["violation_total"] > shown:
            out.print(f"(first of each rule shown; kvreplay show {d['id']} --all for the {len(d['violations'])} kept)")
    for x in d["divergences"] if show_all else d["divergences"][:5]:
        out.print(f"  [yellow]{x['kind']}[/yellow] at #{x['seq']} {x['method']}: expected {x['expected']}, "
                  f"got {x['actual']}", highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def record(
    command: list[str] = typer.Argument(None, help="The command to run, after --."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Directory for the traces (created if missing)."),
    classes: list[str] = typer.Option(
        [], "--class", help="MODULE:CLASS of an allocator to record (repeatable). "
        "Default: sglang's token, paged and SWA allocators."),
    print_env: bool = typer.Option(False, "--print-env",
                                   help="Print the environment variables to set instead of running anything."),
    flight: int = typer.Option(0, "--flight", help="Flight-recorder mode: keep only each allocator's last N calls "
                               "in memory and write kvreplay-flight-PID-N.parquet when a call raises or the process "
                               "gets SIGUSR2 (kill -USR2 PID)."),
    counters_every: int = typer.Option(1, "--counters-every", metavar="N",
                                       help="Read the pool's counters (available sizes) after every Nth "
                                       "state-changing call instead of every one, for less overhead; replay "
                                       "compares them where they were read. 0: never."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Run a decode server with every allocator it builds recorded.

    Every Python process the command starts (sglang's scheduler
    subprocesses too) records each allocator it constructs into OUT as
    kvreplay-PID[-RANK]-N.parquet. Ctrl-C and SIGTERM are passed to the
    command; traces are finished on exit. Exits with the command's exit
    code.

    Example: kvreplay record --out traces/live -- python -m
    sglang.launch_server --model-path ...

    Launching servers your own way: kvreplay record --out DIR --print-env
    prints the variables (KVREPLAY_RECORD_DIR, PYTHONPATH) to export
    instead.
    """
    from kvreplay.recorder.live import record_command, record_env

    if counters_every < 0:
        raise KvreplayError("--counters-every N needs N >= 0 (0: never read the counters)")
    if print_env:
        from kvreplay.recorder.autorecord import CLASSES_ENV, COUNTERS_ENV, DIR_ENV, FLIGHT_ENV

        env = record_env(out_dir, classes, flight=flight, counters_every=counters_every)
        keys = [DIR_ENV, "PYTHONPATH"] + [k for k, asked in ((CLASSES_ENV, bool(classes)), (FLIGHT_ENV, flight > 0),
                                                              (COUNTERS_ENV, counters_every != 1)) if asked]
        if as_json:
            _emit_json({k: env[k] for k in keys})
        else:
            for k in keys:
                out.print(f"export {k}={shlex.quote(env[k])}", markup=False, highlight=False, soft_wrap=True)
        return
    if flight < 0:
        raise KvreplayError("--flight N needs N > 0 (the number of calls to keep)")
    res = record_command(command or [], out_dir, classes, flight=flight, counters_every=counters_every)
    if as_json:
        _emit_json(res.to_dict())
    else:
        err.print(f"{len(res.traces)} trace(s) in {res.out}:" if res.traces else f"no traces written to {res.out}",
                  markup=False, highlight=False)
        for p in res.traces:
            err.print(f"  {p}", markup=False, highlight=False)
        for p in res.unfinished:
            err.print(f"  unfinished: {p}", markup=False, highlight=False)
    raise typer.Exit(res.exit_code)


@app.command("ci")
def corpus_ci(
    corpus: Path = typer.Argument(Path("traces"), help="Corpus directory (holding manifest.json)."),
    build: str = typer.Option(..., "--build", "-b", help="Build to replay the corpus on."),
    jobs: int = typer.Option(1, "--jobs", "-j", help="Worker processes."),
    junit: Path | None = typer.Option(None, "--junit", help="Write JUnit XML here (one testcase per trace and mode)."),
    summary: Path | None = typer.Option(None, "--summary", help="Write a Markdown summary here (for a PR comment)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Replay every corpus trace on a build and hold it to the manifest's
    expectations.

    Exit 0 only when every expectation holds: a trace the manifest says is
    clean must replay clean, and a known-bad one must show its violations
    (an unexpected clean replay fails too). Traces of another pool family
    are skipped.
    """
    from kvreplay.corpus_ci import junit_xml, markdown_summary, ok, run_corpus

    def show(r: Any, done: int, total: int) -> None:
        if not as_json:
            colour = {"pass": "green", "fail": "red", "error": "red", "skip": "dim"}[r.outcome]
            err.print(f"[{done}/{total}] [{colour}]{r.outcome:5s}[/{colour}] {escape(r.case.name)}", highlight=False)

    results = run_corpus(corpus, build, jobs=jobs, db=db, device=device, progress=show)
    if junit:
        junit.write_text(junit_xml(results, build))
    if summary:
        summary.write_text(markdown_summary(results, build))
    passed = ok(results)
    if as_json:
        _emit_json({"build": build, "ok": passed, "results": [r.to_dict() for r in results]})
    else:
        for r in results:
            for p in r.problems if r.outcome in ("fail", "error") else []:
                out.print(escape(f"{r.case.name}: {p}"), highlight=False, soft_wrap=True)
        n = {k: sum(r.outcome == k for r in results) for k in ("pass", "fail", "error", "skip")}
        out.print(f"{build}: {n['pass']} passed, {n['fail']} failed, {n['error']} errors, {n['skip']} skipped; "
                  + ("every expectation holds" if passed else "expectations FAILED"), highlight=False)
    raise typer.Exit(0 if passed else 1)


corpus_app = typer.Typer(help="Keep a trace corpus in order: add traces with their expectations, check it.",
                         no_args_is_help=True)
app.add_typer(corpus_app, name="corpus")


@corpus_app.command("add")
def corpus_add(
    trace: Path = typer.Argument(..., help="Trace to add."),
    name: str = typer.Option(..., "--name", "-n", help="Name in the corpus (the file becomes NAME.parquet)."),
    corpus: Path = typer.Option(Path("traces"), "--corpus", help="Corpus directory."),
    builds: list[str] = typer.Option([], "--build", "-b", help="Build whose replay becomes an expectation "
                                     "(repeatable; default: the builtin pool of the trace's family)."),
    force: bool = typer.Option(False, "--force", help="Replace an entry of the same name."),
    max_mb: float = typer.Option(5.0, "--max-mb", help="Refuse traces larger than this."),
    as_json: bool = typer.Option(False, "--json", help="Print the new manifest entry as JSON."),
) -> None:
    """Copy a trace into the corpus, replay it, and record provenance and
    expectations.
    """
    from kvreplay.corpus import add_trace

    entry = add_trace(trace, name, corpus, builds or None, force=force, max_mb=max_mb)
    if as_json:
        _emit_json(entry)
    else:
        for x in entry["expect"]:
            what = x["status"] + ("" if x["status"] == "clean" else ": " + ", ".join(
                f"{v['invariant']}/{v['rule']} at #{v['seq']} {v['method']}" for v in x["violations"]))
            out.print(f"{name}: {x['build']} {what}", highlight=False, soft_wrap=True)
        out.print(f"added {corpus / entry['file']}", highlight=False)


@corpus_app.command("check")
def corpus_check(
    corpus: Path = typer.Argument(Path("traces"), help="Corpus directory."),
    max_mb: float = typer.Option(5.0, "--max-mb", help="Largest trace allowed."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Every file readable and unchanged, every entry backed by a file, sizes
    within the limit.
    """
    from kvreplay.corpus import check_corpus

    res = check_corpus(corpus, max_mb)
    if as_json:
        _emit_json({"corpus": res.corpus, "entries": res.entries, "ok": res.ok, "problems": res.problems})
    else:
        for p in res.problems:
            out.print(escape(p), highlight=False)
        out.print(f"{res.corpus}: {res.entries} entries, " + ("ok" if res.ok else f"{len(res.problems)} problem(s)"),
                  highlight=False)
    raise typer.Exit(0 if res.ok else 1)


@app.command()
def demo(
    requests: int = typer.Option(2000, "--requests", "-n", help="Requests in the synthesized trace."),
    out_dir: Path | None = typer.Option(None, "--out", help="Where to write the trace (default: a temp dir)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """The main job end to end: synth a disagg-mtp trace, replay it on
    builtin:swa (clean) and builtin:swa@stale-tail (caught at the source
    call), show the stored run.
    """
    from kvreplay.workflows import demo as run_demo

    res = run_demo(db=db, out_dir=out_dir, requests=requests,
                   progress=None if as_json else (lambda m: err.print(f"[dim]{m}[/dim]")))
    if as_json:
        _emit_json({"trace": str(res.trace.path), "clean": res.clean.report.to_dict(),
                    "buggy": res.buggy.report.to_dict(), "stored": res.stored, "ok": res.ok})
        raise typer.Exit(0 if res.ok else 1)
    out.print(f"trace: {res.trace.path} ({res.trace.calls} calls, {res.trace.requests_done} requests)")
    render_report(res.clean.report)
    render_report(res.buggy.report)
    out.print("[bold]stored result[/bold] (kvreplay show " + str(res.buggy.run_id) + "):")
    _render_stored(res.stored)
    raise typer.Exit(0 if res.ok else 1)


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"kvreplay: error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: turns library errors into one line and an exit code."""
    _argv[:] = sys.argv[1:] if argv is None else argv
    try:
        app(args=argv, standalone_mode=True)
    except KvreplayError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except SystemExit:
        raise
    except Exception as exc:  # a bug in kvreplay, not the user's input
        _fail(f"internal error: {type(exc).__name__}: {exc}", EXIT_CRASH)


if __name__ == "__main__":
    main()
