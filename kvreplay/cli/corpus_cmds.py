"""Commands over a saved corpus: ci, corpus add, corpus check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from kvreplay.cli.base import DB_HELP, JOBS, JSON_HELP, RAY_HELP, TIMEOUT_S, app, emit_json, say, within

# A corpus holds small traces: its size bound is a number of megabytes, never off.
MAX_MB = within(0.001, 1e6, "a size in megabytes from 0.001 to 1000000")


@app.command("ci")
def corpus_ci(
    corpus: str = typer.Argument("traces", help="Corpus directory: one holding manifest.json, or a directory of "
                                 "traces (hive-partitioned: host=.../date=.../rank=...), each of which must replay "
                                 "clean. A path or a URI (s3://, gs://, hdfs://, file://)."),
    build: str = typer.Option(..., "--build", "-b", help="Build to replay the corpus on."),
    jobs: int = typer.Option(1, "--jobs", "-j", callback=JOBS, help="Worker processes."),
    junit: Path | None = typer.Option(None, "--junit", help="Write JUnit XML here (one testcase per trace and mode)."),
    summary: Path | None = typer.Option(None, "--summary", help="Write a Markdown summary here (for a PR comment)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    timeout: float = typer.Option(1800.0, "--timeout", callback=TIMEOUT_S,
                                  help="Seconds one case may run; a case past it is an "
                                  "error (a build that never returns does not hold up the corpus)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    ray: str | None = typer.Option(None, "--ray", help=RAY_HELP, metavar="[ADDRESS]"),
    report_path: Path | None = typer.Option(None, "--report", help="Also write an HTML index of the corpus run "
                                            "here, with one report per trace beside it (NAME-runs/); the "
                                            "--summary links to them."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Replay a corpus on a build and hold it to the manifest's expectations.

    Exit 0 only when every expectation holds: a trace the manifest says is
    clean must replay clean, and a known-bad one must show its violations
    (an unexpected clean replay fails too). Traces of another pool family
    are skipped.
    """
    from kvreplay.corpus.ci import ok, run_corpus
    from kvreplay.corpus.render import junit_xml, markdown_summary
    from kvreplay.report.reports import check_report_path

    if report_path is not None:
        check_report_path(report_path)
    if junit is not None:
        check_report_path(junit, "--junit")
    if summary is not None:
        check_report_path(summary, "--summary")

    def show(r: Any, done: int, total: int) -> None:
        if not as_json:
            colour = {"pass": "green", "fail": "red", "error": "red", "skip": "dim"}[r.outcome]
            keys = " ".join(f"{k}={v}" for k, v in r.case.partition.items())
            say(f"[{done}/{total}] {r.outcome:5s} {r.case.name}{f'  ({keys})' if keys else ''}", colour, to_err=True)

    results = run_corpus(corpus, build, jobs=jobs, db=db, device=device, timeout_s=timeout, ray=ray, progress=show)
    if junit:
        junit.write_text(junit_xml(results, build))
    pages: dict[int, str] = {}
    if report_path is not None:
        pages = write_ci_report(results, build, report_path, db)
    if summary:
        here = summary.resolve().parent
        links = {k: os.path.relpath(report_path.resolve().parent / v, here) for k, v in pages.items()} \
            if report_path is not None else {}
        summary.write_text(markdown_summary(results, build, links))
    passed = ok(results)
    if as_json:
        emit_json({"build": build, "ok": passed, "results": [r.to_dict() for r in results]})
    else:
        for r in results:
            for p in r.problems if r.outcome in ("fail", "error") else []:
                say(f"{r.case.name}: {p}")
        n = {k: sum(r.outcome == k for r in results) for k in ("pass", "fail", "error", "skip")}
        say(f"{build}: {n['pass']} passed, {n['fail']} failed, {n['error']} errors, {n['skip']} skipped; "
            + ("every expectation holds" if passed else "expectations FAILED"))
    raise typer.Exit(0 if passed else 1)


corpus_app = typer.Typer(help="Keep a trace corpus in order: add traces with their expectations, check it.",
                         no_args_is_help=True)
app.add_typer(corpus_app, name="corpus")


@corpus_app.command("add")
def corpus_add(
    trace: str = typer.Argument(..., help="Trace to add. A path or a URI (s3://, gs://, hdfs://, file://)."),
    name: str = typer.Option(..., "--name", "-n", help="Name in the corpus (the file becomes NAME.parquet)."),
    corpus: Path = typer.Option(Path("traces"), "--corpus", help="Corpus directory."),
    builds: list[str] = typer.Option([], "--build", "-b", help="Build whose replay becomes an expectation "
                                     "(repeatable; default: the builtin pool of the trace's family)."),
    force: bool = typer.Option(False, "--force", help="Replace an entry of the same name."),
    max_mb: float = typer.Option(5.0, "--max-mb", callback=MAX_MB, help="Refuse traces larger than this."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Copy a trace into the corpus, replay it, record what it must show."""
    from kvreplay.corpus.manage import add_trace

    entry = add_trace(trace, name, corpus, builds or None, force=force, max_mb=max_mb)
    if as_json:
        emit_json(entry)
    else:
        for x in entry["expect"]:
            what = x["status"] + ("" if x["status"] == "clean" else ": " + ", ".join(
                f"{v['invariant']}/{v['rule']} at call #{v['call']} {v['method']}" for v in x["violations"]))
            say(f"{name}: {x['build']} {what}")
        say(f"added {corpus / entry['file']}")


@corpus_app.command("check")
def corpus_check(
    corpus: Path = typer.Argument(Path("traces"), help="Corpus directory."),
    max_mb: float = typer.Option(5.0, "--max-mb", callback=MAX_MB, help="Largest trace allowed."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Check a corpus: files readable and unchanged, entries backed, sizes."""
    from kvreplay.corpus.manage import check_corpus

    res = check_corpus(corpus, max_mb)
    if as_json:
        emit_json({"corpus": res.corpus, "entries": res.entries, "ok": res.ok, "problems": res.problems})
    else:
        for p in res.problems:
            say(p)
        say(f"{res.corpus}: {res.entries} entries, " + ("ok" if res.ok else f"{len(res.problems)} problem(s)"))
    raise typer.Exit(0 if res.ok else 1)


def write_ci_report(results: list[Any], build: str, path: Path, db: str | None) -> dict[int, str]:
    """The corpus run's index page and one page per stored run; run id -> href from the index."""
    from kvreplay.report.reports import ci_index, write_report, write_run_pages
    from kvreplay.store.db import open_store

    st = open_store(db)
    try:
        pages = write_run_pages(st, [r.run_id for r in results if r.run_id], path)
    finally:
        st.close()
    rows = [{"trace": r.case.trace, "mode": r.case.mode, "status": r.status or r.outcome,
             "expected": r.case.expected(), "ok": r.outcome in ("pass", "skip"), "run_id": r.run_id}
            for r in results]
    links = {r.case.trace: pages[r.run_id] for r in results if r.run_id in pages}
    write_report(ci_index(rows, links, build), path)
    say(f"report: {path} (and {len(pages)} run page(s) in {path.stem}-runs/)", to_err=True)
    return pages
