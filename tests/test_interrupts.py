"""Interrupting a command that runs workers ends them and removes their scratch files.

Each command runs with a marker in its environment, which every process it starts
inherits; after SIGTERM (or SIGINT) no process with the marker may be left, even one
re-parented to PID 1, and the temporary directory the command was given stays empty."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from servers import pids

SLOW_POOL = '''
import time
from kvreplay.families.sglang.swa import SWAPool


class Pool(SWAPool):
    def alloc_extend(self, *args, **kwargs):
        time.sleep(0.2)  # a slow build: the replay is still running when the signal comes
        return super().alloc_extend(*args, **kwargs)
'''


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A repository with two commits of a slow pool, and the same module on a path."""
    repo = tmp_path_factory.mktemp("slowrepo")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "dev@example.com")
    _git(repo, "config", "user.name", "Pool Dev")
    (repo / "slowpool.py").write_text(SLOW_POOL)
    revs = []
    for i in range(2):
        (repo / "notes.txt").write_text(f"{i}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"slow pool {i}")
        revs.append(_git(repo, "rev-parse", "HEAD"))
    return repo, revs


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from kvreplay.workload.synth import SynthConfig, synthesize

    out = tmp_path_factory.mktemp("itrace") / "t.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=out, requests=400, full_size=2048, swa_size=512,
                           checkpoint_every=200))
    return out


def _marked(named: bytes = b"") -> list[int]:
    marked = pids("environ", MARK.encode())
    return [p for p in marked if p in set(pids("cmdline", named))] if named else marked


MARK = f"KVREPLAY_TEST_INTERRUPT={uuid.uuid4().hex}"


def _interrupt(tmp_path: Path, sig: int, *argv: str, extra_path: str = "", worker: bytes = b"") -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    key, _, value = MARK.partition("=")
    env = {**os.environ, key: value, "TMPDIR": str(scratch), "KVREPLAY_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in (extra_path, os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", *argv, "--db", str(tmp_path / "k.db")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_marked(worker)) < 2 - bool(worker) and time.monotonic() < deadline:  # a worker is running
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        assert len(_marked(worker)) >= 2 - bool(worker), "no worker started"
        time.sleep(1.0)
        proc.send_signal(sig)
        code = proc.wait(timeout=15)  # not the minutes the replays still had to go
    finally:
        proc.kill()
    assert code == (143 if sig == signal.SIGTERM else 130), proc.stderr.read()
    deadline = time.monotonic() + 3
    while _marked() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked() == [], "workers outlived the command"
    assert list(scratch.iterdir()) == [], "scratch files left behind"


def test_sigterm_to_replay_jobs_ends_its_workers(tmp_path, trace, slow):
    repo, _ = slow
    _interrupt(tmp_path, signal.SIGTERM, "replay", str(trace), "--build", "py:slowpool:Pool", "--jobs", "2",
               extra_path=str(repo))


def test_sigterm_to_matrix_ends_its_worker_builds(tmp_path, trace, slow):
    repo, revs = slow
    builds = f"git:{repo}@{revs[0]}:slowpool:Pool,git:{repo}@{revs[1]}:slowpool:Pool"
    _interrupt(tmp_path, signal.SIGTERM, "matrix", str(trace), "--builds", builds, worker=b"kvreplay.replay.worker")


def test_sigint_to_bisect_ends_its_worker_and_removes_its_scratch(tmp_path, trace, slow):
    repo, revs = slow
    _interrupt(tmp_path, signal.SIGINT, "bisect", str(trace), "--repo", str(repo), "--good", revs[0],
               "--bad", revs[1], "--class", "slowpool:Pool", worker=b"kvreplay.replay.worker")


def test_a_command_is_not_stopping_because_an_earlier_one_in_the_process_was():
    """An in-process command that ended in an internal error killed its tree and left the
    process 'stopping': the next command's workers were refused as if interrupted."""
    from kvreplay import scratch

    with scratch.owned():
        scratch.kill_tree()
        assert scratch.stopping()
    with scratch.owned():
        assert not scratch.stopping()
