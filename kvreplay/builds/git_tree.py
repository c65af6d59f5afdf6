"""The source trees of ``git:REPO@REV`` builds: a revision's tree, exported once.

``git archive`` exports the tree at a commit into a cache directory keyed by the
repository and commit, and every later use of the same commit reuses it. Replaying
on a tree happens in a worker process (replay/worker.py) with the tree first on
``sys.path``."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from kvreplay.builds.cache import cache_root
from kvreplay.errors import BadInput

DEFAULT_TIMEOUT_S = 1800.0


def cache_dir() -> Path:
    return cache_root() / "trees"


def _git(repo: Path, *args: str) -> bytes:
    try:
        res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=600)
    except FileNotFoundError:
        raise BadInput("git is not installed") from None
    if res.returncode != 0:
        msg = res.stderr.decode(errors="replace").strip().splitlines()
        raise BadInput(f"git {' '.join(args[:2])} in {repo}: {msg[-1] if msg else 'failed'}")
    return res.stdout


def resolve_commit(repo: Path, rev: str) -> str:
    try:
        there = repo.is_dir()
    except OSError as exc:  # a name too long, a loop of links: no repository by that name
        raise BadInput(f"{str(repo)[:200]}: not a repository ({exc.strerror or exc})") from None
    if not there:
        raise BadInput(f"{str(repo)[:200]}: no such repository")
    return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").decode().strip()


def tree_at(repo: Path, rev: str) -> tuple[str, Path]:
    """(commit, directory holding the tree at that commit), exported on first use."""
    commit = resolve_commit(repo, rev)
    key = hashlib.sha256(f"{repo.resolve()}\0{commit}".encode()).hexdigest()[:16]
    dest = cache_dir() / f"{commit[:12]}-{key}"
    if dest.is_dir():
        return commit, dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=dest.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(_git(repo, "archive", "--format=tar", commit))) as tar:
            try:
                tar.extractall(tmp, filter="data")
            except TypeError:  # Python without extraction filters; git archive output is trusted
                tar.extractall(tmp)
        try:
            tmp.rename(dest)  # atomic: a concurrent export of the same commit just loses the race
        except OSError:
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return commit, dest


def path_for(tree: Path) -> list[str]:
    return [str(p) for p in (tree / "python", tree) if p.is_dir()]
