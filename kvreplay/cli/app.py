"""The ``kvreplay`` command: the root app, the command modules it is made of, and
the one place that turns errors into a line on stderr and an exit code.

Each command module parses its options, calls the library and renders the result;
every command that reports something takes ``--json`` (docs/json.md)."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import typer

from kvreplay import scratch
from kvreplay.cli import base
from kvreplay.cli import corpus_cmds as _corpus  # noqa: F401 - registers its commands
from kvreplay.cli import demo_cmd as _demo  # noqa: F401
from kvreplay.cli import matrix_cmd as _matrix  # noqa: F401
from kvreplay.cli import record_cmd as _record  # noqa: F401
from kvreplay.cli import replay_cmds as _replay  # noqa: F401
from kvreplay.cli import report_cmds as _report  # noqa: F401
from kvreplay.cli import search_cmds as _search  # noqa: F401
from kvreplay.cli import trace_cmds as _trace  # noqa: F401
from kvreplay.cli.base import app, say
from kvreplay.errors import EXIT_BAD_INPUT, EXIT_CRASH, KvreplayError
from kvreplay.version import __version__

try:  # typer vendors click from 0.2x on; older ones use click itself
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import ClickException, UsageError


def _version(value: bool) -> None:
    if value:
        say(f"kvreplay {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


def _fail(message: str, code: int) -> NoReturn:
    one_line = " ".join(message.split())
    base.err.print(f"kvreplay: error: {one_line}", markup=False, highlight=False, soft_wrap=True, emoji=False)
    raise SystemExit(code)


def _pin_torch_threads() -> None:
    """One intra-op thread on CPU unless the user chose (OMP_NUM_THREADS or
    KVREPLAY_TORCH_THREADS): the pools' tensors are small, and an idle OpenMP worker
    spinning on the other core slows everything else down."""
    import os

    from kvreplay.limits import torch_threads

    if "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = torch_threads()


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed memory in the process (unless the user set MALLOC_*):
    by default it hands every freed block over 128 KiB back to the kernel, and a
    replay at production sizes frees and re-makes such blocks (decoded batches,
    pool-sized check temporaries) all the time, each time faulted and zeroed again.
    Elsewhere than glibc this does nothing."""
    import ctypes
    import os

    if any(k.startswith("MALLOC_") for k in os.environ):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's largest, so big blocks come from the heap
    mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: give memory back only past 256 MiB free at the top


class _PyarrowWithoutPandas:
    """pyarrow looks for pandas on its first conversion of a Python value (to see
    whether it was handed a DataFrame), and importing pandas costs a command 0.3 s of
    CPU: more than the replay of a small trace. No kvreplay command hands pyarrow a
    pandas object, so when pyarrow loads, its one look is answered "not installed".
    Only the console entry installs this: a program or a test that imports kvreplay
    keeps pyarrow's pandas support."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name != "pyarrow" or "pandas" in sys.modules:
            return None
        sys.meta_path.remove(self)
        import pyarrow

        blocker = _NoPandas()
        sys.meta_path.insert(0, blocker)
        try:
            pyarrow.scalar(0)
        finally:
            sys.meta_path.remove(blocker)
        return None  # pyarrow is in sys.modules now: the import finds it there


class _NoPandas:
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


def console() -> None:
    """The ``kvreplay`` executable: ``main`` with the start-up and the exit that only a
    process of its own may have."""
    sys.meta_path.insert(0, _PyarrowWithoutPandas())
    try:
        main()
    except SystemExit as exc:
        _exit_now(exc.code)
    _exit_now(0)


def _exit_now(code: object) -> NoReturn:
    """End the process without Python's teardown of every module: once torch is loaded
    that teardown costs about 0.5 s of CPU (more than the rest of a small command) and
    buys nothing in a process that is ending. Exit handlers still run and the streams
    are flushed; while a thread of ours is still running, the ordinary exit is taken."""
    import atexit
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        raise SystemExit(code)
    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (kvreplay runs | head): nothing left to say
            pass
    os._exit(code if isinstance(code, int) else 0)


_RAY_ADDRESS = re.compile(r"^(auto|local|ray://\S+|[\w.-]+:\d+)$")


def _ray_value(argv: list[str]) -> list[str]:
    """``--ray`` takes an optional address: alone (last, or before another option or
    an argument that is not an address) it means a local instance, spelled "local"."""
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a == "--ray":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or not _RAY_ADDRESS.match(nxt):
                out.append("local")
    return out


_terminated = False  # SIGTERM came: whatever the exception became on its way up


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that every ``finally`` on the way out
    runs: workers are stopped and scratch directories removed, as on Ctrl-C."""


def _terminate_like_ctrl_c() -> None:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # a command run from a test's thread keeps the default

    def on_term(signum: int, frame: object) -> None:
        global _terminated
        _terminated = True
        raise Terminated()

    signal.signal(signal.SIGTERM, on_term)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: turns library errors into one line and an exit code."""
    argv = _ray_value(sys.argv[1:] if argv is None else argv)
    base.argv[:] = argv
    _check_environment(argv)
    # record runs someone else's program: its environment (torch's threads, TMPDIR)
    # stays as it was, and its processes (the server, the trace writers) end on their
    # own, never killed here.
    recording = argv[:1] == ["record"]
    if not recording:
        _pin_torch_threads()
    _terminate_like_ctrl_c()
    _keep_freed_memory()
    if recording:
        _run(argv, interrupted=_fail)
        return
    with scratch.owned():
        _run(argv, interrupted=_stop_and_fail)


def _check_environment(argv: list[str]) -> None:
    """kvreplay's own variables (limits, progress, threads, start method, recorder) must
    hold values it takes, or no command starts: a typo is one line and exit 2, not a
    default taken in silence or an error deep inside a run. Help and the version are
    still there to read."""
    from kvreplay.limits import check_environment

    own = argv[:argv.index("--")] if "--" in argv else argv  # not the recorded command's --help
    if not argv or any(a in ("--help", "--version") for a in own):
        return
    try:
        check_environment()
    except KvreplayError as exc:
        _fail(str(exc), exc.exit_code)


def _stop_and_fail(message: str, code: int) -> NoReturn:
    scratch.kill_tree()  # workers, and the workers of workers, before the scratch goes
    _fail(message, code)


@functools.cache
def _command() -> Any:
    """The click command typer builds from the app: once per process (typer would build
    it again for every call, some 40 ms, which a program or test calling main() repeatedly
    pays each time)."""
    return typer.main.get_command(app)


def _run(argv: list[str], interrupted: Callable[[str, int], NoReturn]) -> None:
    def stopped() -> NoReturn:
        interrupted("terminated" if _terminated else "interrupted", 143 if _terminated else 130)

    try:
        # Not standalone: click hands usage errors back instead of printing a box,
        # and returns the code of typer.Exit.
        rc = _command().main(args=argv, standalone_mode=False, prog_name="kvreplay")
    except typer.Abort:
        stopped()
    except UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help was the answer
            exc.show()
            raise SystemExit(EXIT_BAD_INPUT) from None
        where = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        _fail(exc.format_message() + where, EXIT_BAD_INPUT)
    except ClickException as exc:
        _fail(exc.format_message(), EXIT_BAD_INPUT)
    except KvreplayError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        stopped()
    except SystemExit:
        raise
    except Exception as exc:  # a bug in kvreplay, not the user's input
        interrupted(f"internal error: {type(exc).__name__}: {exc}", EXIT_CRASH)
    if rc == 130 or _terminated:  # typer hands an interrupt back as exit code 130
        stopped()
    raise SystemExit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    console()
