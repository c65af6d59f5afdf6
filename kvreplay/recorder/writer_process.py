"""The default trace writer: a process of its own builds and writes the Parquet file.

A writer thread inside the recorded process holds the GIL while it builds Arrow
columns, and the recorded program waits for it: on the decode-server model that
was half of the recorder's overhead. Here the recording process only pickles each
batch (its buffers are already bytes) and a sender thread pushes it down a pipe,
blocking in ``write`` with the GIL released. The writer (writer_child.py) imports
no torch, and detaches from the recorded process so that nothing which kills that
process or its process tree kills the writer: writer_child.py says how."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvreplay.recorder.rotation import Rotation
from kvreplay.recorder.switches import DIR_ENV, SITE_DIR, WATCH_ENV
from kvreplay.recorder.writer import DEFAULT_MAX_QUEUED_ROWS, STOP, QueuedWriter, WriterFailed, settled
from kvreplay.recorder.writer_child import DONE, FAILED, LEN, unpin
from kvreplay.trace.format import TraceMeta


class ProcessTraceWriter(QueuedWriter):
    """Same interface as ``TraceWriter``: ``submit`` batches, ``close`` to finish."""

    thread_name = "kvreplay-sender"

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int = 16384,
                 max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS, rotation: Rotation | None = None) -> None:
        super().__init__(path, max_queued_rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Watched (kvreplay record --watch), the writer also checks what it writes: the
        # same writer, started as kvreplay.jobs.watch, which runs it with a watcher attached.
        watched = os.environ.get(WATCH_ENV) in ("check", "metrics")
        module = "kvreplay.jobs.watch" if watched else "kvreplay.recorder.writer_child"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, "--detach", str(self.path)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True, env=_writer_env(),
        )
        # The first process forks the writer and exits at once: reap it, or it stays
        # a zombie of the recorded program. The pipes now lead to the writer.
        self._proc.wait()
        _widen(self._proc.stdin)
        self._queue.put(((meta, rows_per_group, rotation), 0))
        self._thread.start()

    def _run(self) -> None:
        unpin()  # this thread only: off the core an engine pinned its compute to
        _no_sigpipe()
        pipe = self._proc.stdin
        assert pipe is not None
        while True:
            got = self._queue.get()
            buffers: list[pickle.PickleBuffer] = []
            item, rows = (got, 0) if got is STOP else got
            self._taken(rows)  # out of the queue: the pipe (and the child) hold it now
            if item is STOP:
                payload = b""
            elif self.error is not None:
                continue
            else:
                payload = pickle.dumps(settled(item), protocol=5, buffer_callback=buffers.append)
            try:
                views = [b.raw() for b in buffers]
                pipe.write(LEN.pack(len(payload)) + LEN.pack(len(views))
                           + b"".join(LEN.pack(v.nbytes) for v in views))
                pipe.write(payload)
                for v in views:  # large writes go straight to the pipe, GIL released
                    pipe.write(v)
                # Small pieces stay in the BufferedWriter until something pushes them out;
                # a frame whose tail waited there was lost with a killed process.
                pipe.flush()
                if item is STOP:
                    pipe.close()
                    return
            except BaseException as exc:  # the child died; close() reports why
                self.error = exc
                try:
                    # here, where SIGPIPE is blocked: the bytes still buffered would otherwise
                    # be flushed to the dead pipe at exit, from a thread where it kills
                    pipe.close()
                except (OSError, ValueError):
                    pass
                if item is STOP:
                    return

    def close(self) -> Path:
        """Send everything, let the child finish the file, and report its failure if any."""
        if not self._drain():
            return self.path
        assert self._proc.stderr is not None
        err = self._proc.stderr.read()  # EOF: the writer has exited
        lines = err.decode(errors="replace").strip().splitlines()
        if not lines or lines[-1] != DONE:
            said = [line.removeprefix(FAILED) for line in lines if line.startswith(FAILED)]
            why = said[-1] if said else "its process exited without a word (killed?)"
            raise WriterFailed(f"trace writer failed: {why}")
        if self.error is not None:
            raise WriterFailed(f"trace writer failed: {self.error}") from self.error
        return self.path


PIPE_BYTES = 1 << 20


def _no_sigpipe() -> None:
    """Block SIGPIPE in the calling thread (the sender) only. A program that restored its
    default action (many servers do) was killed by it when its writer died; blocked, the
    write to the dead writer's pipe fails with EPIPE instead, which the sender expects."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    except (AttributeError, ValueError, OSError):
        pass  # no SIGPIPE, or no per-thread masks (not POSIX): nothing to block


def _widen(pipe: Any) -> None:
    """A larger pipe buffer (Linux): what sits in the kernel's pipe survives the death
    of the recorded process, what still waits in its queue does not."""
    try:
        import fcntl

        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (OSError, ImportError, AttributeError, ValueError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size: the default buffer still works


def _writer_env() -> dict[str, str]:
    """The recorded program's environment, without what would make the writer record
    itself (or import the recorder at start-up), and single-threaded maths: the
    writer does none, and idle BLAS/OpenMP workers next to the server take its CPU."""
    env = {k: v for k, v in os.environ.items() if k != DIR_ENV}
    site = str(SITE_DIR)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site)
    return {**env, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
