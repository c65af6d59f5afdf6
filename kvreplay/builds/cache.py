"""kvreplay's cache on disk: where fetched code lives, and how it gets there safely.

Everything a build fetches (``git:`` trees, sglang release wheels, dependency
overlays) is made once under ``$KVREPLAY_CACHE`` (default ``~/.cache/kvreplay``) and
reused. A directory is built under a temporary name and renamed into place, so a
reader never sees half of one; a lock file per entry makes concurrent makers (the
parallel workers of ``kvreplay matrix``) wait for the first instead of racing it."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvreplay.errors import BadInput


def cache_root() -> Path:
    """``$KVREPLAY_CACHE`` (default ``~/.cache/kvreplay``): BadInput when it cannot be a
    directory kvreplay writes in (a file, or below one; no write permission), said before
    anything is fetched rather than as an error from deep inside a build."""
    given = os.environ.get("KVREPLAY_CACHE", "").strip()
    base = Path(given or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                      "kvreplay")).absolute()
    near = next((p for p in (base, *base.parents) if os.path.lexists(p)), Path("/"))
    if not near.is_dir() or not os.access(near, os.W_OK | os.X_OK):
        why = "is not a directory" if not near.is_dir() else "is not writable"
        raise BadInput(f"KVREPLAY_CACHE={str(base)[:200]!r}: {near} {why} (want a directory kvreplay can write "
                       "its fetched builds in)")
    return base


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``path.lock`` exclusively (other processes wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def made_once(dest: Path, make: Callable[[Path], None]) -> Path:
    """``dest``, made by ``make(tmpdir)`` the first time (under a lock, renamed into
    place when complete); a failed make leaves nothing behind."""
    if dest.is_dir():
        return dest
    with locked(dest):
        if dest.is_dir():  # made by the process we waited for
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".partial-{dest.name}-", dir=dest.parent))
        try:
            make(tmp)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def size_of(path: Path) -> int:
    """Bytes under ``path`` (files only)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
