"""``kvreplay demo``: the main job end to end on the embedded defaults."""

from __future__ import annotations

from pathlib import Path

import typer

from kvreplay.cli.base import DB_HELP, JSON_HELP, REQUESTS, app, emit_json, say
from kvreplay.cli.render import render_report, render_stored


@app.command()
def demo(
    requests: int = typer.Option(2000, "--requests", "-n", callback=REQUESTS,
                                 help="Requests in the synthesized trace."),
    out_dir: Path | None = typer.Option(None, "--out", help="Where to write the trace (default: a temp dir)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The main job end to end: synth a trace, replay it clean and buggy.

    Synthesizes a disagg-mtp trace, replays it on builtin:swa (clean) and
    on builtin:swa@stale-tail (caught at the source call), and shows the
    stored run.
    """
    from kvreplay.jobs.demo import demo as run_demo

    res = run_demo(db=db, out_dir=out_dir, requests=requests,
                   progress=None if as_json else (lambda m: say(m, "dim", to_err=True)))
    if as_json:
        emit_json({"trace": str(res.trace.path), "clean": {**res.clean.report.to_dict(), "run_id": res.clean.run_id},
                   "buggy": {**res.buggy.report.to_dict(), "run_id": res.buggy.run_id}, "stored": res.stored,
                   "report": str(res.report) if res.report else None, "database": res.database, "ok": res.ok})
        raise typer.Exit(0 if res.ok else 1)
    say(f"trace: {res.trace.path} ({res.trace.calls} calls, {res.trace.requests_done} requests)")
    render_report(res.clean.report)
    render_report(res.buggy.report)
    say(f"stored result (kvreplay show {res.buggy.run_id}):", "bold")
    render_stored(res.stored)
    if res.report is not None:
        say(f"report of the bug run (open it in a browser): {res.report}", "bold")
    runs = f"runs {res.clean.run_id} and {res.buggy.run_id} stored in {res.database} (kvreplay runs --db ...)"
    if res.ok:
        say(f"demo passed: builtin:swa replays clean, and the seed bug is caught at call "
            f"#{res.buggy.report.first_violation.call}; {runs}", "green")
    else:
        say(f"demo FAILED: the clean pool did not replay clean or the seed bug was not caught; {runs}", "red")
    raise typer.Exit(0 if res.ok else 1)
