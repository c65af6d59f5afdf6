"""``kvreplay matrix``: a trace or a corpus on many builds, as one table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from kvreplay.cli.base import (
    DB_HELP,
    JSON_HELP,
    MAX_JOBS,
    RAY_HELP,
    TIMEOUT_S,
    URI_HELP,
    app,
    emit_json,
    out,
    say,
    within,
)
from kvreplay.cli.render import STATUS_STYLE, row
from kvreplay.text import printable


@app.command()
def matrix(
    traces: list[str] = typer.Argument(..., help="Trace files, rotated trace directories, or a corpus "
                                       "directory (one with manifest.json, or host=.../rank=... partitions: all "
                                       "its traces)." + URI_HELP),
    builds: str = typer.Option(..., "--builds", help="Comma-separated build specs; sglang==A..B (vllm==A..B) "
                               "is every release from A to B, e.g. --builds sglang==0.5.11..0.5.23,builtin:swa."),
    mode: str = typer.Option("strict", help="strict or remap (remap for releases older than the trace: "
                             "API translations change nested calls)."),
    device: str = typer.Option("auto", help="auto, cpu (Triton kernels run in Triton's interpreter) or cuda[:N]."),
    jobs: int = typer.Option(0, "--jobs", "-j", callback=within(0, MAX_JOBS, f"0 (one per CPU core) to {MAX_JOBS}"),
                             help="Builds replayed at once (0: one per CPU core)."),
    timeout: float = typer.Option(1800.0, "--timeout", callback=TIMEOUT_S,
                                  help="Seconds per trace before a worker is a timeout."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Replay even what the store already holds for an "
                                  "exact build (a release, a builtin of this version)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    ray: str | None = typer.Option(None, "--ray", help="One Ray task per build. " + RAY_HELP, metavar="[ADDRESS]"),
    report_path: Path | None = typer.Option(None, "--report", help="Also write an HTML heat map of build x rule "
                                            "here, linking to each run's report (written beside it, in "
                                            "NAME-runs/)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Replay traces on many builds and print build x invariant.

    Each cell holds every rule of the invariant the build broke, each at
    its first call; 'capacity' is the first call after which an available
    count exceeds its pool's size (the condition sglang's capacity
    assertion checks; the build raises it later, where it checks). Every run is stored (kvreplay show RUN). A release
    is fetched and imported once and replays all the traces. Exit 1 when
    any build shows a violation or divergence, 0 when all tested builds
    are clean, 125 when none could be tested, 2 on bad input.
    """
    from kvreplay.jobs.matrix import matrix_traces, run_matrix
    from kvreplay.report.reports import check_report_path

    if report_path is not None:
        check_report_path(report_path)
    partitions = {str(p.resolve()): keys for p, keys, _ in matrix_traces(traces)}

    def on_cell(c: object) -> None:
        src = "stored" if c.cached else f"{c.wall_s:.1f} s"  # type: ignore[attr-defined]
        keys = " ".join(f"{k}={v}" for k, v in partitions.get(c.trace, {}).items())  # type: ignore[attr-defined]
        name = Path(c.trace).name + (f" ({keys})" if keys else "")  # type: ignore[attr-defined]
        say(f"  {name} on {c.build}: {c.status} ({src})", to_err=True)  # type: ignore[attr-defined]

    res = run_matrix(traces, builds.split(","), db=db, mode=mode, device=device,
                     jobs=jobs or os.cpu_count() or 1, timeout_s=timeout, use_cache=not no_cache, ray=ray,
                     on_cell=on_cell)
    if report_path is not None:
        write_matrix_report(res, report_path, db)
    if as_json:
        emit_json(res.to_dict())
        raise typer.Exit(res.exit_code)
    invariants = res.invariants
    kinds = sorted({k for c in res.cells for k in c.divergences})
    for trace in res.traces:
        keys = " ".join(f"{k}={v}" for k, v in res.partitions.get(trace, {}).items())
        t = Table("build", "status", "kernels", *invariants, *(["divergences"] if kinds else []), "capacity",
                  title=printable(Path(trace).name + (f"  ({keys})" if keys else "")), title_justify="left")
        for b in res.builds:
            c = res.cell(trace, b)
            if c is None:
                continue
            # A cell of several lines, one per rule: Text, so row() keeps its line breaks.
            inv = [Text(_rules_of(c.rules, i)) for i in invariants]
            div = [", ".join(f"{k} {n}" for k, n in sorted(c.divergences.items()))] if kinds else []
            assert_at = f"#{c.capacity_assert_call}" if c.capacity_assert_call is not None else ""
            row(t, b, c.status, c.kernels, *inv, *div, assert_at, style=STATUS_STYLE.get(c.status))
        # A log or a file is not 80 columns wide: do not fold a table meant to be read whole.
        out.print(t, width=None if out.is_terminal else 240)
        for b in res.builds:
            c = res.cell(trace, b)
            if c is not None and c.message and c.status not in ("clean", "violation", "divergence"):
                say(f"  {b}: {c.status}: {c.message}")
    say(f"{len(res.cells)} runs in {res.wall_s:.1f} s; kvreplay show RUN for one, kvreplay matrix ... --json for all")
    raise typer.Exit(res.exit_code)


def _rules_of(rules: dict[str, int], invariant: str) -> str:
    """Every rule of ``invariant`` the run broke, by its first call: two builds that
    break the same invariant by different rules must not look the same."""
    mine = sorted((call, key.split("/", 1)[1]) for key, call in rules.items() if key.split("/", 1)[0] == invariant)
    return "\n".join(f"#{call} {printable(rule)}" for call, rule in mine)


def write_matrix_report(res: Any, path: Path, db: str | None) -> None:
    from kvreplay.report.reports import matrix_report, write_report, write_run_pages
    from kvreplay.store.db import open_store

    st = open_store(db)
    try:
        links = write_run_pages(st, [c.run_id for c in res.cells if c.run_id], path)
    finally:
        st.close()
    write_report(matrix_report(res.to_dict(), {str(k): v for k, v in links.items()}), path)
    say(f"report: {path} (and {len(links)} run page(s) in {path.stem}-runs/)", to_err=True)
