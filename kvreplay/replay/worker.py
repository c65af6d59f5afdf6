"""Replaying on a worker build (``git:``, ``ENGINE==VERSION``) in a process of its own.

The worker (``python -m kvreplay.replay.worker``) starts with the build's code first
on ``sys.path`` (builds/worker_code.py), so two builds never share an interpreter and
a build that crashes or hangs cannot take kvreplay down. It reads one request as JSON
on stdin (a build and one or more traces) and answers one JSON line per trace on
stdout as each finishes, so that importing a release's whole server happens once for
all the traces a matrix gives it. Without ``:MODULE:CLASS`` it uses the code's sglang
allocator for each trace's family.

Outcomes the parent turns into a run status: ``unloadable`` (the code does not import
or construct: exit 125, so ``git bisect run`` skips it), ``unsupported`` (the code
lacks what the trace needs, e.g. the pool family), ``crashed`` (the worker died, e.g.
a segfault; the traces after it go to a fresh worker) and ``timeout``."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvreplay.builds.git_tree import DEFAULT_TIMEOUT_S
from kvreplay.builds.spec import BuildSpec
from kvreplay.builds.worker_code import HIDE_ENV, prepare
from kvreplay.errors import (
    EXIT_BAD_INPUT,
    EXIT_UNLOADABLE,
    BadInput,
    BuildUnloadable,
    BuildUnsupported,
    FamilyMismatch,
)
from kvreplay.replay.kernels import instrument
from kvreplay.replay.report import ReplayReport, untestable
from kvreplay.scratch import stopping
from kvreplay.trace.location import is_remote

CRUMB_ENV = "KVREPLAY_WORKER_PROGRESS"  # the file a worker notes its progress in


def as_sent(trace: str | Path) -> str:
    """A trace as the worker is given it, and names it in its report: a remote trace's URI,
    else its resolved path."""
    return str(trace) if is_remote(str(trace)) else str(Path(trace).resolve())


def replay_in_worker(trace: str | Path, spec: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     **options: Any) -> tuple[ReplayReport, str]:
    """Replay ``trace`` on the worker build ``spec``; returns (the report, the commit
    or release version). Its status is clean, violation or divergence as usual, or
    unloadable, unsupported, crashed or timeout."""
    reports, code_id = replay_many_in_worker([trace], spec, timeout_s=timeout_s, **options)
    return reports[0], code_id


def replay_many_in_worker(traces: list[str | Path], spec: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                          on_report: Callable[[ReplayReport, str], None] | None = None,
                          modes: list[str] | None = None, **options: Any) -> tuple[list[ReplayReport], str]:
    """Replay each trace on ``spec`` in one worker process (a fresh one after a crash
    or a timeout); ``timeout_s`` bounds each trace. ``on_report(report, code id)``
    sees each report as soon as the worker gives it. ``modes``: each trace's own mode
    (a trace may come twice, once per mode), in place of ``options``' one."""
    s = BuildSpec.parse(spec)
    device = options.get("device", "cpu")
    modes = list(modes) if modes is not None else [options.get("mode", "strict")] * len(traces)
    if len(modes) != len(traces):
        raise ValueError("modes must name one mode per trace")
    t0 = time.perf_counter()
    reports: list[ReplayReport] = []

    def done(report: ReplayReport, code_id: str) -> None:
        reports.append(report)
        if on_report is not None:
            on_report(report, code_id)

    try:
        code = prepare(s)
    except BuildUnloadable as exc:
        for t, mode in zip(traces, modes, strict=True):
            done(untestable(str(t), spec, mode, device, "unloadable", str(exc), time.perf_counter() - t0), "")
        return reports, ""
    env = code.env()
    scratch = Path(tempfile.mkdtemp(prefix="kvreplay-worker-"))
    crumbs = scratch / "progress"
    env[CRUMB_ENV] = str(crumbs)
    todo = [as_sent(t) for t in traces]
    try:
        while todo:
            request = {"traces": todo, "modes": modes, "cls": s.cls, "spec": spec, "options": options}
            started = time.perf_counter()
            if stopping():  # the command is being interrupted: a new worker would outlive it
                raise KeyboardInterrupt
            with open(scratch / "stderr", "w+") as err:
                proc = subprocess.Popen([sys.executable, "-m", "kvreplay.replay.worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=err, env=env, cwd=code.cwd,
                                        start_new_session=True, bufsize=0)
                ended = None
                try:
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(json.dumps(request).encode())
                    proc.stdin.close()
                    for answer in _answers(proc, timeout_s):
                        if answer is None:  # a trace ran past its time
                            _kill_group(proc)
                            ended = "timeout"
                            break
                        done(_report_of(answer, spec, {**options, "mode": modes[0]}, device), code.code_id)
                        todo.pop(0)
                        modes.pop(0)
                        started = time.perf_counter()
                except BaseException:
                    # Interrupted (Ctrl-C, SIGTERM) or failed here: the worker is in a
                    # session of its own, so nothing else would stop it.
                    _kill_group(proc)
                    proc.wait()
                    raise
                proc.wait()
                err.seek(0)
                stderr = err.read()
            if not todo:
                break
            wall = time.perf_counter() - started
            if ended == "timeout":
                why = f"no result after {timeout_s:.0f} s" + _where(crumbs, todo[0])
            else:
                ended, why = "crashed", _death(proc.returncode, stderr) + _where(crumbs, todo[0])
            done(untestable(todo[0], spec, modes[0], device, ended, why, wall), code.code_id)
            todo, modes = todo[1:], modes[1:]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return reports, code.code_id


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _answers(proc: subprocess.Popen, timeout_s: float) -> Iterator[dict[str, Any] | None]:
    """The worker's answers as they come; None when one takes longer than ``timeout_s``.
    Reads the raw pipe (no buffer that select cannot see) and splits lines itself."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    pending = b""
    while True:
        while b"\n" not in pending:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                yield None
                return
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return  # the worker is gone: finished, or died
            pending += chunk
        line, _, pending = pending.partition(b"\n")
        if line.startswith(b"{"):
            yield json.loads(line)
            deadline = time.monotonic() + timeout_s


def _where(crumbs: Path, trace: str) -> str:
    """Where the replay had got to when its worker died: the call it was making (from
    the note the worker updates before each call) and the first violation before it
    (the state a crash may come from, noted as soon as it is found)."""
    try:
        raw = crumbs.read_bytes()
        call = int.from_bytes(raw[:8], "little")
        method = raw[8:72].rstrip(b"\0").decode("ascii", "replace")
        note = json.loads(Path(f"{crumbs}.json").read_text()) if Path(f"{crumbs}.json").exists() else {}
    except (OSError, ValueError):
        return ""
    if not call or note.get("trace", trace) != trace:
        return ""
    where = f"; in call #{call} {method}" + (f" of {note['calls']}" if note.get("calls") else "")
    return where + (f"; first violation before it: {note['first']}" if note.get("first") else "")


def _death(returncode: int, stderr: str) -> str:
    """What killed a worker, in one line: the signal, and the last line it wrote."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    fatal = next((ln for ln in lines if ln.startswith("Fatal Python error")), None)
    how = (f"killed by {signal.Signals(-returncode).name}" if returncode < 0 and -returncode in
           signal.valid_signals() else f"exit {returncode}")
    last = fatal or (lines[-1] if lines else "")
    return f"the worker died ({how}{': ' + last if last else ''})"


def _report_of(answer: dict[str, Any], spec: str, options: dict[str, Any], device: str) -> ReplayReport:
    if "report" in answer:
        return ReplayReport.from_dict(answer["report"])
    if answer.get("error") == "bad-input":
        raise BadInput(answer["message"])
    if answer.get("error") == "family":
        raise FamilyMismatch(answer["trace_family"], spec, answer["build_family"])
    return untestable(answer["trace"], spec, options.get("mode", "strict"), device, answer["error"],
                      answer["message"], answer.get("wall_s", 0.0))


class _Hidden:
    """A meta-path finder that makes the overlay's casualties look uninstalled."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden: the overlay replaces a dependency "
                                      "of it)", name=fullname)
        return None


def _worker() -> int:
    """Worker side: one replay per trace, one JSON line each on stdout."""
    import faulthandler

    faulthandler.enable()  # a native crash leaves the Python stack on stderr for the parent
    hidden = {n for n in os.environ.get(HIDE_ENV, "").split(",") if n}
    if hidden:
        sys.meta_path.insert(0, _Hidden(hidden))
    request = json.loads(sys.stdin.read())
    code_build = not BuildSpec.parse(request["spec"]).in_process
    kernels = instrument(request["options"].get("device", "cpu")) if code_build else None
    code = 0
    modes = request.get("modes") or [request["options"].get("mode", "strict")] * len(request["traces"])
    for trace, mode in zip(request["traces"], modes, strict=True):
        t0 = time.perf_counter()
        out = _replay_one(trace, {**request, "options": {**request["options"], "mode": mode}}, kernels)
        out.setdefault("wall_s", time.perf_counter() - t0)
        print(json.dumps(out, default=str), flush=True)
        if "error" in out:
            code = EXIT_UNLOADABLE if out["error"] in ("unloadable", "unsupported") else EXIT_BAD_INPUT
    return code


def _breadcrumbs(trace: str, replayer: Any) -> Any:
    """Leave notes of where the replay is, so that the parent can say where a worker
    that died natively had got to: the number and method of each call as it is made
    (eight bytes and a name in a shared page, cheap enough for every call) and the
    first violation, as soon as there is one. Returns the progress callback."""
    path = os.environ.get(CRUMB_ENV)
    if not path:
        return None
    import mmap

    from kvreplay.replay.report import describe

    with open(path, "wb") as fh:
        fh.write(b"\0" * 72)
    with open(path, "r+b") as fh:
        page = mmap.mmap(fh.fileno(), 72)
    step = replayer.step
    total = replayer.reader.count_calls()

    seen = [False]

    def noted_step(tc: Any) -> Any:
        page[:8] = tc.number.to_bytes(8, "little")
        page[8:72] = tc.call.method.encode("ascii", "replace")[:64].ljust(64, b"\0")
        out = step(tc)
        if not seen[0] and replayer.checker is not None and replayer.checker.log.total:
            seen[0] = True  # the first violation: noted at once, a crash may follow it
            note(0, 0)
        return out

    replayer.step = noted_step

    def note(done: int, rows: int) -> None:
        first = replayer.checker.log.first() if replayer.checker else None
        tmp = f"{path}.json.tmp"
        with open(tmp, "w") as fh:
            json.dump({"trace": trace, "calls": total, "first": describe(first, long=True) if first else ""}, fh)
        os.replace(tmp, f"{path}.json")

    note(0, 0)
    return note


def _replay_one(trace: str, request: dict[str, Any], kernels: dict[str, Any] | None) -> dict[str, Any]:
    try:
        from kvreplay.contract.record import load
        from kvreplay.contract.registry import engine, git_engine
        from kvreplay.replay.replayers import make_replayer

        build = request["spec"]
        spec = BuildSpec.parse(build)
        if not spec.in_process:  # the code on sys.path: its class, or its engine's pool (a git tree's engine's)
            build = "py:" + request["cls"] if request["cls"] else (spec.engine or git_engine())
        replayer = make_replayer(trace, build, **request["options"])
        replayer.build_spec = request["spec"]  # findings name the build as the user gave it
        eng = engine(build)
        if eng is not None:  # fail early, with the class named
            load(eng.installed)(replayer.meta.family, replayer.meta.pool_class)
        before = kernels["launches"] if kernels else 0
        report = replayer.run(progress=_breadcrumbs(trace, replayer))
        if kernels and kernels["launches"] > before:
            report.kernels = kernels["kind"]
        return {"trace": trace, "report": report.to_dict(timeline=True)}
    except FamilyMismatch as exc:  # not this build's trace: the parent raises it again, naming the build as given
        return {"trace": trace, "error": "family", "message": str(exc), "trace_family": exc.trace_family,
                "build_family": exc.build_family}
    except BuildUnsupported as exc:
        return {"trace": trace, "error": "unsupported", "message": str(exc)}
    except BuildUnloadable as exc:
        return {"trace": trace, "error": "unloadable", "message": str(exc)}
    except BadInput as exc:
        return {"trace": trace, "error": "bad-input", "message": str(exc)}


if __name__ == "__main__":
    sys.exit(_worker())
