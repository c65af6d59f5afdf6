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
from rich.table import Table

from kvreplay import __version__
from kvreplay.errors import EXIT_CRASH, KvreplayError

EPILOG = (
    "Exit codes: 0 clean, 1 violation or divergence found, 2 bad input or usage, "
    "125 build could not be loaded (git bisect skips it), >128 kvreplay crashed."
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
    """Drive a pool the way an SGLang decode server does and record the trace.

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
    """Describe a trace: pool config, calls per method, time span, peak usage, size."""
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
    """List the pool builds kvreplay can construct (builtin pools and bug variants)."""
    from kvreplay.replayer.builds import BUILTINS

    rows = [{"spec": f"builtin:{b.name}", "family": b.family, "summary": b.summary} for b in BUILTINS.values()]
    if as_json:
        _emit_json(rows)
        return
    table = Table("build", "family", "what it is")
    for r in rows:
        table.add_row(r["spec"], r["family"], r["summary"])
    out.print(table)
    out.print("Also: py:MODULE:CLASS for any importable allocator class (e.g. an installed sglang's).")


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
