"""Fixtures shared by the tests (a CLI runner, traces, stores, the kill -9 harness of
the recorder tests) and the test tiers' markers."""

from __future__ import annotations

import os

# One intra-op thread for torch here and in every process a test starts (the CLI,
# workers): the pools' tensors are small, and an idle OpenMP worker spinning on the
# second core slows the whole suite. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess
import sys
import time
from pathlib import Path

import pytest
import tier_markers
import torch

from kvreplay.workload.synth import SynthConfig, synthesize

torch.set_num_threads(1)


def pytest_configure(config):
    """SIGTERM (a tier's time budget running out, CI ending a background soak) ends the
    run as Ctrl-C does: fixtures and ``finally`` blocks still stop the servers a test
    started, instead of leaving them polling on a machine the next run shares."""
    import signal

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    for line in tier_markers.lines():
        config.addinivalue_line("markers", line)


def run_in_process(capsys, *argv: str) -> subprocess.CompletedProcess[str]:
    """The kvreplay command run in this process (no interpreter or torch start-up)."""
    from kvreplay.cli.app import main

    code = 0
    try:
        main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    cap = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, cap.out, cap.err)


class PythonPeak:
    """``with PythonPeak() as p: ...`` then ``p.bytes``: the most Python allocated inside
    the block, in every thread. A bound on it holds whatever this xdist worker ran before,
    where a difference of ru_maxrss reads 0 once an earlier test peaked higher."""

    def __enter__(self) -> PythonPeak:
        import tracemalloc

        self._was_tracing = tracemalloc.is_tracing()
        if not self._was_tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        import tracemalloc

        self.bytes = tracemalloc.get_traced_memory()[1] - self._base
        if not self._was_tracing:
            tracemalloc.stop()


@pytest.fixture
def cli(capsys):
    """``cli("replay", ...)``: a CompletedProcess with the exit code and output."""
    return lambda *argv: run_in_process(capsys, *argv)


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


# The tiers are markers on the tests themselves (tests/tier_markers.py declares them): `slow`
# on a test, or on some of its cases through pytest.param(..., marks=pytest.mark.slow) or,
# where the cases come from a fixture's parameters, `slow_cases("id", ...)` on the test;
# `browser`, `live`, `gpu`, `sglang`, `vllm`, `mamba`, `soak`, `ray` likewise. A case id that
# `slow_cases` names and no case of its test has is an error: a renamed case cannot drop into
# the fast tier. So is a marker nothing declares (pytest_make_collect_report below). The
# rest get `fast` here (pyproject's addopts select -m fast), so the tier is decided by
# tier_markers.in_fast_tier alone.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    named: dict[object, set[str]] = {}
    seen: dict[object, set[str]] = {}
    for item in items:
        mark = item.get_closest_marker("slow_cases")
        if mark is None:
            continue
        fn = getattr(item, "function", None)
        named[fn] = set(mark.args)
        case = item.callspec.id if hasattr(item, "callspec") else ""
        seen.setdefault(fn, set()).add(case)
        if case in mark.args:
            item.add_marker(pytest.mark.slow)
    whole = not any("::" in a for a in config.args)  # (naming one case collects only that one)
    for fn, ids in named.items():
        if whole and ids - seen[fn]:
            raise pytest.UsageError(f"{fn.__name__}: slow_cases names {sorted(ids - seen[fn])}, which are not "
                                    f"among its cases {sorted(seen[fn])}")
    _sort_into_the_fast_tier(config, items)
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device (scripts/gpu-check.sh runs these)"))


def _declared(config) -> set[str]:
    declared = {tier_markers.name_of(line) for line in config.getini("markers")}
    # (declared here too where only the hooks are borrowed: tests/test_front_door.py's check)
    return declared | {tier_markers.name_of(m) for m in tier_markers.MARKERS} | {tier_markers.FAST}


def _sort_into_the_fast_tier(config, items) -> None:
    declared = _declared(config)
    for item in items:
        names = {m.name for m in item.iter_markers()}
        # (an undeclared marker is a collection error; where that hook is not in use it still
        # keeps its test out)
        if tier_markers.in_fast_tier(names) and names <= declared:
            item.add_marker(tier_markers.FAST)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A marker nothing declares, or ``fast`` written by hand, fails the collection of its
    test's module or class: a misspelt ``sglnag`` would put an engine's test in the fast
    tier, pytest only warns of it, and an error raised later (in
    pytest_collection_modifyitems) dies unread in an xdist worker."""
    outcome = yield
    report = outcome.get_result()
    if not report.passed:
        return
    declared = _declared(collector.config)
    wrong = []
    for item in report.result:
        if not isinstance(item, pytest.Item):
            continue
        names = {m.name for m in item.iter_markers()}
        wrong += [f"{item.nodeid}: undeclared marker {m!r}" for m in sorted(names - declared)]
        if tier_markers.FAST in names:
            wrong.append(f"{item.nodeid}: {tier_markers.FAST!r} is given by tests/conftest.py, not written on a test")
    if wrong:
        outcome.force_result(pytest.CollectReport(
            report.nodeid, "failed", "test markers (tests/tier_markers.py declares the tiers' markers):\n  "
            + "\n  ".join(wrong), []))


@pytest.fixture(scope="session")
def postgres_admin(tmp_path_factory):
    """A running PostgreSQL server (started here unless .ci/run started one)."""
    from servers import postgres

    with postgres(tmp_path_factory.mktemp("pg")) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty store of each kind: a SQLite file, a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "r.db")
    from servers import fresh_database

    return fresh_database(request.getfixturevalue("postgres_admin"))
