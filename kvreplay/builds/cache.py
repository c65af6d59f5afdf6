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


def cache_root() -> Path:
    base = os.environ.get("KVREPLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvreplay")
    return Path(base)


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
