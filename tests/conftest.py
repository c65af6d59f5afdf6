"""Fixtures shared by the tests of git: builds and bisect."""

from __future__ import annotations

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
