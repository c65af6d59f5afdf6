"""``kvreplay record``: run a server with every allocator it builds recorded."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from kvreplay.cli.base import JSON_HELP, app, emit_json, say
from kvreplay.errors import KvreplayError


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
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", metavar="N",
                                         help="Write a checkpoint every N calls (0: none): replay --jobs splits "
                                         "the trace there. Costs the invariant checker's time per call."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
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

    if checkpoint_every < 0:
        raise KvreplayError("--checkpoint-every N needs N >= 0 (0: no checkpoints)")
    if counters_every < 0:
        raise KvreplayError("--counters-every N needs N >= 0 (0: never read the counters)")
    if print_env:
        from kvreplay.recorder.switches import CHECKPOINT_ENV, CLASSES_ENV, COUNTERS_ENV, DIR_ENV, FLIGHT_ENV

        env = record_env(out_dir, classes, flight=flight, counters_every=counters_every,
                         checkpoint_every=checkpoint_every)
        keys = [DIR_ENV, "PYTHONPATH"] + [k for k, asked in ((CLASSES_ENV, bool(classes)), (FLIGHT_ENV, flight > 0),
                                                              (COUNTERS_ENV, counters_every != 1),
                                                              (CHECKPOINT_ENV, checkpoint_every > 0)) if asked]
        if as_json:
            emit_json({k: env[k] for k in keys})
        else:
            for k in keys:
                say(f"export {k}={shlex.quote(env[k])}")
        return
    if flight < 0:
        raise KvreplayError("--flight N needs N > 0 (the number of calls to keep)")
    res = record_command(command or [], out_dir, classes, flight=flight, counters_every=counters_every,
                         checkpoint_every=checkpoint_every)
    if as_json:
        emit_json(res.to_dict())
    else:
        say(f"{len(res.traces)} trace(s) in {res.out}:" if res.traces else f"no traces written to {res.out}",
            to_err=True)
        for p in res.traces:
            say(f"  {p}", to_err=True)
        for p in res.unfinished:
            say(f"  unfinished: {p}", to_err=True)
    raise typer.Exit(res.exit_code)
