"""Fixtures shared by the tests of git: builds and bisect, and the kill -9 harness of
the recorder tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvreplay.replayer.workload.synth import SynthConfig, synthesize


@pytest.fixture(scope="session")
def swa_trace_80(tmp_path_factory):
    """A small disagg-mtp trace (80 requests) that builtin:swa replays clean and the
    stale-tail family of bugs breaks."""
    out = tmp_path_factory.mktemp("swa80") / "t.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=out, requests=80, full_size=512, swa_size=256))
    return out


@pytest.fixture
def git_tree_cache(tmp_path_factory, monkeypatch):
    """Exported git trees go under this session's temporary directory, not ~/.cache."""
    monkeypatch.setenv("KVREPLAY_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def kill_a_second_after_its_mark(script: str, wait_for: Path | None = None) -> int:
    """Run ``script`` in a child Python, read the number it prints once its marked
    calls are done, SIGKILL it 1.05 s later (no atexit, no flush) and return that
    number. ``wait_for``: a file the writer process finishes once its pipe closes."""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        done = int(child.stdout.readline())
        time.sleep(1.05)
        child.kill()
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        while wait_for is not None and not wait_for.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.kill()
    return done
