"""Commands that make and describe traces: synth, inspect, builds."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from kvreplay.cli import base
from kvreplay.cli.base import (
    JSON_HELP,
    MANY,
    REQUESTS,
    SCALE,
    SEED,
    SPEEDUP,
    URI_HELP,
    app,
    emit_json,
    out,
    progress,
    say,
    within,
)
from kvreplay.cli.render import row
from kvreplay.contract.registry import unit_of
from kvreplay.errors import BadInput
from kvreplay.limits import MAX_POOL_SLOTS, shown
from kvreplay.text import printable

if TYPE_CHECKING:
    from kvreplay.workload.synth import SynthResult

# A size or count of the pool synth builds: at least 1, and what a trace may declare.
TOKENS = within(1, MAX_POOL_SLOTS, f"a whole number from 1 to {MAX_POOL_SLOTS} (KVREPLAY_MAX_POOL_SLOTS)")

# Options are declared here, once, so each command's signature is a list of what it takes,
# one line each (as defaults, not Annotated: tests/test_hostile_config.py finds a numeric
# option's bound on its default).
AS_JSON = typer.Option(False, "--json", help=JSON_HELP)

# -- synth's options -------------------------------------------------------------------------
SCENARIO = typer.Argument(..., help="decode | disagg-mtp | radix-swa (sglang's pools) | vllm-prefix "
                          "(vLLM's KV-cache manager) | hybrid-mamba (sglang's state pool of a "
                          "state-space hybrid model)")
SYNTH_OUT = typer.Option(..., "-o", "--out", help="Trace file to write (Parquet): a path or a URI.")
SYNTH_REQUESTS = typer.Option(200, "--requests", "-n", callback=REQUESTS, help="Number of requests to run.")
SYNTH_SEED = typer.Option(0, callback=SEED, help="Seed for the request generator and accept lengths.")
SYNTH_WORKLOAD = typer.Option(None, help="Mooncake JSONL or Azure CSV request trace; default: seeded generator.")
SYNTH_BUILD = typer.Option(None, help="Pool build to drive (default: the scenario's builtin pool).")
PAGE_SIZE = typer.Option(4, callback=TOKENS, help="Tokens per page.")
FULL_SIZE = typer.Option(2048, callback=TOKENS, help="Full-attention pool size in tokens (the paged pool's "
                         "size).")
SWA_SIZE = typer.Option(512, callback=TOKENS, help="SWA pool size in tokens.")
WINDOW = typer.Option(32, callback=TOKENS, help="Sliding-window size in tokens.")
DRAFT_TOKENS = typer.Option(3, callback=within(0, 1024, "0 (no speculation) or more draft tokens per step, at most "
                                               "1024"),
                            help="MTP draft tokens per step (disagg-mtp; 0: no speculation, one alloc_decode per "
                            "step).")
BLOCK_TOKENS = typer.Option(16, callback=TOKENS, help="Tokens per prefix-cache block (multiple of the page "
                            "size).")
MAX_RUNNING = typer.Option(64, callback=TOKENS, help="Most requests decoding at once.")
LENGTH_SCALE = typer.Option(1.0, callback=SCALE, help="Scale a workload file's token lengths (e.g. 0.02).")
OUTPUT_SCALE = typer.Option(None, callback=SCALE, help="Scale its output lengths alone (default: "
                            "--length-scale).")
SGLANG_SCHEDULER = typer.Option(
    False, "--sglang-scheduler", help="Free groups, SWA eviction and the end of the trace as sglang 0.5.23's "
    "scheduler does them (a free group per batch, SWA evicted every 128 tokens, the cache kept at the end): "
    "traces that look like a live server's (kvreplay profile compares them).")
SPEEDUP_BY = typer.Option(1.0, callback=SPEEDUP, help="Divide a workload's arrival times by this "
                          "(1e9: every request at once).")
PREFIX_CACHING = typer.Option(
    True, "--prefix-caching/--no-prefix-caching", help="vllm-prefix: the manager's prefix cache (enable_caching); "
    "off, every freed block goes back unhashed and only the free queue's order decides reuse.")
ATTENTION = typer.Option(
    "full", help="vllm-prefix: the manager's KV-cache groups: full; sliding (one sliding window of --window "
    "tokens: blocks that leave it are freed as the sequence grows); hybrid (a full-attention group and a "
    "sliding-window one sharing the pool); mamba (a hybrid state-space model's state group, its states cached at "
    "block boundaries, beside full attention: prefill chunks end where a state can be cached). Sliding, hybrid "
    "and mamba need --build vllm.")
MAX_MODEL_LEN = typer.Option(
    None, callback=TOKENS,
    help="vllm-prefix: the longest sequence the manager serves, in tokens (default: --full-size). A "
    "sliding window's pool can be smaller: vLLM sizes it for the window plus one step's tokens.")
BATCH_TOKENS = typer.Option(
    2048, callback=TOKENS,
    help="vllm-prefix: tokens the scheduler runs per step (vLLM's max_num_batched_tokens): the chunk "
    "size of a long prompt, and the manager's in-flight token bound.")
SPECULATIVE = typer.Option(
    False, "--speculative", help="radix-swa: speculative decoding as sglang 0.5.23 serves it (EAGLE, top-1 "
    "drafts, --k draft steps): each step keeps every row allocated to twice its draft tokens past what it "
    "committed, whole pages, in one batched alloc_extend, and accepts 1 to --k + 1 tokens.")
DRAFT_ACCEPT = typer.Option(
    0.25, callback=within(0, 1, "a probability, 0 to 1"),
    help="radix-swa --speculative: the chance the target accepts each draft token, in order (0.25: what "
    "the live tiny random model accepted; a trained draft model accepts far more).")
STATE_SLOTS = typer.Option(
    64, callback=TOKENS,
    help="hybrid-mamba: slots in the state pool (sglang's --max-mamba-cache-size): each request holds three "
    "(its state and a tracking pair), the prefix cache the rest.")
ABORTS = typer.Option(0.05, callback=within(0, 1, "a share of requests, 0 to 1"),
                      help="hybrid-mamba: the share of requests aborted while they decode.")
NO_EXTRA_BUFFER = typer.Option(
    False, "--no-extra-buffer", help="hybrid-mamba: the pool sglang builds where the extra buffer is not "
    "allowed (any CPU): no tracking pair; the cache copies a prompt's state when it is prefilled and keeps "
    "a finished request's state slot in place.")
EAGLE = typer.Option(
    False, "--eagle", help="vllm-prefix: the server runs an EAGLE drafter of --k tokens: every prefix hit gives "
    "up its last block (the drafter's states for it are not cached) and every allocation reserves --k slots "
    "more.")
SYNTH_DEVICE = typer.Option("cpu", help="Torch device for the pool.")
CHECKPOINT_EVERY = typer.Option(
    0, callback=within(0, MANY, f"0 (no checkpoints) or positive, at most {MANY}"),
    help="Write a checkpoint every N calls (0: none), where replay --jobs can split the trace.")
SET = typer.Option(None, "--set", metavar="NAME=VALUE",
                   help="An option the scenario declares for itself (repeatable); a name it lacks is "
                   "refused with the list of its own.")


@app.command()
def synth(
    scenario: str = SCENARIO,
    out_path: str = SYNTH_OUT,
    requests: int = SYNTH_REQUESTS,
    seed: int = SYNTH_SEED,
    workload: Path | None = SYNTH_WORKLOAD,
    build: str | None = SYNTH_BUILD,
    page_size: int = PAGE_SIZE,
    full_size: int = FULL_SIZE,
    swa_size: int = SWA_SIZE,
    window: int = WINDOW,
    k: int = DRAFT_TOKENS,
    block_tokens: int = BLOCK_TOKENS,
    max_running: int = MAX_RUNNING,
    length_scale: float = LENGTH_SCALE,
    output_scale: float = OUTPUT_SCALE,
    sglang_scheduler: bool = SGLANG_SCHEDULER,
    speedup: float = SPEEDUP_BY,
    prefix_caching: bool = PREFIX_CACHING,
    attention: str = ATTENTION,
    max_model_len: int = MAX_MODEL_LEN,
    batch_tokens: int = BATCH_TOKENS,
    speculative: bool = SPECULATIVE,
    draft_accept: float = DRAFT_ACCEPT,
    state_slots: int = STATE_SLOTS,
    aborts: float = ABORTS,
    no_extra_buffer: bool = NO_EXTRA_BUFFER,
    eagle: bool = EAGLE,
    device: str = SYNTH_DEVICE,
    checkpoint_every: int = CHECKPOINT_EVERY,
    set_: list[str] | None = SET,
    as_json: bool = AS_JSON,
) -> None:
    """Drive a pool the way a decode server's scheduler does; record the trace.

    sglang's scheduler on its token, paged or SWA pool, or vLLM's on its
    KV-cache manager (vllm-prefix: --block-tokens is the block size,
    --full-size the pool's tokens).

    Example: kvreplay synth disagg-mtp --requests 2000 -o /tmp/t.parquet
    Example: kvreplay synth vllm-prefix --requests 300 --block-tokens 32 -o /tmp/v.parquet
    """
    from kvreplay.workload.synth import SynthConfig, synthesize

    cfg = SynthConfig(
        scenario=scenario, out=out_path, requests=requests, seed=seed, workload=workload, build=build,
        page_size=page_size, full_size=full_size, swa_size=swa_size, window=window, k=k,
        block_tokens=block_tokens, max_running=max_running, length_scale=length_scale, output_scale=output_scale,
        speedup=speedup, sglang_scheduler=sglang_scheduler, prefix_caching=prefix_caching, attention=attention,
        max_model_len=max_model_len, batch_tokens=batch_tokens, speculative=speculative, draft_accept=draft_accept,
        eagle=eagle, device=device, checkpoint_every=checkpoint_every, state_slots=state_slots, aborts=aborts,
        no_extra_buffer=no_extra_buffer, params=_settings(set_ or []),
    )
    command = "kvreplay " + " ".join(shlex.quote(a) for a in base.argv)
    with progress(f"synth {scenario}", "requests") as cb:
        result = synthesize(cfg, progress=cb, command=command)
    _show_synth(result, as_json)


def _settings(pairs: list[str]) -> dict[str, str]:
    """``--set NAME=VALUE`` pairs, by name (the scenario types and checks each value)."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.strip():
            raise BadInput(f"--set {shown(pair)}: want NAME=VALUE")
        out[name.strip()] = value.strip()
    return out


def _show_synth(result: SynthResult, as_json: bool) -> None:
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
    as_json: bool = AS_JSON,
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
    # Each field from the footer is escaped whole, newlines too: say() would keep a
    # newline, and a host name must not start a line of its own.
    p = printable
    say(f"{p(s.path)}  schema v{m['schema_version']}", "bold")
    say(f"pool      {p(m['pool_class'])} ({p(m['family'])})  {json.dumps(m['ctor_args'], sort_keys=True)}")
    say(f"recorded  host {p(m['host'] or '?')}  pid {m['pid']}  rank {p(m['rank'] or '-')}  at {p(m['start_time'])}")
    say(f"versions  {', '.join(f'{p(k)} {p(v)}' for k, v in m['source_version'].items())}")
    if m.get("extra", {}).get("command"):
        say(f"made by   {p(m['extra']['command'])}")
    say(f"calls     {s.calls} calls, {s.nested_rows} nested sub-allocator rows; {s.exceptions} raised, "
        f"{s.none_results} out-of-memory (None)")
    if s.folded_reads or s.folded_groups or s.folded_bounds:
        groups = f", {s.folded_groups} empty free groups" if s.folded_groups else ""
        bounds = f", {s.folded_bounds} begins and ends of free groups" if s.folded_bounds else ""
        say(f"folded    {s.folded_reads} counter reads that told nothing new{groups}{bounds}, in {s.rows} rows in all")
    say(f"span      {s.time_span_s:.3f} s")
    say("peak use  " + ", ".join(f"{k} {v} {'blocks' if unit_of(k) == 'blocks' else 'tokens'}"
                                 for k, v in s.peak_used.items()))
    bpi = f"{s.bytes_per_index:.2f}" if s.bytes_per_index is not None else "-"
    say(f"size      {s.file_bytes} bytes, {s.recorded_indices} recorded indices, {bpi} bytes/index")
    t = Table("method", "calls")
    for name, n in s.calls_per_method.items():
        row(t, name, n)
    out.print(t)
    for note in s.notes:
        say(f"note: {printable(note)}")


@app.command("builds")
def list_builds(as_json: bool = AS_JSON) -> None:
    """List the builds: builtin pools, bug variants and other build kinds."""
    from kvreplay.contract.registry import BUILTINS, engines

    rows = [{"build": f"builtin:{b.name}", "family": b.family, "summary": b.summary} for b in BUILTINS.values()]
    if as_json:
        emit_json(rows)
        return
    t = Table("build", "family", "what it is")
    for r in rows:
        row(t, r["build"], r["family"], r["summary"])
    out.print(t)
    kinds = []
    for e in engines():
        ver = _installed_version(e.dists)
        kinds.append(f"{e.name} (the installed engine's pool for the trace's family, {e.summary}: "
                     f"{e.name + ' ' + ver + ' here' if ver else 'not installed here'}) and {e.name}==VERSION (that "
                     f"release's pool code, fetched once into the kvreplay cache and replayed in its own process"
                     f"{'' if e.overlay else ' on the installed ' + e.name + chr(39) + 's dependencies'}; "
                     f"{e.name}==A..B for every release from A to B where a command takes several builds)")
    say("Also: py:MODULE:CLASS (any importable allocator class); " + "; ".join(kinds)
        + "; git:REPO@REV[:MODULE:CLASS] (pool code at a revision, replayed in its own process).")


def _installed_version(dists: tuple[str, ...]) -> str:
    from importlib import metadata

    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return ""


@app.command()
def profile(
    trace: str = typer.Argument(..., help="Trace file (a live recording, or synth's)." + URI_HELP),
    against: str = typer.Option(None, "--against", help="A second trace to set beside it, with the ratio "
                                "second/first (e.g. synth on the same requests beside a live recording)."),
    requests: int = typer.Option(None, "--requests", callback=within(1, MANY, f"a number of requests, 1 to {MANY}"),
                                 help="Requests the first trace served (default: counted "
                                 "from its alloc_extend calls; a token pool's trace cannot tell)."),
    against_requests: int = typer.Option(None, "--against-requests",
                                         callback=within(1, MANY, f"a number of requests, 1 to {MANY}"),
                                         help="The same for --against."),
    as_json: bool = AS_JSON,
) -> None:
    """The shape of a trace's traffic: calls per request by method, tokens per
    extend and per decode step, free groups, occupancy over time, prefix-cache
    hits. With --against, two traces side by side and the ratio of each figure:
    how far the workload model is from a live server on the same requests.

    Example: kvreplay profile traces/live-sglang-paged16.parquet --against /tmp/synth.parquet
    """
    from kvreplay.trace.location import local_path
    from kvreplay.trace.profile import compare
    from kvreplay.trace.profile import profile as profile_of

    a = profile_of(local_path(trace), requests)
    if against is None:
        if as_json:
            emit_json(a.to_dict())
            return
        t = Table(title=printable(f"{trace}: {a.family} pool, {a.calls} calls ({a.counter_reads} counter reads), "
                                  f"{a.requests or '?'} requests"))
        for col in ("figure", "value"):
            t.add_column(col)
        for m, v in a.per_request().items():
            row(t, f"{m} per request", v)
        for name, q in (("extend tokens per request", a.extend_tokens), ("requests per decode step", a.decode_batch),
                        ("slots per free", a.freed_per_free)):
            row(t, name, f"mean {q['mean']}, p50 {q['p50']:g}, p90 {q['p90']:g}, max {q['max']:g}" if q["n"]
                else "- (no such call in this trace)")
        row(t, "frees per free group", a.frees_per_group if a.free_groups else "- (no free group in this trace)")
        row(t, "prefix-cache hit share", "-" if a.prefix_hit is None else a.prefix_hit)
        row(t, "occupancy (10 points)", " ".join(f"{x:.2f}" for x in a.occupancy))
        out.print(t)
        for note in a.notes:
            say(note, "dim")
        return
    b = profile_of(local_path(against), against_requests)
    cmp = compare(a, b)
    if as_json:
        emit_json(cmp.to_dict())
        return
    t = Table(title=printable(f"{against} against {trace}"))
    for col in ("figure", "first", "second", "second/first"):
        t.add_column(col)
    for figure, x, y, r in cmp.rows:
        off = r is not None and abs(r - 1) > 0.10
        row(t, figure, "-" if x is None else x, "-" if y is None else y, "-" if r is None else r,
            style="yellow" if off else None)
    out.print(t)
    say("rows in yellow differ by more than 10%", "dim")
