"""Git repositories the tests make: a pool's history for bisect and git: builds, a
reader's checkout for the docs' commands."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git(repo: Path, *args: str) -> str:
    """Run git in ``repo``; its output, stripped (a failure raises)."""
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def new_repo(repo: Path, name: str = "tests", email: str = "tests@example.com") -> None:
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", email)
    git(repo, "config", "user.name", name)


def commit_all(repo: Path, message: str, tag: str | None = None) -> str:
    """Commit everything in the work tree (and tag it); the new commit's hash."""
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    if tag:
        git(repo, "tag", tag)
    return git(repo, "rev-parse", "HEAD")
