"""The benchmarks still run and still print what the README quotes from them.

Nothing here is timed: a tiny run of each script, checked for its exit code and for
a line per figure, so a change to the recorder or the replayer cannot silently leave
a benchmark broken until the next time someone needs its numbers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def setups_of_recorder_bench() -> list[str]:
    spec = importlib.util.spec_from_file_location("recorder_overhead", BENCH / "recorder_overhead.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return [label for label, _ in mod.SETUPS]


@pytest.mark.slow
def test_recorder_overhead_prints_a_ratio_for_every_setup_and_the_trace_size():
    got = run_bench(str(BENCH / "recorder_overhead.py"), "--requests", "15", "--repeat", "1")
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    labels = setups_of_recorder_bench()
    for label in set(labels):
        mine = [ln for ln in lines if ln.startswith(label + " ")]
        assert len(mine) == labels.count(label), f"{labels.count(label)} lines for {label!r} expected in:\n{got.stdout}"
        for line in mine:
            fastest, ratio, pair = line[len(label):].split()[:3]
            assert fastest.endswith("s") and float(ratio) > 0 and float(pair) > 0
    assert "bytes/index" in got.stdout
    # the recording path's own cost per call, beside the floor, and its share of a live scheduler
    assert "a bare Python method call (floor)" in got.stdout and "recorded, folded" in got.stdout
    assert "recorder's share of a scheduler at 1 CPU s/s:" in got.stdout


@pytest.mark.slow
def test_replay_overhead_prints_both_modes_clean(swa_trace_80):
    got = run_bench(str(BENCH / "replay_overhead.py"), str(swa_trace_80), "--repeat", "1")
    assert got.returncode == 0, got.stderr
    assert "replay strict + checks" in got.stdout and "(clean)" in got.stdout
    assert "replay remap  + checks" in got.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the bench measures instead")
def test_gpu_recorder_says_plainly_that_it_measured_nothing_without_cuda():
    got = run_bench(str(BENCH / "gpu_recorder.py"), "--requests", "5", "--repeat", "1")
    assert got.returncode == 3
    assert "no CUDA device" in got.stderr and got.stdout == ""


@pytest.mark.slow
@pytest.mark.browser
def test_report_open_prints_size_and_open_time():
    from servers import browser  # skips (or fails under .ci/run) without Chromium and Playwright

    with browser():
        pass
    got = run_bench(str(BENCH / "report_open.py"), "--requests", "40", "--repeat", "1")
    assert got.returncode == 0, got.stderr
    assert "report size:" in got.stdout and "open to chart drawn" in got.stdout
