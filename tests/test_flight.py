"""Flight-recorder mode: the last N calls in memory, dumped when something goes wrong."""

from __future__ import annotations

import os
import signal

import pytest

from kvreplay.families.sglang.replayer import Replayer
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.families.sglang.variants import UnfilteredPage0SWAPool
from kvreplay.recorder.flight import flight_recorder
from kvreplay.replay.dispatch import replay
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model


def _drive(pool, scenario: str, requests: int, seed: int = 1) -> None:
    cfg = SynthConfig(scenario=scenario, out="unused.parquet", requests=requests, seed=seed)
    run_model(pool, cfg, SCENARIOS[scenario])


def test_a_dump_at_a_raised_exception_replays_from_its_snapshot_to_the_same_exception(tmp_path):
    pool = UnfilteredPage0SWAPool(2048, 512, 4, need_sort=True)  # #38519: its capacity assertion fires
    fr = flight_recorder(pool, tmp_path, calls=300, snapshot_every=100)
    with pytest.raises(AssertionError) as raised:
        _drive(pool, "radix-swa", 800)
    fr.close()
    assert len(fr.dumps) == 1
    dump = TraceReader(fr.dumps[0])
    calls = list(dump.calls(top_level_only=True))
    assert dump.meta.initial_state is not None and calls[0].seq > 0  # it starts from a snapshot
    assert 300 <= len(calls) <= 300 + 100 + 64
    assert dump.meta.extra["flight"]["reason"] == "exception"
    last = calls[-1]
    message = str(raised.value).splitlines()[0]  # (pytest may add its assertion explanation below)
    assert last.exc_type == "AssertionError" and last.exc_msg.splitlines()[0] == message

    r = Replayer(fr.dumps[0], "builtin:swa@unfiltered-page0", mode="strict")
    first_raise = None
    for tc in r.reader.top_calls():
        _, exc = r.step(tc)
        if exc is not None:
            first_raise = (tc.number, type(exc).__name__, str(exc).splitlines()[0])
            break
    assert first_raise == (len(calls), "AssertionError", message)  # calls are numbered 1..N: the last
    report = replay(fr.dumps[0], "builtin:swa@unfiltered-page0", device="cpu")
    assert report.divergences == [] and report.capacity_assert_call == len(calls)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_dump_of_a_correct_pool_replays_clean_from_its_snapshot(tmp_path):
    pool = SWAPool(2048, 512, 4, need_sort=True)
    fr = flight_recorder(pool, tmp_path, calls=2000, snapshot_every=500, signal=None)
    _drive(pool, "disagg-mtp", 300, seed=0)
    path = fr.dump(tmp_path / "now.parquet")
    fr.close()
    assert TraceReader(path).meta.initial_state is not None
    assert fr.calls_kept <= 2000 + 500 + 512
    for mode in ("strict", "remap"):
        r = replay(path, "builtin:swa", mode=mode, device="cpu")
        assert r.status == "clean", (mode, r.first_violation, r.first_divergence)
        assert 2000 <= r.calls_replayed <= 2000 + 500 + 512
    assert replay(path, "builtin:swa@stale-tail", device="cpu").status == "violation"


def test_a_signal_dumps_the_flight_recorder(tmp_path):
    pool = SWAPool(2048, 512, 4, need_sort=True)
    fr = flight_recorder(pool, tmp_path, calls=500)
    try:
        _drive(pool, "disagg-mtp", 100, seed=0)
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        fr.close()  # waits for the dump the signal started
    assert len(fr.dumps) == 1 and fr.dumps[0].parent == tmp_path
    assert TraceReader(fr.dumps[0]).meta.extra["flight"]["reason"] == f"signal {int(signal.SIGUSR2)}"
    assert replay(fr.dumps[0], "builtin:swa", device="cpu").status == "clean"
    assert signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None)  # the handler is gone again
