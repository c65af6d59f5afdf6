"""Interrupting a command that runs workers ends them and removes their scratch files.

Each command runs with a marker in its environment, which every process it starts
inherits; after SIGTERM (or SIGINT) no process with the marker may be left, even one
re-parented to PID 1, and the temporary directory the command was given stays empty.

Nothing here waits a fixed number of seconds: the build replayed never returns from
its first allocation (so a command that ends, ends because of the signal), and it says
when it got there by a file; the timeouts only bound a test that would otherwise hang."""

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
import os
import time
from pathlib import Path

from kvreplay.families.sglang.swa import SWAPool


class Pool(SWAPool):
    def alloc_extend(self, *args, **kwargs):
        # A replay is running now: say so, then never return (the signal must end it).
        Path(os.environ["KVREPLAY_TEST_REPLAYING"], str(os.getpid())).touch()
        while True:
            time.sleep(0.05)
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
    scratch, replaying = tmp_path / "tmp", tmp_path / "replaying"
    scratch.mkdir()
    replaying.mkdir()
    key, _, value = MARK.partition("=")
    env = {**os.environ, key: value, "TMPDIR": str(scratch), "KVREPLAY_CACHE": str(tmp_path / "cache"),
           "KVREPLAY_TEST_REPLAYING": str(replaying),
           "PYTHONPATH": os.pathsep.join(p for p in (extra_path, os.environ.get("PYTHONPATH", "")) if p)}
    # As a shell's foreground command: SIGINT at its default. A test run started in the
    # background by a non-interactive shell (as CI may be) ignores SIGINT, every process it
    # starts inherits that, and Python then never turns SIGINT into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", *argv, "--db", str(tmp_path / "k.db")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_as_in_a_foreground_command)
    try:
        _until(lambda: any(replaying.iterdir()) or proc.poll() is not None, "no replay started")
        assert proc.poll() is None, proc.stderr.read()
        if worker:  # the replay that started is in a worker process of the command's
            assert {int(p.name) for p in replaying.iterdir()} & set(_marked(worker)), "the replay is not a worker's"
        proc.send_signal(sig)
        code = proc.wait(timeout=120)  # only a hang guard: the build never returns on its own
    finally:
        proc.kill()
    assert code == (143 if sig == signal.SIGTERM else 130), proc.stderr.read()
    _until(lambda: not _marked(), "workers outlived the command")
    assert list(scratch.iterdir()) == [], "scratch files left behind"


def _sigint_as_in_a_foreground_command() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _until(done, failure: str, guard_s: float = 300.0) -> None:
    """Wait for ``done()``; ``guard_s`` only bounds a test that would otherwise hang."""
    deadline = time.monotonic() + guard_s
    while not done():
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_to_replay_jobs_ends_its_workers(tmp_path, trace, slow):
    repo, _ = slow
    _interrupt(tmp_path, signal.SIGTERM, "replay", str(trace), "--build", "py:slowpool:Pool", "--jobs", "2",
               extra_path=str(repo))


def test_sigterm_to_matrix_ends_its_worker_builds(tmp_path, trace, slow):
    repo, revs = slow
    builds = f"git:{repo}@{revs[0]}:slowpool:Pool,git:{repo}@{revs[1]}:slowpool:Pool"
    _interrupt(tmp_path, signal.SIGTERM, "matrix", str(trace), "--builds", builds, worker=b"kvreplay.replay.worker")


@pytest.mark.slow
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
