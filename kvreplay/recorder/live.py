"""``kvreplay record``: run a server (or any Python program) with auto-recording on.

The library half of the command: build the environment that turns auto-recording
on in every Python process the command starts (autorecord.py), run the command with
Ctrl-C and SIGTERM passed on to it, and report the traces it left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvreplay.errors import BadInput
from kvreplay.recorder.switches import (
    CHECKPOINT_ENV,
    CLASSES_ENV,
    COUNTERS_ENV,
    CPUS_ENV,
    DIR_ENV,
    FLIGHT_ENV,
    SITE_DIR,
)

TRACE_GLOB = "kvreplay-*.parquet"


@dataclass
class LiveRecording:
    command: list[str]
    out: Path
    exit_code: int
    traces: list[Path] = field(default_factory=list)
    unfinished: list[Path] = field(default_factory=list)  # .tmp files still there at the end

    def to_dict(self) -> dict[str, object]:
        return {"command": self.command, "out": str(self.out), "exit_code": self.exit_code,
                "traces": [str(p) for p in self.traces], "unfinished": [str(p) for p in self.unfinished]}


def record_env(out: Path, classes: Sequence[str] = (), base: dict[str, str] | None = None,
               flight: int = 0, counters_every: int = 1, checkpoint_every: int = 0) -> dict[str, str]:
    """The environment that makes every Python process record into ``out`` (with
    ``flight`` > 0: keep the last ``flight`` calls, dump on a raise or SIGUSR2;
    ``counters_every`` N: read the pool's counters after every Nth call, 0 never)."""
    env = dict(os.environ if base is None else base)
    env[DIR_ENV] = str(Path(out).resolve())
    if flight > 0:
        env[FLIGHT_ENV] = str(flight)
    if counters_every != 1:
        env[COUNTERS_ENV] = str(counters_every)
    if checkpoint_every > 0:
        env[CHECKPOINT_ENV] = str(checkpoint_every)
    if classes:
        env[CLASSES_ENV] = ",".join(classes)
    if hasattr(os, "sched_getaffinity"):  # where the user let us run: an engine may pin itself narrower
        env[CPUS_ENV] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def record_command(command: Sequence[str], out: Path, classes: Sequence[str] = (),
                   settle_s: float = 30.0, flight: int = 0, counters_every: int = 1,
                   checkpoint_every: int = 0) -> LiveRecording:
    """Run ``command`` recording its allocators into ``out``; returns its exit code and
    the traces it wrote. Traces still being finished by a writer process when the
    command ends (a process that was killed) get ``settle_s`` seconds to appear."""
    if not command:
        raise BadInput("nothing to run: give the server command after --, e.g. "
                       "kvreplay record --out traces/ -- python -m sglang.launch_server ...")
    out = Path(out)
    if not out.is_dir() and not out.parent.is_dir():  # the directory named is made, nothing above it
        why = "is not a directory" if out.parent.exists() else "does not exist"
        raise BadInput(f"--out {out}: cannot create it ({out.parent} {why})")
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--out {out}: cannot create it ({exc.strerror or exc})") from None
    before = set(out.glob(TRACE_GLOB))
    _adopt_orphans()
    try:
        proc = subprocess.Popen(list(command), env=record_env(out, classes, flight=flight,
                                                              counters_every=counters_every,
                                                              checkpoint_every=checkpoint_every))
    except FileNotFoundError:
        raise BadInput(f"command not found: {command[0]}") from None
    except PermissionError:
        raise BadInput(f"cannot run {command[0]}: permission denied") from None
    except OSError as exc:  # not an executable (a text file without #!, a directory)
        raise BadInput(f"cannot run {command[0]}: {exc.strerror or exc}") from None

    def forward(signum: int, frame: object) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    deadline = time.monotonic() + settle_s
    while list(out.glob(TRACE_GLOB + ".tmp")) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.1)
    _reap()
    if code < 0:  # killed by a signal: report it the way a shell does
        code = 128 - code
    traces = sorted(set(out.glob(TRACE_GLOB)) - before)
    return LiveRecording(list(command), out, code, traces, sorted(out.glob(TRACE_GLOB + ".tmp")))


def _adopt_orphans() -> None:
    """Make this process the subreaper of the command's tree (Linux): the trace writers,
    which leave the recorded processes' tree on purpose (writer_child.py), become
    children of ``kvreplay record`` instead of PID 1, so they are reaped here and
    never outlive the recording as zombies. Elsewhere PID 1 adopts them; they still
    finish their files."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap() -> None:
    """Collect the exit of every adopted process that has ended (writers done)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
