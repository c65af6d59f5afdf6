"""Reading and writing the files kvreplay keeps beside its traces (a corpus manifest,
a trace copied into a corpus, a recording's counters and findings) as the input and
output they are.

Their directories may be shared with other users of the host, or hold what an
earlier, damaged run left. So a read opens the file without blocking (a FIFO put in
its place would wait forever for a writer), takes only a regular file (``/dev/zero``
never ends) and refuses one past its bound before reading a byte of it. A write
never goes through a link or into a FIFO or a device put where the file goes: it
makes a new file beside it, exclusively and without following links, and renames
it into place, so the destination is either the old file or the whole new one and
its mode is the one asked for, never a replaced device's 0666."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from kvreplay.errors import BadInput

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CHUNK = 1 << 20


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in words, for an error message."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], what: str, *, follow: bool = True) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``, when it is a regular file
    (checked on the descriptor, so nothing swapped in after the check is read). The
    open never blocks on a FIFO; ``follow=False`` refuses a link too."""
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise BadInput(f"{path}: the {what} is a symbolic link; kvreplay reads only a regular file there") from None
        raise BadInput(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{path}: the {what} is {kind_of(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path: str | os.PathLike[str], limit: int, what: str, *, follow: bool = True) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; BadInput (one
    line) when it is anything else, larger, or unreadable. ``follow=False``: a link is
    refused too (for files kvreplay itself writes, which are never links)."""
    fd, st = open_regular(path, what, follow=follow)
    try:
        if st.st_size > limit:
            raise BadInput(f"{path}: the {what} is {st.st_size} bytes, larger than the {limit} bytes kvreplay reads")
        chunks, got = [], 0
        while got <= limit:  # a file still growing is cut at limit + 1: then it is refused
            chunk = os.read(fd, min(_CHUNK, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if got > limit:
        raise BadInput(f"{path}: the {what} is larger than the {limit} bytes kvreplay reads")
    return b"".join(chunks)


def check_destination(path: str | os.PathLike[str], what: str = "file") -> os.stat_result | None:
    """Refuse to write ``path`` when something other than a regular file is there (a
    link, a FIFO, a device, a directory); its ``lstat`` when it is one, None when
    nothing is there. Called before any work whose result would go there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadInput(f"{path}: cannot write the {what} there ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{path}: {kind_of(st.st_mode)} is where the {what} goes; kvreplay replaces only a regular "
                       "file (remove it)")
    return st


def write_atomic(path: str | os.PathLike[str], data: bytes | Iterable[bytes], mode: int = 0o644,
                 sync: bool = True) -> None:
    """Put ``data`` (bytes, or chunks of them) at ``path`` whole or not at all: written
    to a new file beside it (O_EXCL|O_NOFOLLOW: never a link or a FIFO planted there),
    synced, then renamed over it. A destination that is not a regular file is refused;
    a regular one keeps its permission bits, a new file gets ``mode``. BadInput (one
    line) on any failure, and nothing is left behind. ``sync=False``: not forced to disk
    (a file rewritten every second, whose loss in a crash costs nothing)."""
    path = Path(path)
    old = check_destination(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    except OSError as exc:
        raise BadInput(f"{path}: cannot write it ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                f.write(chunk)
            f.flush()
            # exactly this mode, whatever the umask: what a reader of the corpus expects
            os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode) if old is not None else mode)
            if sync:
                os.fsync(f.fileno())
        check_destination(path)  # still not a link or a FIFO: rename() would replace one, not follow it
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise BadInput(f"{path}: cannot write it ({exc.strerror or exc})") from None
        raise
    if sync:
        _sync_dir(path.parent)


def _sync_dir(directory: Path) -> None:
    """The rename itself on disk (best effort: not every file system syncs a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
