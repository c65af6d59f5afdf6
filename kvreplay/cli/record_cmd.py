"""``kvreplay record``: run a server with every allocator it builds recorded."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvreplay.cli.base import JSON_HELP, MANY, REQUESTS, SCALE, SEED, app, emit_json, say, within
from kvreplay.errors import KvreplayError
from kvreplay.recorder.switch_values import FLIGHT_MAX, PART_S_MAX, PART_S_MIN
from kvreplay.text import printable

if TYPE_CHECKING:
    from kvreplay.recorder.live import LiveRecording
    from kvreplay.workload.drive import DriveResult

KEEP_MB_MIN, KEEP_MB_MAX = 0.001, 1e9  # a KiB at least: less would round to 0 bytes, "keep all"
TOKENS_MAX = 1 << 24  # a request's lengths (workload/requests.py bounds a trace's the same)
DRIVE_S = within(0.001, 86400, "0.001 to 86400 seconds")

# The options are declared once, here, so each command's signature is a list of what it
# takes, one line each. (As defaults, not Annotated: tests/test_hostile_config.py finds a
# numeric option's bound on its default.)
AS_JSON = typer.Option(False, "--json", help=JSON_HELP)

# -- record's options ------------------------------------------------------------------------
COMMAND = typer.Argument(None, help="The command to run, after --.")
OUT_DIR = typer.Option(..., "--out", "-o", help="Directory for the traces (created if missing).")
CLASSES = typer.Option(
    [], "--class", help="MODULE:CLASS of an allocator to record (repeatable). "
    "Default: sglang's token, paged and SWA allocators.")
PRINT_ENV = typer.Option(False, "--print-env",
                         help="Print the environment variables to set instead of running anything.")
FLIGHT = typer.Option(0, "--flight",
                      callback=within(0, FLIGHT_MAX, f"0 (off) or the calls to keep, at most {FLIGHT_MAX}"),
                      help="Flight-recorder mode: keep only each allocator's last N calls "
                      "in memory and write kvreplay-flight-PID-N.parquet when a call raises or the process "
                      "gets SIGUSR2 (kill -USR2 PID).")
COUNTERS_EVERY = typer.Option(1, "--counters-every", metavar="N",
                              callback=within(0, MANY, f">= 0 (0: never read the counters), at most {MANY}"),
                              help="Read the pool's counters (available sizes) after every Nth "
                              "state-changing call instead of every one, for less overhead; replay "
                              "compares them where they were read. 0: never.")
CHECKPOINT_EVERY = typer.Option(0, "--checkpoint-every", metavar="N",
                                callback=within(0, MANY, f">= 0 (0: no checkpoints), at most {MANY}"),
                                help="Write a checkpoint every N calls (0: none): replay --jobs splits "
                                "the trace there. Costs the invariant checker's time per call.")
WATCH = typer.Option(False, "--watch", help="Check the pool's invariants on the calls as they are "
                     "written, in the trace writer's process (off the server's core): each rule broken "
                     "is printed within a second of its call, and a minimized reproducer of it is "
                     "written beside the trace when the server stops (repro-TRACE-N.parquet). A "
                     "violation makes the exit code 1.")
STOP_ON_VIOLATION = typer.Option(False, "--stop-on-violation", help="With --watch: send the server "
                                 "SIGTERM at the first violation (CI of a server build).")
METRICS_PORT = typer.Option(0, "--metrics-port", metavar="PORT",
                            callback=within(0, 65535, "a port number (1-65535; 0: none)"),
                            help="Serve the recorders' counters "
                            "(calls, rows, bytes, calls dropped and unchecked, violations by rule, writer "
                            "lag) at http://127.0.0.1:PORT/metrics in Prometheus's text format.")
MINIMIZE_S = typer.Option(60.0, "--minimize-s", metavar="SECONDS",
                          callback=within(0, 86400, "0..86400 seconds"), help="With --watch: time to spend "
                          "minimizing each finding after the server stops (0: no reproducers).")
PART_S = typer.Option(600.0, "--part-s", metavar="SECONDS", callback=within(
                      PART_S_MIN, PART_S_MAX, f">= 0 (0: no cut by time; else {PART_S_MIN:g} to "
                      f"{PART_S_MAX:g} seconds)", or_zero=True), help="Start a new part of each trace "
                      "every SECONDS: a trace is a directory of parts (part-NNNNNN.parquet), each of "
                      "which replays alone from the pool's snapshot at its start, and the directory "
                      "replays as one trace. --part-s 0 --part-rows 0: one file per trace.")
PART_ROWS = typer.Option(1_000_000, "--part-rows", metavar="N",
                         callback=within(0, MANY, f">= 0 (0: no cut by rows), at most {MANY}"),
                         help="Also start a new part after N rows "
                         "(about 100 bytes each on disk).")
KEEP_MB = typer.Option(1024.0, "--keep-mb", metavar="MB", callback=within(
                       KEEP_MB_MIN, KEEP_MB_MAX, f">= 0 (0: keep all; else {KEEP_MB_MIN:g} to "
                       f"{KEEP_MB_MAX:g} MB)", or_zero=True), help="Keep at most MB megabytes of closed "
                       "parts per trace: the oldest are deleted (0: keep all).")
KEEP_PARTS = typer.Option(0, "--keep-parts", metavar="N",
                          callback=within(0, MANY, f">= 0 (0: no bound by count), at most {MANY}"),
                          help="Keep at most the last N closed parts per "
                          "trace (0: no bound by count).")
CPU_COMPAT = typer.Option(False, "--cpu-compat", help="Patch the server so paths its engine only "
                          "runs on a GPU run on this CPU (sglang: speculative decoding's draft tree in "
                          "Triton's interpreter; vLLM: asynchronous scheduling, which its CPU platform "
                          "turns off). Each patch is named on stderr as it is applied; none "
                          "touches an allocator. docs/recording.md lists them.")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def record(
    command: list[str] = COMMAND,
    out_dir: Path = OUT_DIR,
    classes: list[str] = CLASSES,
    print_env: bool = PRINT_ENV,
    flight: int = FLIGHT,
    counters_every: int = COUNTERS_EVERY,
    checkpoint_every: int = CHECKPOINT_EVERY,
    watch: bool = WATCH,
    stop_on_violation: bool = STOP_ON_VIOLATION,
    metrics_port: int = METRICS_PORT,
    minimize_s: float = MINIMIZE_S,
    part_s: float = PART_S,
    part_rows: int = PART_ROWS,
    keep_mb: float = KEEP_MB,
    keep_parts: int = KEEP_PARTS,
    cpu_compat: bool = CPU_COMPAT,
    as_json: bool = AS_JSON,
) -> None:
    """Run a decode server with every allocator it builds recorded.

    Every Python process the command starts (sglang's scheduler
    subprocesses too) records each allocator it constructs into OUT as
    kvreplay-PID[-RANK]-N.parquet: a directory of parts, a new one every
    10 minutes or million rows, the last GiB of them kept, so a server can
    be recorded for days. Ctrl-C and SIGTERM are passed to the command;
    traces are finished on exit. Exits with the command's exit code.

    Example: kvreplay record --out traces/live -- python -m
    sglang.launch_server --model-path ...

    Launching servers your own way: kvreplay record --out DIR --print-env
    prints the variables (KVREPLAY_RECORD_DIR, PYTHONPATH) to export
    instead.

    Always on, watched: kvreplay record --out DIR --watch --metrics-port
    9400 -- python -m sglang.launch_server ...  prints each invariant
    violation as it happens and serves the counters on /metrics.
    """
    from kvreplay.recorder.live import launch_keys, record_command
    from kvreplay.recorder.rotation import Rotation

    # (each number's range is its option's callback: refused before anything here runs)
    if stop_on_violation and not watch:
        raise KvreplayError("--stop-on-violation needs --watch (it stops at what the watch finds)")
    rotation = Rotation(part_rows, part_s, keep_parts, math.ceil(keep_mb * (1 << 20)))
    switches: dict[str, Any] = dict(flight=flight, counters_every=counters_every, checkpoint_every=checkpoint_every,
                                    watch="check" if watch else "", rotation=rotation, cpu_compat=cpu_compat)
    env = _checked_env(out_dir, classes, switches)
    if print_env:
        _print_env(env, launch_keys(classes, **switches), as_json)
        return
    res = record_command(command or [], out_dir, classes, **switches, stop_on_violation=stop_on_violation,
                         metrics_port=metrics_port, on_finding=(lambda f: None) if as_json else _say_finding,
                         on_metrics=lambda url: say(f"kvreplay: counters at {url}", to_err=True))
    if watch and minimize_s > 0:
        _reproduce_violations(res, minimize_s, as_json)
    _show_recording(res, as_json)
    raise typer.Exit(res.exit_code)


def _checked_env(out_dir: Path, classes: list[str], switches: dict[str, Any]) -> dict[str, str]:
    """The environment every recorded process will read: these flags, and the user's own
    KVREPLAY_* it inherits (a rank, the recorder, the writer). A value one of them would
    refuse is refused here, before the command starts, not turned into a recording left off."""
    from kvreplay.recorder.live import record_env
    from kvreplay.recorder.switch_values import check_compat, read_switches

    env = record_env(out_dir, classes, **switches)
    read_switches(env)
    check_compat(env)
    return env


def _print_env(env: dict[str, str], keys: list[str], as_json: bool) -> None:
    if as_json:
        emit_json({k: env[k] for k in keys})
    else:
        for k in keys:
            say(f"export {k}={shlex.quote(env[k])}")


def _reproduce_violations(res: LiveRecording, minimize_s: float, as_json: bool) -> None:
    """--watch: a minimized reproducer of each violation found, beside its trace."""
    if not any(f.get("kind") == "violation" for f in res.findings):
        return
    from kvreplay.jobs.minimize import reproduce_findings

    res.reproducers = reproduce_findings(res.findings, res.out, minimize_s,
                                         progress=None if as_json else lambda m: say(m, to_err=True),
                                         traces=res.traces)


def _say_finding(f: dict[str, Any]) -> None:
    # A finding is read back from a file: each is one line, whatever its fields hold.
    if f.get("kind") == "watch-stopped":
        say(printable(f"kvreplay watch: {f.get('trace')}: no longer checking: {f.get('reason')}"), "yellow",
            to_err=True)
        return
    req = f" (request {f['request']})" if f.get("request") else ""
    say(printable(f"kvreplay watch: {f.get('kind')} {f.get('rule')} at call #{f.get('call')} {f.get('method')}"
                  f"{req} in {f.get('trace')}: {f.get('message')}"), "red", to_err=True)


def _show_recording(res: LiveRecording, as_json: bool) -> None:
    """What a recording left: its traces, what the watch stopped on, its reproducers (as
    text, on stderr)."""
    if as_json:
        emit_json(res.to_dict())
        return
    say(f"{len(res.traces)} trace(s) in {res.out}:" if res.traces else f"no traces written to {res.out}",
        to_err=True)
    for p in res.traces:
        say(f"  {p}", to_err=True)
    for p in res.unfinished:
        say(f"  unfinished: {p}", to_err=True)
    if res.forged:
        say(f"ignored {res.forged} line(s) of {res.out / 'kvreplay-watch.jsonl'} that no writer of this run "
            "wrote", "yellow", to_err=True)
    if res.stopped_on:
        say(f"stopped the command at {res.stopped_on.get('rule')} (call #{res.stopped_on.get('call')})",
            to_err=True)
    for r in res.reproducers:
        if r.get("reproducer"):
            say(f"  reproducer of {r['rule']}: {r['reproducer']} ({r['calls']} of {r['from_calls']} calls; "
                f"kvreplay replay it --build {r['build']})", to_err=True)
        else:
            say(f"  no reproducer of {r['rule']} in {r['trace']}: {r.get('error')}", to_err=True)


# -- drive's options -------------------------------------------------------------------------
URL = typer.Argument(..., help="The server, e.g. http://127.0.0.1:30000.")
WORKLOAD = typer.Option(None, "--workload", "-w",
                        help="Request trace: Mooncake JSONL (hash_ids become shared prompt prefixes) or "
                        "Azure CSV (lengths only). Default: a seeded stream with shared prefixes.")
REQUEST_COUNT = typer.Option(100, "--requests", "-n", callback=REQUESTS,
                             help="How many of the trace's requests to send.")
API = typer.Option("sglang", "--api", help="sglang (native /generate with input_ids) or openai "
                   "(/v1/completions with a token-id prompt: vLLM, sglang).")
MODEL = typer.Option("", "--model", help="Model name for --api openai (default: the server's first).")
CONCURRENCY = typer.Option(8, "--concurrency", "-c", callback=within(1, 1024, "1..1024 requests"),
                           help="Most requests in flight at once (1..1024).")
TIME_SCALE = typer.Option(0.0, "--time-scale", callback=within(0, 1e6, "a number >= 0 (0: no pauses), "
                                                               "at most 1e6"),
                          help="Keep the trace's arrival times, multiplied by this (0.1: ten times "
                          "faster); 0 sends as fast as --concurrency allows.")
LENGTH_SCALE = typer.Option(1.0, "--length-scale", callback=SCALE,
                            help="Multiply prompt lengths (Mooncake prompts average 15k tokens: "
                            "0.03 makes them CPU-sized, prefix sharing kept).")
OUTPUT_SCALE = typer.Option(1.0, "--output-scale", callback=SCALE, help="Multiply output lengths.")
MAX_OUTPUT = typer.Option(0, "--max-output", callback=within(0, TOKENS_MAX, f"0 (as the trace says) to "
                                                             f"{TOKENS_MAX} tokens"),
                          help="Cap each request's output tokens (0: as the trace says).")
BLOCK_TOKENS = typer.Option(16, "--block-tokens", callback=within(1, TOKENS_MAX, f"1 to {TOKENS_MAX} tokens"),
                            help="Tokens per shared prompt block after scaling (the server's page size).")
VOCAB = typer.Option(2048, "--vocab", callback=within(4, MANY, f"a vocabulary size from 4 to {MANY}"),
                     help="Token ids are drawn below this (the model's vocabulary size).")
STREAM_SEED = typer.Option(0, "--seed", callback=SEED, help="Seed of the generated stream (no --workload).")
WAIT = typer.Option(0.0, "--wait", metavar="SECONDS", callback=within(0, 86400, "0..86400 seconds"),
                    help="Wait up to this long for the server to answer (one still starting: "
                    "sglang on CPU takes minutes); 0: it must answer now.")
TIMEOUT = typer.Option(600.0, "--timeout", metavar="SECONDS", callback=DRIVE_S,
                       help="Most a request may take, its whole answer included; past it the request "
                       "counts as failed.")
STALL = typer.Option(None, "--stall", metavar="SECONDS", show_default=False, callback=DRIVE_S,
                     help="Stop when the server has answered nothing at all (no success, no error) for "
                     "this long while requests are in flight: those and the requests not yet sent "
                     "count as failed (exit 1). Time between arrivals with nothing in flight does not "
                     "count. Default: the larger of 60 s and --timeout.")
DEADLINE = typer.Option(86400.0, "--deadline", metavar="SECONDS",
                        callback=within(0.001, 30 * 86400, "0.001 to 2592000 seconds (30 days)"),
                        help="Most the whole run may take, from the first request (the --wait comes "
                        "before): past it, what is in flight or not yet sent counts as failed (exit 1).")
DISAGG_DECODE = typer.Option(False, "--disagg-decode",
                             help="The server is a disaggregated decode server (sglang: "
                             "--disaggregation-mode decode --disaggregation-transfer-backend fake): each "
                             "request says its prompt was prefilled elsewhere, and the fake backend hands "
                             "its KV over at once. No prefill server is needed.")


@app.command()
def drive(
    url: str = URL,
    workload: Path = WORKLOAD,
    requests: int = REQUEST_COUNT,
    api: str = API,
    model: str = MODEL,
    concurrency: int = CONCURRENCY,
    time_scale: float = TIME_SCALE,
    length_scale: float = LENGTH_SCALE,
    output_scale: float = OUTPUT_SCALE,
    max_output: int = MAX_OUTPUT,
    block_tokens: int = BLOCK_TOKENS,
    vocab: int = VOCAB,
    seed: int = STREAM_SEED,
    wait: float = WAIT,
    timeout: float = TIMEOUT,
    stall: float = STALL,
    deadline: float = DEADLINE,
    disagg_decode: bool = DISAGG_DECODE,
    as_json: bool = AS_JSON,
) -> None:
    """Send a public request trace to a running server: real traffic to record.

    Prompts are token ids (a model without a tokenizer serves them:
    --skip-tokenizer-init); requests whose Mooncake hash_ids agree share
    their leading tokens, so the radix cache sees the trace's prefix reuse.
    Prints progress on stderr and a summary: requests, tokens, prefix-cache
    hits, errors, elapsed. Exit 0 when every request succeeded, 1 when some
    failed (or a server that stopped answering stopped drive: --stall,
    --deadline), 2 when the server cannot be reached or the trace is bad.

    Example: kvreplay drive http://127.0.0.1:30000 --wait 600 -w workloads/
    mooncake/synthetic_trace.jsonl -n 300 --length-scale 0.03 -c 16
    """
    from kvreplay.cli.base import progress
    from kvreplay.workload.drive import DriveConfig
    from kvreplay.workload.drive import drive as run_drive
    from kvreplay.workload.requests import load_requests

    if block_tokens < 1 or vocab <= 3:
        raise KvreplayError("--block-tokens must be >= 1 and --vocab > 3")
    if length_scale <= 0 or output_scale <= 0:
        raise KvreplayError(f"--length-scale and --output-scale must be positive, got {length_scale}, {output_scale}")
    reqs = load_requests(workload, count=requests, seed=seed, block_tokens=block_tokens, length_scale=length_scale,
                         output_scale=output_scale)
    cfg = DriveConfig(url=url, api=api, model=model, concurrency=concurrency, time_scale=time_scale, vocab=vocab,
                      block_tokens=block_tokens, max_output=max_output, seed=seed, wait_s=wait, timeout_s=timeout,
                      disagg_decode=disagg_decode, stall_s=stall, deadline_s=deadline)
    with progress(f"drive {url}", "requests") as cb:
        res = run_drive(cfg, reqs, lambda r, total: cb(r.ok + r.errors, total), _WaitingNotice(url, wait))
    _say_drive(res, as_json)
    if res.errors:
        raise typer.Exit(1)


class _WaitingNotice:
    """drive's ``waiting``: said at once, then every 15 s, so a log (no terminal) shows the wait too."""

    def __init__(self, url: str, wait_s: float) -> None:
        self.url, self.wait_s, self.next_at = url, wait_s, 0.0

    def __call__(self, seconds: float) -> None:
        if seconds >= self.next_at:
            self.next_at = seconds + 15
            say(f"waiting for {self.url} to answer ({seconds:.0f} s of {self.wait_s:.0f})", to_err=True)


def _say_drive(res: DriveResult, as_json: bool) -> None:
    if as_json:
        emit_json(res.to_dict())
    else:
        share = 100 * res.cached_tokens / res.prompt_tokens if res.prompt_tokens else 0
        hit = f", {share:.0f}% of them prefix-cache hits" if res.prompt_tokens else ""
        say(f"{res.ok}/{res.requests} requests served in {res.elapsed_s:.1f} s: {res.prompt_tokens} prompt tokens"
            f"{hit}, {res.output_tokens} output tokens")
    kinds = ", ".join(f"{k} x{n}" for k, n in sorted(res.error_kinds.items()))
    if res.stopped:  # one line, --json or not: the run ended before its requests did
        say(f"kvreplay: drive stopped early: {res.stopped} ({res.errors} of {res.requests} failed)", "red",
            to_err=True)
    elif res.errors and not as_json:
        say(f"{res.errors} failed: {kinds}", "red", to_err=True)
