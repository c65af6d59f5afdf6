"""Commands that draw: report (an HTML file of a stored run, or two) and serve (the
dashboard over the store)."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from kvreplay.cli.base import DB_HELP, JSON_HELP, RUN_ID, app, emit_json, say, within
from kvreplay.errors import BadInput

REPORT_HELP = "Also write an HTML report (one self-contained file that opens offline) to this path."


@app.command()
def report(
    run_id: int = typer.Argument(..., callback=RUN_ID, help="Run id (see kvreplay runs)."),
    out_path: Path = typer.Option(..., "--out", "-o", help="Where to write the HTML file."),
    against: int | None = typer.Option(None, "--against", callback=RUN_ID,
                                       help="Another run id: both runs on one axis."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Write a stored run's HTML report: occupancy over the calls, every finding.

    The file is self-contained (the charting library is inside it) and opens
    offline. It draws each sub-pool's occupancy over the calls (replayed, and
    recorded where the trace can still be read and they differ), marks every
    violation and divergence by rule with the first of each starred, and shows a
    finding's call, arguments and neighbours when clicked. With --against, two
    runs on one axis.

    Example: kvreplay report 2 -o run2.html (then open run2.html in a browser)
    """
    from kvreplay.report.reports import stored_compare_report, stored_run_report, write_report
    from kvreplay.store.db import check_store, open_store

    check_store(db)
    st = open_store(db, existing=True)
    try:
        page = stored_compare_report(st, run_id, against) if against is not None else stored_run_report(st, run_id)
    finally:
        st.close()
    path = write_report(page, out_path)
    if as_json:
        emit_json({"run_id": run_id, "against": against, "report": str(path), "bytes": path.stat().st_size})
        return
    say(f"report of run {run_id}{f' against run {against}' if against is not None else ''}: {path} "
        f"({path.stat().st_size / 1e6:.1f} MB)")


@app.command()
def serve(
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    port: int = typer.Option(8765, "--port", callback=within(0, 65535, "a port number (1-65535; 0: any free port)"),
                             help="Port to listen on (0: any free port, printed once it listens)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. The dashboard has no "
                             "authentication: keep it on 127.0.0.1 unless the network is yours."),
) -> None:
    """Serve a read-only dashboard over the store on http://127.0.0.1:PORT.

    Runs (filtered by trace, build, status and date), a run's report, two runs
    compared, a trace's history across builds. It only reads the store. Stop it
    with Ctrl-C.

    Example: kvreplay serve --db team.db --port 8080, then open http://127.0.0.1:8080/
    """
    from kvreplay.jobs.dashboard import serve as run_server
    from kvreplay.store.db import open_store, resolve_url, safe_url

    url = resolve_url(db, create_dirs=False)
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        raise BadInput(f"no database at {url.removeprefix('sqlite:///')}: replay something first, or give --db")
    if not 0 <= port < 65536:
        raise BadInput(f"--port must be 0..65535 (0: any free port), not {port}")
    st = open_store(db, existing=True)
    where = st.url.removeprefix("sqlite:///") if st.url.startswith("sqlite:///") else safe_url(st.url)

    def listening(at: str) -> None:
        say(f"kvreplay dashboard on {at} serving {where} (read-only; Ctrl-C stops it)", to_err=True)

    try:
        sig = run_server(st, host=host, port=port, listening=listening)
    finally:
        st.close()
    if sig is not None:
        # SIGTERM is how a service manager stops it (exit 0); Ctrl-C is an interruption (130).
        say("kvreplay dashboard stopped", to_err=True)
        raise SystemExit(130 if sig == signal.SIGINT else 0)  # said already: no "error: interrupted" line
