"""``kvreplay record``: run a server (or any Python program) with auto-recording on.

The library half of the command: build the environment that turns auto-recording
on in every Python process the command starts (autorecord.py), run the command with
Ctrl-C and SIGTERM passed on to it, and report the traces it left."""

from __future__ import annotations

import itertools
import math
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput
from kvreplay.recorder.compat import COMPAT_ENV, compat_env, patches
from kvreplay.recorder.rotation import Rotation
from kvreplay.recorder.seal import new_key, opened, parse, read_small
from kvreplay.recorder.switches import (
    CHECKPOINT_ENV,
    CLASSES_ENV,
    COUNTERS_ENV,
    CPUS_ENV,
    DIR_ENV,
    FINDINGS_FILE,
    FLIGHT_ENV,
    METRICS_GLOB,
    PARTS_ENV,
    SEAL_ENV,
    SITE_DIR,
    WATCH_ENV,
)
from kvreplay.trace.format import PART_GLOB

TRACE_GLOB = "kvreplay-*.parquet"  # a file, or with rotation a directory of parts
# What kvreplay record of a server writes unless told otherwise: a part every ten
# minutes or million rows (about 100 MB), and the last GiB of parts of each trace kept.
DEFAULT_ROTATION = Rotation(rows=1_000_000, seconds=600.0, keep_parts=0, keep_bytes=1 << 30)


@dataclass
class LiveRecording:
    command: list[str]
    out: Path
    exit_code: int
    traces: list[Path] = field(default_factory=list)
    unfinished: list[Path] = field(default_factory=list)  # .tmp files still there at the end
    findings: list[dict[str, Any]] = field(default_factory=list)  # what --watch found, as it came
    forged: int = 0  # lines of the findings file (and counter files) no writer of this run sealed
    stopped_on: dict[str, Any] | None = None  # the violation --stop-on-violation ended the command for
    reproducers: list[dict[str, Any]] = field(default_factory=list)  # minimized findings (kvreplay record)

    def to_dict(self) -> dict[str, object]:
        return {"command": self.command, "out": str(self.out), "exit_code": self.exit_code,
                "traces": [str(p) for p in self.traces], "unfinished": [str(p) for p in self.unfinished],
                "findings": self.findings, "stopped_on": self.stopped_on, "reproducers": self.reproducers,
                "forged": self.forged}


def record_env(out: Path, classes: Sequence[str] = (), base: dict[str, str] | None = None,
               flight: int = 0, counters_every: int = 1, checkpoint_every: int = 0, watch: str = "",
               rotation: Rotation | None = None, cpu_compat: bool = False, key: str = "") -> dict[str, str]:
    """The environment that makes every Python process record into ``out`` (with
    ``flight`` > 0: keep the last ``flight`` calls, dump on a raise or SIGUSR2;
    ``counters_every`` N: read the pool's counters after every Nth call, 0 never;
    ``watch`` "check": writers check invariants as they write, "metrics": they count;
    ``rotation``: each trace a directory of parts, each replayable alone, the oldest
    retired past the bound; ``cpu_compat``: the engines' CPU patches, recorder/compat.py;
    ``key``: what the writers seal their findings and counters with, seal.py)."""
    env = dict(os.environ if base is None else base)
    if cpu_compat:
        env = compat_env(env)
    env[DIR_ENV] = str(Path(out).resolve())
    # The switches record's flags own are the flags' alone: a value inherited from the shell
    # (or from an outer recording) would record what the command line did not ask for.
    for owned in (WATCH_ENV, FLIGHT_ENV, COUNTERS_ENV, CHECKPOINT_ENV, CLASSES_ENV, PARTS_ENV):
        env.pop(owned, None)
    if watch:
        env[WATCH_ENV] = watch
    if key:
        env[SEAL_ENV] = key
    else:
        env.pop(SEAL_ENV, None)  # an outer recording's key is not this one's
    if flight > 0:
        env[FLIGHT_ENV] = str(flight)
    if counters_every != 1:
        env[COUNTERS_ENV] = str(counters_every)
    if checkpoint_every > 0:
        env[CHECKPOINT_ENV] = str(checkpoint_every)
    if classes:
        env[CLASSES_ENV] = ",".join(classes)
    if rotation is not None and rotation.on:
        env[PARTS_ENV] = rotation.to_env()
    if hasattr(os, "sched_getaffinity"):  # where the user let us run: an engine may pin itself narrower
        env[CPUS_ENV] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def launch_keys(classes: Sequence[str] = (), flight: int = 0, counters_every: int = 1, checkpoint_every: int = 0,
                watch: str = "", rotation: Rotation | None = None, cpu_compat: bool = False) -> list[str]:
    """The variables of ``record_env``'s environment (asked with the same switches) that a
    server launched some other way must be given: what kvreplay record --print-env prints.
    (Such a server is watched by its writers alone: no kvreplay record prints what they find.)"""
    # the layer's switch and what its patches need (a variable the user set is left to them)
    compat = [COMPAT_ENV, *sorted({k for p in patches() for k in p.env})] if cpu_compat else []
    asked = ((CLASSES_ENV, bool(classes)), (FLIGHT_ENV, flight > 0), (COUNTERS_ENV, counters_every != 1),
             (CHECKPOINT_ENV, checkpoint_every > 0), (WATCH_ENV, bool(watch)),
             (PARTS_ENV, rotation is not None and rotation.on and not flight))
    return [DIR_ENV, "PYTHONPATH", *compat, *(k for k, on in asked if on)]


def record_command(command: Sequence[str], out: Path, classes: Sequence[str] = (),
                   settle_s: float = 30.0, flight: int = 0, counters_every: int = 1,
                   checkpoint_every: int = 0, watch: str = "", stop_on_violation: bool = False,
                   metrics_port: int = 0, on_finding: Callable[[dict[str, Any]], None] | None = None,
                   on_metrics: Callable[[str], None] | None = None,
                   rotation: Rotation | None = DEFAULT_ROTATION, cpu_compat: bool = False) -> LiveRecording:
    """Run ``command`` recording its allocators into ``out``; returns its exit code and
    the traces it wrote. Traces still being finished by a writer process when the
    command ends (a process that was killed) get ``settle_s`` seconds to appear.

    ``watch`` ("check" or "metrics", see kvreplay.jobs.watch): the writers check (or only
    count) what they write; each finding is passed to ``on_finding`` within about a
    second of its call, and ``stop_on_violation`` sends the command SIGTERM at the first
    violation. ``metrics_port``: the writers' counters are served at
    http://127.0.0.1:PORT/metrics (``on_metrics`` is told the address).

    ``rotation`` (default ``DEFAULT_ROTATION``; None: one file per trace): each trace is a
    directory of parts (rotation.py) that replays whole or a part at a time. ``cpu_compat``:
    the server's processes get the engines' CPU patches (recorder/compat.py)."""
    if not command:
        raise BadInput("nothing to run: give the server command after --, e.g. "
                       "kvreplay record --out traces/ -- python -m sglang.launch_server ...")
    out = _made_out(Path(out), watch)
    before = set(out.glob(TRACE_GLOB))
    key = new_key()
    server = _start_metrics(out, watch, metrics_port, key, on_metrics)
    adopted = _adopt_orphans()
    env = record_env(out, classes, flight=flight, counters_every=counters_every, checkpoint_every=checkpoint_every,
                     watch=watch or ("metrics" if metrics_port else ""), rotation=rotation, cpu_compat=cpu_compat,
                     key=key)
    proc = _start(command, env)
    result = LiveRecording(list(command), out, 0)

    def found(finding: dict[str, Any]) -> None:
        result.findings.append(finding)
        if on_finding is not None:
            on_finding(finding)
        if stop_on_violation and finding.get("kind") == "violation" and result.stopped_on is None:
            result.stopped_on = finding
            proc.send_signal(signal.SIGTERM)

    follower = _Follower(out / FINDINGS_FILE, found, key) if watch == "check" else None
    code = _wait_passing_signals(proc)
    _let_writers_finish(proc, out, adopted, settle_s)
    if follower is not None:
        follower.stop()  # after the writers finished: every finding they wrote is read
        result.forged = follower.forged
    if server is not None:
        server.shutdown()
        server.server_close()
    if code < 0:  # killed by a signal: report it the way a shell does
        code = 128 - code
    if any(f.get("kind") == "violation" for f in result.findings) and (code == 0 or result.stopped_on):
        code = 1  # the server did its job, its pool did not: a CI of a server build fails
    result.exit_code = code
    # a directory of parts with none finished (its writer was killed, or never had room) is no trace
    result.traces = sorted(p for p in set(out.glob(TRACE_GLOB)) - before if not p.is_dir() or any(p.glob(PART_GLOB)))
    result.unfinished = _unfinished(out)
    return result


def _made_out(out: Path, watch: str) -> Path:
    """--out, made if missing (nothing above it), checked to take files, and with nothing
    in the way of the findings file the watch appends to."""
    if not out.is_dir() and not out.parent.is_dir():  # the directory named is made, nothing above it
        why = "is not a directory" if out.parent.exists() else "does not exist"
        raise BadInput(f"--out {out}: cannot create it ({out.parent} {why})")
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--out {out}: cannot create it ({exc.strerror or exc})") from None
    _check_writable(out)
    findings_file = out / FINDINGS_FILE
    if watch == "check" and (findings_file.is_symlink() or (findings_file.exists() and not findings_file.is_file())):
        raise BadInput(f"{findings_file}: not a regular file; remove it (the watch appends its findings there)")
    return out


def _start_metrics(out: Path, watch: str, port: int, key: str,
                   on_metrics: Callable[[str], None] | None) -> ThreadingHTTPServer | None:
    """The counters' server on ``port`` (None: no port asked)."""
    if watch or port:
        for old in out.glob(METRICS_GLOB):  # a last run's counters are not this run's
            old.unlink(missing_ok=True)
    server = _serve_metrics(out, port, key) if port else None
    if server is not None and on_metrics is not None:
        on_metrics(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    return server


def _start(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    try:
        # A process group of its own: what the command starts and leaves behind is ended
        # with the recording (_end_group); Ctrl-C and SIGTERM reach it through _wait_passing_signals.
        return subprocess.Popen(list(command), env=env, **_OWN_GROUP)
    except FileNotFoundError:
        raise BadInput(f"command not found: {command[0]}") from None
    except PermissionError:
        raise BadInput(f"cannot run {command[0]}: permission denied") from None
    except OSError as exc:  # not an executable (a text file without #!, a directory)
        raise BadInput(f"cannot run {command[0]}: {exc.strerror or exc}") from None


def _wait_passing_signals(proc: subprocess.Popen[bytes]) -> int:
    """The command's exit status, Ctrl-C and SIGTERM passed on to it while it runs."""

    def forward(signum: int, frame: object) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _let_writers_finish(proc: subprocess.Popen[bytes], out: Path, adopted: bool, settle_s: float) -> None:
    """End what is left of the command's group, and give the trace writers ``settle_s``
    seconds to finish their files."""
    _end_group(proc.pid)
    # The writers finish their files after the command: wait for them (this process
    # adopted them), not only for their .tmp files, which a writer that has just
    # started has not made yet. Where the writers are this process's children, a .tmp
    # file with none of them running is one that a killed writer left: nobody will
    # finish it, and waiting settle_s for it only stalls the end of the recording.
    deadline = time.monotonic() + settle_s
    while (_reap() or (not adopted and _unfinished(out))) and time.monotonic() < deadline:
        time.sleep(0.1)
    _end_group(proc.pid, signal.SIGKILL)
    _reap()


def _unfinished(out: Path) -> list[Path]:
    """Trace files (or a rotated trace's parts) a writer has not finished."""
    return sorted([*out.glob(TRACE_GLOB + ".tmp"), *out.glob(TRACE_GLOB + "/*.tmp")])


class _Follower:
    """Reads the findings file as watching writers append to it (from its end at the
    start: an earlier run's lines are not this run's) and passes on each line this
    run's writers sealed; the others are counted in ``forged``."""

    MAX_LINE = 1 << 16  # a writer's lines are at most a few KB: longer ones are not theirs

    def __init__(self, path: Path, found: Callable[[dict[str, Any]], None], key: str,
                 every_s: float = 0.1) -> None:
        self.path, self.found, self.key, self.every_s = path, found, key, every_s
        self.forged = 0
        self.at = self._size()
        self.partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvreplay-watch-follower", daemon=True)
        self._thread.start()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size if self.path.is_file() else 0
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def _read(self) -> bytes:
        # never follows a link, never waits on a FIFO put in the file's place
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            return b""
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            return os.pread(fd, 1 << 20, self.at)
        except OSError:
            return b""
        finally:
            os.close(fd)

    def poll(self) -> None:
        data = self._read()
        self.at += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if len(self.partial) > self.MAX_LINE:
            self.partial, self.forged = b"", self.forged + 1
        for line in lines:
            if not line.strip():
                continue
            finding = opened(parse(line), self.key)
            if finding is None:
                self.forged += 1
                continue
            self.found(finding)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for _ in range(64):  # what the writers left unread, a MiB a poll, up to a bound
            at = self.at
            self.poll()
            if self.at - at < 1 << 20:
                break


MAX_METRICS_FILES = 1024  # a writer each: far more than a node's schedulers


def metrics_text(out: Path, key: str) -> str:
    """The watching writers' counters (their latest), in Prometheus's text format: of
    the counter files in ``out``, the regular ones this run's writers sealed with ``key``."""
    docs = []
    for p in sorted(itertools.islice(out.glob(METRICS_GLOB), MAX_METRICS_FILES)):
        data = read_small(p)  # None while being replaced: the next scrape has it
        doc = opened(parse(data), key) if data is not None else None
        if doc is not None:
            docs.append(doc)
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP kvreplay_{name} {help_}")
        lines.append(f"# TYPE kvreplay_{name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"kvreplay_{name}{{{text}}} {value}")

    def per_trace(key: str) -> list[tuple[dict[str, str], float]]:
        return [({"trace": str(d.get("trace", "?"))}, _number(d.get(key))) for d in docs]

    family("calls_recorded_total", "counter", "Allocator calls recorded (counter reads folded into rows included).",
           per_trace("calls"))
    family("rows_written_total", "counter", "Trace rows handed to the file.", per_trace("rows"))
    family("trace_bytes", "gauge", "Bytes of the trace on disk.", per_trace("bytes"))
    family("trace_parts", "gauge", "Closed parts of the trace on disk (rotation).", per_trace("parts"))
    family("parts_retired_total", "counter", "Parts deleted by the retention bound.", per_trace("parts_retired"))
    family("writer_resident_bytes", "gauge", "Resident memory of the trace writer's process.",
           per_trace("writer_rss_bytes"))
    family("calls_dropped_total", "counter", "Calls the recorder lost (its queue was full, or a write failed).",
           per_trace("dropped"))
    family("calls_unchecked_total", "counter", "Calls the watch could not check.", per_trace("unchecked"))
    family("writer_lag_seconds", "gauge", "Age of the newest call the writer has.", per_trace("lag_s"))
    family("watching", "gauge", "1 while the watch checks the calls, else 0.",
           [({"trace": str(d.get("trace", "?"))}, 1.0 if d.get("watching") else 0.0) for d in docs])
    family("violations_total", "counter", "Invariant violations the watch found, by rule.",
           [({"trace": str(d.get("trace", "?")), "rule": str(r)}, _number(n)) for d in docs
            for r, n in _items(d.get("violations"))])
    family("divergences_total", "counter", "Divergences the watch found, by kind.",
           [({"trace": str(d.get("trace", "?")), "kind": str(k)}, _number(n)) for d in docs
            for k, n in _items(d.get("divergences"))])
    return "\n".join(lines) + "\n"


def _number(v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return 0.0
    try:
        f = float(v)
    except OverflowError:
        return 0.0
    return f if math.isfinite(f) else 0.0


def _items(v: Any) -> list[tuple[Any, Any]]:
    return list(v.items())[:256] if isinstance(v, dict) else []


def _label(value: str) -> str:
    """A label value as Prometheus's text format escapes it, control characters shown
    as escapes (a scraper's console must not run them), at most 200 characters."""
    value = value[:200].replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "".join(c if c.isprintable() else f"\\\\x{ord(c):02x}" if ord(c) < 256 else f"\\\\u{ord(c):04x}"
                   for c in value)


class _Scrapes:
    """One scrape computed at a time, and reused for a moment: parallel scrapers share
    it instead of each reading every counter file."""

    def __init__(self, out: Path, key: str) -> None:
        self.out, self.key = out, key
        self.lock = threading.Lock()
        self.at, self.body = -1.0, b""

    def body_now(self) -> bytes:
        with self.lock:
            if time.monotonic() - self.at > 0.5:
                self.body = metrics_text(self.out, self.key).encode()
                self.at = time.monotonic()
            return self.body


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a scraper that hung up early is its own business: no traceback on the console


def _serve_metrics(out: Path, port: int, key: str) -> ThreadingHTTPServer:
    scrapes = _Scrapes(out, key)

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a client that sends nothing is dropped, not kept

        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            body = scrapes.body_now()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the scraper hung up
                self.close_connection = True

        def do_HEAD(self) -> None:  # noqa: N802
            self.send_error(405, "GET /metrics only")

        def __getattr__(self, name: str) -> Any:
            if name.startswith("do_"):  # any other method: not allowed here (never 501, a server error)
                return self.do_HEAD
            raise AttributeError(name)

        def log_message(self, *args: Any) -> None:
            pass

    try:
        server = _QuietServer(("127.0.0.1", port), Handler)
    except OSError as exc:
        raise BadInput(f"--metrics-port {port}: cannot listen there ({exc.strerror or exc})") from None
    threading.Thread(target=server.serve_forever, name="kvreplay-metrics", daemon=True).start()
    return server


def _adopt_orphans() -> bool:
    """Make this process the subreaper of the command's tree (Linux): the trace writers,
    which leave the recorded processes' tree on purpose (writer_child.py), become
    children of ``kvreplay record`` instead of PID 1, so they are reaped here and
    never outlive the recording as zombies. Elsewhere PID 1 adopts them; they still
    finish their files. Whether this process adopts them."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _reap() -> bool:
    """Collect the exit of every adopted process that has ended (writers done); whether
    any child is still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


# The command's own process group (Python 3.11's process_group=0; setpgrp before 3.11).
_OWN_GROUP: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                              else {"preexec_fn": os.setpgrp})


def _end_group(pgid: int, sig: int = signal.SIGTERM) -> None:
    """Signal what is left of the command's process group once the command has ended:
    its children must not outlive the recording. The trace writers are in sessions of
    their own (writer_child.py) and are not touched."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _check_writable(out: Path) -> None:
    """--out must take files, found before the command starts (not by its writers)."""
    probe = out / f".kvreplay-probe-{os.getpid()}"
    try:
        # a new file only: a link planted under this name is removed, never followed nor truncated through
        probe.unlink(missing_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        probe.unlink()
    except OSError as exc:
        raise BadInput(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
