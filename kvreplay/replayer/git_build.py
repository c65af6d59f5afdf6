"""``git:REPO@REV[:MODULE:CLASS]`` builds: pool code at a revision, in its own process.

The tree at REV is exported once (``git archive``) into a cache directory keyed by
commit, and reused. A replay on it runs in a worker process
(``python -m kvreplay.replayer.git_build``) whose ``sys.path`` puts that tree first
(``python/`` too, sglang's layout), so two revisions never share an interpreter and a
build that crashes or hangs cannot take kvreplay down. The worker sends its report
back as JSON on a pipe. Without ``:MODULE:CLASS`` the worker uses the tree's sglang
allocator for the trace's family.

Outcomes the parent turns into a run status: ``unloadable`` (the revision does not
import or construct: exit 125, so ``git bisect run`` skips it), ``crashed`` (the
worker died, e.g. a segfault) and ``timeout``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreplay.errors import EXIT_BAD_INPUT, EXIT_UNLOADABLE, BadInput, BuildUnloadable, UnknownBuild

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class GitSpec:
    repo: Path
    rev: str
    cls: str  # MODULE:CLASS, or "" for the tree's sglang allocator

    @classmethod
    def parse(cls, spec: str) -> GitSpec:
        rest = spec.removeprefix("git:")
        repo, at, tail = rest.partition("@")
        if not at or not repo or not tail:
            raise UnknownBuild(f"bad build spec {spec!r}: expected git:REPO@REV or git:REPO@REV:MODULE:CLASS")
        rev, _, target = tail.partition(":")
        if target and ":" not in target:
            raise UnknownBuild(f"bad build spec {spec!r}: the class must be MODULE:CLASS")
        return cls(Path(repo).expanduser(), rev, target)


def cache_dir() -> Path:
    base = os.environ.get("KVREPLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvreplay")
    return Path(base) / "trees"


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
    if not repo.exists():
        raise BadInput(f"{repo}: no such repository")
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


def _path_for(tree: Path) -> list[str]:
    return [str(p) for p in (tree / "python", tree) if p.is_dir()]


def replay_in_worker(trace: str | Path, spec: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     **options: Any) -> tuple[dict[str, Any], str]:
    """Replay ``trace`` on the git build ``spec`` in a worker process.

    Returns (report as a dict, commit). The dict's ``status`` is clean, violation or
    divergence as usual, or unloadable, crashed or timeout."""
    g = GitSpec.parse(spec)
    commit, tree = tree_at(g.repo, g.rev)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*_path_for(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    request = {"trace": str(Path(trace).resolve()), "cls": g.cls, "spec": spec, "options": options}
    t0 = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-m", "kvreplay.replayer.git_build"], input=json.dumps(request),
                             capture_output=True, text=True, env=env, timeout=timeout_s, cwd=tree)
    except subprocess.TimeoutExpired:
        return _outcome(trace, spec, options, "timeout", f"no result after {timeout_s:.0f} s", t0), commit
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    reply = json.loads(lines[-1]) if lines else None
    if reply is None:
        why = res.stderr.strip().splitlines()
        detail = why[-1] if why else f"exit {res.returncode}"
        return _outcome(trace, spec, options, "crashed", f"the worker died ({detail})", t0), commit
    if reply.get("error") == "unloadable":
        return _outcome(trace, spec, options, "unloadable", reply["message"], t0), commit
    if reply.get("error") == "bad-input":
        raise BadInput(reply["message"])
    return reply["report"], commit


def _outcome(trace: Any, spec: str, options: dict[str, Any], status: str, message: str,
             t0: float) -> dict[str, Any]:
    return {"trace": str(trace), "build": spec, "mode": options.get("mode", "strict"),
            "device": options.get("device", "cpu"), "status": status, "calls_replayed": 0,
            "wall_s": time.perf_counter() - t0, "calls_per_s": 0.0, "violations": [], "violation_counts": {},
            "divergences": [], "divergence_counts": {}, "first_violation": None, "first_divergence": None,
            "capacity_assert_seq": None, "capacity_assert_after_calls": None, "held_at_end": {},
            "stopped_early": False, "message": message}


def _worker() -> int:
    """Worker side: one replay, one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    try:
        from kvreplay.replayer.engine import Replayer
        from kvreplay.replayer.sglang_adapter import spec_for

        build = "py:" + request["cls"] if request["cls"] else "sglang"
        replayer = Replayer(request["trace"], build, **request["options"])
        if build == "sglang":
            spec_for(replayer.meta.family, replayer.meta.pool_class)  # fail early, with the class named
        report = replayer.run()
        report.build = request["spec"]
        out = {"report": report.to_dict()}
    except BuildUnloadable as exc:
        out = {"error": "unloadable", "message": str(exc)}
    except BadInput as exc:
        out = {"error": "bad-input", "message": str(exc)}
    print(json.dumps(out, default=str), flush=True)
    return EXIT_UNLOADABLE if out.get("error") == "unloadable" else (EXIT_BAD_INPUT if "error" in out else 0)


if __name__ == "__main__":
    sys.exit(_worker())
