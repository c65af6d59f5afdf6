"""Pool snapshots: attaching to a pool in use, and replaying from the snapshot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvreplay.families.sglang.replayer import Replayer
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.recorder.recording import record
from kvreplay.replay.dispatch import replay
from kvreplay.trace import snapshot
from kvreplay.trace.reader import TraceReader

TRACES = Path(__file__).resolve().parent.parent / "traces"


@pytest.fixture(scope="module")
def attached(tmp_path_factory):
    """The seed-bug workload, recorded from its middle: the first half drives the
    pool unrecorded, then a recording attaches and sees the second half."""
    src = TRACES / "disagg-mtp-2000.parquet"
    calls = list(TraceReader(src).top_calls())
    driver = Replayer(src, "builtin:swa", check=False)
    half = len(calls) // 2
    for tc in calls[:half]:
        driver.step(tc)
    out = tmp_path_factory.mktemp("a") / "attached.parquet"
    rec = record(driver.pool, out)
    for tc in calls[half:]:
        driver.step(tc)
    rec.close()
    return out, len(calls) - half


@pytest.mark.slow
def test_a_recording_attached_mid_life_starts_with_a_snapshot_and_replays_clean(attached):
    path, n = attached
    meta = TraceReader(path).meta
    assert meta.initial_state is not None and meta.initial_state["format"] == snapshot.FORMAT
    for mode in ("strict", "remap"):
        r = replay(path, "builtin:swa", mode=mode, device="cpu")
        assert r.calls_replayed == n
        assert r.status == "clean", (mode, r.first_divergence, r.first_violation)
    # The checker starts from the snapshot too: the bug variant is caught in the second half.
    bad = replay(path, "builtin:swa@stale-tail", device="cpu")
    assert bad.first_violation.invariant == "swa-mapping"


@pytest.mark.slow
def test_without_its_snapshot_the_attached_trace_would_not_replay(attached):
    path, _ = attached
    r = Replayer(path, "builtin:swa", check=True)
    fresh = Replayer(TRACES / "disagg-mtp-2000.parquet", "builtin:swa")  # a new pool, nothing restored
    calls = list(TraceReader(path).top_calls())
    fresh.run(calls=calls)
    assert fresh.found_something()
    assert r.run().status == "clean"


def test_a_fresh_pool_needs_no_snapshot(tmp_path):
    pool = SWAPool(256, 128, 4)
    record(pool, tmp_path / "t.parquet").close()
    assert TraceReader(tmp_path / "t.parquet").meta.initial_state is None


def test_snapshot_round_trips_into_a_new_pool():
    pool = SWAPool(256, 128, 4, need_sort=True)
    import torch

    one = torch.tensor([0]), torch.tensor([13])
    got = pool.alloc_extend(one[0], one[0], one[1], one[1], torch.tensor([-1]), 13)
    pool.free_group_begin()
    pool.free(got[:4])
    state = snapshot.take(pool)
    again = SWAPool(256, 128, 4, need_sort=True)
    assert snapshot.restore(again, state) == []
    assert snapshot.take(again) == state
    again.free_group_end()
    pool.free_group_end()
    assert snapshot.take(again) == snapshot.take(pool)


@pytest.mark.slow
def test_a_build_that_cannot_take_the_snapshot_is_unloadable(attached):
    path, _ = attached
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "replay", str(path), "--build",
                          "py:pool_policies:SlotsStateSWAPool", "--no-store"], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent)
    assert res.returncode == 125, res.stderr
    assert "cannot start from the trace's snapshot" in res.stderr and "full_to_swa_index_mapping" in res.stderr
