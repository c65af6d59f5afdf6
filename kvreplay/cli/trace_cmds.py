"""Commands that make and describe traces: synth, inspect, builds."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import typer
from rich.table import Table

from kvreplay.cli import base
from kvreplay.cli.base import JSON_HELP, URI_HELP, app, emit_json, out, progress, say
from kvreplay.cli.render import row


@app.command()
def synth(
    scenario: str = typer.Argument(..., help="decode | disagg-mtp | radix-swa"),
    out_path: str = typer.Option(..., "-o", "--out", help="Trace file to write (Parquet): a path or a URI."),
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
    checkpoint_every: int = typer.Option(
        0, help="Write a checkpoint every N calls (0: none), where replay --jobs can split the trace."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Drive a pool the way an SGLang decode server does; record the trace.

    Example: kvreplay synth disagg-mtp --requests 2000 -o /tmp/t.parquet
    """
    from kvreplay.workload.synth import SynthConfig, synthesize

    cfg = SynthConfig(
        scenario=scenario, out=out_path, requests=requests, seed=seed, workload=workload, build=build,
        page_size=page_size, full_size=full_size, swa_size=swa_size, window=window, k=k,
        block_tokens=block_tokens, max_running=max_running, length_scale=length_scale, speedup=speedup,
        device=device, checkpoint_every=checkpoint_every,
    )
    command = "kvreplay " + " ".join(shlex.quote(a) for a in base.argv)
    with progress(f"synth {scenario}", "requests") as cb:
        result = synthesize(cfg, progress=cb, command=command)
    if as_json:
        emit_json({**result.__dict__, "path": str(result.path)})
        return
    say(f"wrote {result.path}: {result.calls} calls ({result.rows} rows), {result.requests_done} requests, "
        f"{result.steps} steps, {result.retractions} retractions, {result.evictions} evictions "
        f"in {result.wall_s:.1f}s ({result.build})")


@app.command()
def inspect(
    trace: str = typer.Argument(..., help="Trace file (Parquet), rotated trace directory, or a directory of traces "
                       "(hive-partitioned: host=.../date=.../rank=...)." + URI_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Describe a trace: pool, calls per method, time span, peak use, size.

    Given a directory of traces (host=.../date=.../rank=... partitions), list them
    with their partition keys, pool, calls and size.
    """
    from kvreplay.trace.summary import is_trace_directory_corpus, summarize, summarize_corpus

    if is_trace_directory_corpus(trace):
        listed = summarize_corpus(trace)
        if as_json:
            emit_json([{"trace": t.name, "location": t.location, "partition": t.partition, **s.to_dict()}
                       for t, s in listed])
            return
        keys = sorted({k for t, _ in listed for k in t.partition})
        table = Table("trace", *keys, "pool", "calls", "peak use", "bytes")
        for t, s in listed:
            row(table, t.name, *(t.partition.get(k, "-") for k in keys), f"{s.meta['family']}", s.calls,
                ", ".join(f"{k} {v}" for k, v in s.peak_used.items()), s.file_bytes)
        out.print(table)
        say(f"{len(listed)} traces, {sum(s.calls for _, s in listed)} calls in {trace}")
        return
    s = summarize(trace)
    if as_json:
        emit_json(s.to_dict())
        return
    m = s.meta
    say(f"{s.path}  schema v{m['schema_version']}", "bold")
    say(f"pool      {m['pool_class']} ({m['family']})  {json.dumps(m['ctor_args'], sort_keys=True)}")
    say(f"recorded  host {m['host'] or '?'}  pid {m['pid']}  rank {m['rank'] or '-'}  at {m['start_time']}")
    say(f"versions  {', '.join(f'{k} {v}' for k, v in m['source_version'].items())}")
    if m.get("extra", {}).get("command"):
        say(f"made by   {m['extra']['command']}")
    say(f"calls     {s.calls} calls, {s.nested_rows} nested sub-allocator rows; {s.exceptions} raised, "
        f"{s.none_results} out-of-memory (None)")
    say(f"span      {s.time_span_s:.3f} s")
    say("peak use  " + ", ".join(f"{k} {v} tokens" for k, v in s.peak_used.items()))
    bpi = f"{s.bytes_per_index:.2f}" if s.bytes_per_index is not None else "-"
    say(f"size      {s.file_bytes} bytes, {s.recorded_indices} recorded indices, {bpi} bytes/index")
    t = Table("method", "calls")
    for name, n in s.calls_per_method.items():
        row(t, name, n)
    out.print(t)
    for note in s.notes:
        say(f"note: {note}")


@app.command("builds")
def list_builds(as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """List the builds: builtin pools, bug variants and other build kinds."""
    from kvreplay.builds import sglang as sglang_adapter
    from kvreplay.pools.registry import BUILTINS

    rows = [{"build": f"builtin:{b.name}", "family": b.family, "summary": b.summary} for b in BUILTINS.values()]
    if as_json:
        emit_json(rows)
        return
    t = Table("build", "family", "what it is")
    for r in rows:
        row(t, r["build"], r["family"], r["summary"])
    out.print(t)
    ver = sglang_adapter.version()
    say("Also: py:MODULE:CLASS (any importable allocator class); sglang (the installed sglang's allocator "
        f"for the trace's family{': sglang ' + ver + ' here' if ver else ': not installed here'}); "
        "sglang==VERSION (that release's pool code, fetched once into the kvreplay cache and replayed in its "
        "own process; sglang==A..B for every release from A to B where a command takes several builds); "
        "git:REPO@REV[:MODULE:CLASS] (pool code at a revision, replayed in its own process).")
