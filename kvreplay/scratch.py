"""What one command owns and leaves nothing of: a scratch directory and the processes it starts.

A command's work runs in processes several levels deep: a matrix cell in a forked
pool worker starts a replay worker in a session of its own, which may start more. A
Ctrl-C or SIGTERM reaches the command; each level cleaning up after itself would
need every level to get the chance, and a pool worker that is killed gets none. So
the command does it once, from the top: ``owned()`` puts every temporary file of
the command and of every process it starts (``tempfile`` and ``TMPDIR``) under one
directory, and when the command is interrupted it kills its whole process tree
(read from /proc before any of it dies, so no orphan escapes) and removes that
directory, whatever state the levels below were in."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` by parent links (Linux /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for d in entries:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out: list[int] = []
    todo = [pid]
    while todo:
        for kid in children.get(todo.pop(), ()):
            out.append(kid)
            todo.append(kid)
    return out


_stopping = threading.Event()
_outer: list[str] = []  # the temporary directory in effect before each owned() (innermost last)


def outer_tmp() -> str:
    """The temporary directory outside this command's scratch: for what outlives the
    command (a local Ray instance a test process keeps for its next command)."""
    return _outer[-1] if _outer else tempfile.gettempdir()


def stopping() -> bool:
    """True once this process is killing its tree: threads still running units must not
    start new processes (they would outlive the command)."""
    return _stopping.is_set()


def kill_tree(pid: int | None = None) -> int:
    """SIGKILL every descendant of ``pid`` (default: this process, which from then on
    is ``stopping()``); returns how many."""
    if pid is None:
        _stopping.set()
    kids = descendants(os.getpid() if pid is None else pid)
    for kid in kids:
        try:
            os.kill(kid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for kid in kids:  # reap our own children; the others are their parents' (or PID 1's)
        try:
            os.waitpid(kid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass
    return len(kids)


@contextmanager
def owned() -> Iterator[Path]:
    """Run a command with its own scratch directory, removed when it ends however it
    ends; the CLI calls ``kill_tree()`` inside it when the command is interrupted."""
    # A new command is not stopping, whatever an earlier one in this process (a test's,
    # run in process) ended in: its workers would be refused as if interrupted.
    _stopping.clear()
    base = Path(tempfile.gettempdir())
    try:
        root = Path(tempfile.mkdtemp(prefix=f"kvreplay-{os.getpid()}-", dir=base))
    except OSError:  # no writable temporary directory: commands that need one will say so
        yield base
        return
    saved_dir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    _outer.append(str(base))
    tempfile.tempdir = str(root)
    os.environ["TMPDIR"] = str(root)  # spawned workers and their children too
    try:
        yield root
    finally:
        _outer.pop()
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(root, ignore_errors=True)
