"""Replaying on a ``git:`` build: one replay in a worker process of its own.

The worker (``python -m kvreplay.replay.worker``) gets the revision's tree first on
``sys.path`` (``python/`` too, sglang's layout), so two revisions never share an
interpreter, and a build that crashes or hangs cannot take kvreplay down. It reads
one request as JSON on stdin and answers one JSON line on stdout. Without
``:MODULE:CLASS`` it uses the tree's sglang allocator for the trace's family.

Outcomes the parent turns into a run status: ``unloadable`` (the revision does not
import or construct: exit 125, so ``git bisect run`` skips it), ``crashed`` (the
worker died, e.g. a segfault) and ``timeout``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvreplay.builds.git_tree import DEFAULT_TIMEOUT_S, path_for, tree_at
from kvreplay.builds.spec import BuildSpec
from kvreplay.errors import EXIT_BAD_INPUT, EXIT_UNLOADABLE, BadInput, BuildUnloadable
from kvreplay.replay.report import ReplayReport, untestable


def replay_in_worker(trace: str | Path, spec: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     **options: Any) -> tuple[ReplayReport, str]:
    """Replay ``trace`` on the git build ``spec`` in a worker process; returns (the
    report, the commit). Its status is clean, violation or divergence as usual, or
    unloadable, crashed or timeout."""
    g = BuildSpec.parse(spec)
    assert g.kind == "git" and g.repo is not None
    commit, tree = tree_at(g.repo, g.rev)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*path_for(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    request = {"trace": str(Path(trace).resolve()), "cls": g.cls, "spec": spec, "options": options}
    t0 = time.perf_counter()

    def ended(status: str, message: str) -> tuple[ReplayReport, str]:
        return untestable(str(trace), spec, options.get("mode", "strict"), options.get("device", "cpu"), status,
                          message, time.perf_counter() - t0), commit

    try:
        res = subprocess.run([sys.executable, "-m", "kvreplay.replay.worker"], input=json.dumps(request),
                             capture_output=True, text=True, env=env, timeout=timeout_s, cwd=tree)
    except subprocess.TimeoutExpired:
        return ended("timeout", f"no result after {timeout_s:.0f} s")
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    reply = json.loads(lines[-1]) if lines else None
    if reply is None:
        why = res.stderr.strip().splitlines()
        return ended("crashed", f"the worker died ({why[-1] if why else f'exit {res.returncode}'})")
    if reply.get("error") == "unloadable":
        return ended("unloadable", reply["message"])
    if reply.get("error") == "bad-input":
        raise BadInput(reply["message"])
    return ReplayReport.from_dict(reply["report"]), commit


def _worker() -> int:
    """Worker side: one replay, one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    try:
        from kvreplay.builds.sglang import spec_for
        from kvreplay.replay.replayer import Replayer

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
