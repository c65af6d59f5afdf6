"""The default trace writer: a child process that builds and writes the Parquet file.

A writer thread inside the recorded process holds the GIL while it builds Arrow
columns, and the recorded program waits for it: on the decode-server model that
was half of the recorder's overhead. Here the recording process only pickles each
batch (its buffers are already bytes) and a sender thread pushes it down a pipe,
blocking in ``write`` with the GIL released. The child, started with
``python -m kvreplay.recorder.writer_process``, imports no torch, and runs in its
own session so a Ctrl-C aimed at the server does not kill it before it has
written what it was sent.

Pipe protocol: a frame is the pickle's length, the number of out-of-band buffers
and their lengths (8-byte little-endian each), the pickle (protocol 5), then the
buffers. The first frame holds the ``TraceMeta`` and the rows per group, then one
``RawBatch`` per frame; an empty pickle means "finish the file". If the pipe closes without it (the
recorded process died), the child still finishes the file with every batch it
received, so a crash loses only what had not been sent."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO

from kvreplay.recorder.writer import DEFAULT_MAX_QUEUED_ROWS, STOP, QueuedWriter, settled
from kvreplay.trace.format import TraceMeta

_LEN = struct.Struct("<Q")


class ProcessTraceWriter(QueuedWriter):
    """Same interface as ``TraceWriter``: ``submit`` batches, ``close`` to finish."""

    thread_name = "kvreplay-sender"

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta, rows_per_group: int = 16384,
                 max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS, part_rows: int = 0, part_s: float = 0.0) -> None:
        super().__init__(path, max_queued_rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvreplay.recorder.writer_process", str(self.path)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True,
            # The child does no linear algebra; idle BLAS/OpenMP workers spinning
            # next to the recorded program would only take its CPU.
            env={**{k: v for k, v in os.environ.items() if k != "KVREPLAY_RECORD_DIR"},
                 "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        )
        _widen(self._proc.stdin)
        self._queue.put(((meta, rows_per_group, part_rows, part_s), 0))
        self._thread.start()

    def _run(self) -> None:
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
                pipe.write(_LEN.pack(len(payload)) + _LEN.pack(len(views))
                           + b"".join(_LEN.pack(v.nbytes) for v in views))
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
                if item is STOP:
                    return

    def close(self) -> Path:
        """Send everything, let the child finish the file, and report its failure if any."""
        if not self._drain():
            return self.path
        assert self._proc.stderr is not None
        err = self._proc.stderr.read()
        self._proc.wait()
        if self._proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"trace writer failed: {lines[-1] if lines else f'exit {self._proc.returncode}'}")
        if self.error is not None:
            raise RuntimeError(f"trace writer failed: {self.error}") from self.error
        return self.path


PIPE_BYTES = 1 << 20


def _widen(pipe: Any) -> None:
    """A larger pipe buffer (Linux): what sits in the kernel's pipe survives the death
    of the recorded process, what still waits in its queue does not."""
    try:
        import fcntl

        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (OSError, ImportError, AttributeError, ValueError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size: the default buffer still works


def _read_exact(src: BinaryIO, n: int) -> bytearray | None:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = src.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            return None
        got += k
    return out


def _read_frame(src: BinaryIO) -> tuple[bytes, list[bytearray]] | None:
    """The next frame's pickle and out-of-band buffers; None when the pipe closed."""
    head = _read_exact(src, 2 * _LEN.size)
    if head is None:
        return None
    n, nbuf = _LEN.unpack_from(head, 0)[0], _LEN.unpack_from(head, _LEN.size)[0]
    sizes = _read_exact(src, nbuf * _LEN.size)
    payload = _read_exact(src, n)
    if sizes is None or payload is None:
        return None
    buffers = []
    for k in range(nbuf):
        buf = _read_exact(src, _LEN.unpack_from(sizes, k * _LEN.size)[0])
        if buf is None:
            return None
        buffers.append(buf)
    return bytes(payload), buffers


def main(argv: list[str]) -> int:
    from kvreplay.recorder.writer import ParquetSink

    # Not niced: the crash-safety promise (calls a second old are with this process)
    # holds only while it keeps up with the recorded program.
    src = sys.stdin.buffer
    first = _read_frame(src)
    if first is None:
        return 0  # the recording never started
    meta, rows_per_group, part_rows, part_s = pickle.loads(first[0])
    sink = ParquetSink(argv[0], meta, rows_per_group, part_rows, part_s)
    try:
        while (frame := _read_frame(src)) is not None and frame[0]:
            sink.add(pickle.loads(frame[0], buffers=frame[1]))
        sink.finish()
    except BaseException as exc:
        sink.abort()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    # The file is closed and renamed; tearing down pyarrow's thread pools and the
    # interpreter took half a second, and the recording process waits for this exit.
    os._exit(code)
