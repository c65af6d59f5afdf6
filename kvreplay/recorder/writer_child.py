"""The trace writer's own process: reads frames from its stdin and writes the Parquet file.

It must outlive the process it records. A decode server ends by killing its whole
process tree: sglang's shutdown SIGKILLs every descendant of the launcher (it walks
parent links, so a child in a session of its own is still found), and a crashing
scheduler takes its children with it. So the writer does not stay a child: the
process the recorder starts forks once and exits at once, and the writer (the
grandchild, in a new session) is adopted by PID 1, or by ``kvreplay record`` where
that has made itself the subreaper. From then on no walk over the recorded
process's descendants, no signal to its process group, and no Ctrl-C in its
terminal reaches the writer. What it has read from the pipe, and what the kernel
still holds in the pipe, is written whatever becomes of the recorded process.

Without a parent waiting on it, the writer reports through its stderr, which the
recording process holds the read end of: one last line ``kvreplay-writer: ok`` or
``kvreplay-writer: failed: <why>``, then EOF when it exits.

Only the standard library is imported before the fork, so the fork happens within
milliseconds of the start and the window in which a tree kill can still catch the
writer is that short.

Pipe protocol: a frame is the pickle's length, the number of out-of-band buffers
and their lengths (8-byte little-endian each), the pickle (protocol 5), then the
buffers. The first frame holds the ``TraceMeta`` and the rows per group, then one
``RawBatch`` per frame; an empty pickle means "finish the file". If the pipe closes
without it (the recorded process died), the file is finished with every batch
received, so a crash loses only what had not been sent."""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

LEN = struct.Struct("<Q")
DONE = "kvreplay-writer: ok"
FAILED = "kvreplay-writer: failed: "


def detach() -> None:
    """Fork; the first process exits, the writer goes on in a new session, orphaned."""
    if os.fork():
        os._exit(0)
    os.setsid()


def unpin() -> None:
    """Let the calling thread (on Linux, only it) run on the CPUs ``kvreplay record`` was
    given (KVREPLAY_CPUS), whatever the recorded program pinned itself to since.

    Engines pin their processes: vLLM's CPU backend binds its processes to a core
    where compute threads spin. A writer or sender that inherits the pin waits behind
    them, falls seconds behind the calls it records, and a SIGKILL loses those seconds.
    The user's own limits (a taskset around kvreplay record, a cgroup) still hold."""
    cpus = os.environ.get("KVREPLAY_CPUS", "")
    try:
        if cpus:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    except (AttributeError, OSError, ValueError):
        pass


def _read_exact(src: BinaryIO, n: int) -> bytearray | None:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = src.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            return None
        got += k
    return out


def read_frame(src: BinaryIO) -> tuple[bytes, list[bytearray]] | None:
    """The next frame's pickle and out-of-band buffers; None when the pipe closed."""
    head = _read_exact(src, 2 * LEN.size)
    if head is None:
        return None
    n, nbuf = LEN.unpack_from(head, 0)[0], LEN.unpack_from(head, LEN.size)[0]
    sizes = _read_exact(src, nbuf * LEN.size)
    payload = _read_exact(src, n)
    if sizes is None or payload is None:
        return None
    buffers = []
    for k in range(nbuf):
        buf = _read_exact(src, LEN.unpack_from(sizes, k * LEN.size)[0])
        if buf is None:
            return None
        buffers.append(buf)
    return bytes(payload), buffers


def write_trace(path: str, src: BinaryIO, watch: Callable[[Any], Any] | None = None) -> None:
    """Write the frames of ``src`` to ``path``. ``watch(meta)``, when given, makes an
    observer whose ``feed`` sees every table the file takes and whose ``finish`` is
    called at the end (kvreplay.jobs.watch)."""
    import pickle

    from kvreplay.recorder.writer import ParquetSink

    first = read_frame(src)
    if first is None:
        return  # the recording never started
    meta, rows_per_group, rotation = pickle.loads(first[0])
    observer = watch(meta) if watch is not None else None
    sink = ParquetSink(path, meta, rows_per_group, rotation,
                       observe=observer.feed if observer is not None else None)
    if observer is not None and hasattr(observer, "sink"):
        observer.sink = sink  # its parts and retired parts, for the counters
    frames = _drained(src)
    try:
        while (frame := frames.get()) is not None and frame[0]:
            sink.add(pickle.loads(frame[0], buffers=frame[1]))
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    finally:
        if observer is not None:
            observer.finish()


def _drained(src: BinaryIO, max_bytes: int = 1 << 30) -> Any:
    """Frames read off the pipe as fast as they come, by a thread of their own, into a
    queue the encoder takes from. Encoding Parquet can fall behind the recorded program
    on a busy machine; reading cannot, so the recorded process's sender never waits on
    a full pipe with batches queued behind it in the memory a SIGKILL takes. Past
    ``max_bytes`` held, the reader waits for the encoder (memory stays bounded)."""
    import queue
    import threading

    out: queue.Queue[Any] = queue.Queue()
    room = threading.Semaphore(max(1, max_bytes >> 20))  # one permit per MiB held

    def read() -> None:
        try:
            while True:
                frame = read_frame(src)
                mib = 0 if frame is None else max(1, (len(frame[0]) + sum(map(len, frame[1]))) >> 20)
                for _ in range(mib):
                    room.acquire()
                out.put(frame if frame is None else (frame[0], frame[1], mib))
                if frame is None or not frame[0]:
                    return
        except BaseException:  # a broken pipe reads as its end: what came is written
            out.put(None)

    threading.Thread(target=read, name="kvreplay-pipe-reader", daemon=True).start()

    class Frames:
        def get(self) -> tuple[bytes, list[bytearray]] | None:
            got = out.get()
            if got is None:
                return None
            for _ in range(got[2]):
                room.release()
            return got[0], got[1]

    return Frames()


def main(argv: list[str], watch: Callable[[Any], Any] | None = None) -> int:
    if argv[:1] == ["--detach"]:
        detach()
        argv = argv[1:]
    # Not niced, and not pinned where the recorded program was: the crash-safety promise
    # (calls a second old are with this process) holds only while it keeps up.
    unpin()
    try:
        write_trace(argv[0], sys.stdin.buffer, watch)
    except BaseException as exc:
        why = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line: the recording process reads the last
        print(f"{FAILED}{why}", file=sys.stderr)
        return 1
    print(DONE, file=sys.stderr)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    # The file is closed and renamed; tearing down pyarrow's thread pools and the
    # interpreter took half a second, and the recording process waits for this exit.
    os._exit(code)
