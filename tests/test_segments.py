"""Checkpoints and segment-parallel replay (replay --jobs): the merged run is the
serial run, for clean builds and buggy ones, in strict and remap mode."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvreplay.errors import BadInput
from kvreplay.families.sglang.replayer import Replayer
from kvreplay.replay.segments import plan, replay_segments
from kvreplay.trace.format import CHECKPOINT_METHOD
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SynthConfig, synthesize


def _synth(tmp: Path, scenario: str, every: int, name: str = "t.parquet", requests: int = 160) -> Path:
    out = tmp / name
    synthesize(SynthConfig(scenario=scenario, out=out, requests=requests, checkpoint_every=every))
    return out


def _same_run(a, b) -> None:
    da, db = a.to_dict(), b.to_dict()
    for d in (da, db):
        d.pop("wall_s")
        d.pop("cpu_s")
        d.pop("calls_per_s")
    assert da == db
    assert a.timeline == b.timeline  # what the report draws: occupancy and every finding's call


@pytest.fixture(scope="module")
def swa_trace(tmp_path_factory) -> Path:
    return _synth(tmp_path_factory.mktemp("seg"), "disagg-mtp", 700)


def test_checkpoints_are_rows_between_calls(tmp_path, swa_trace):
    plain = _synth(tmp_path, "disagg-mtp", 0, "plain.parquet")
    with_cp, without = TraceReader(swa_trace), TraceReader(plain)
    cps = with_cp.checkpoints()
    assert len(cps) >= 3 and without.checkpoints() == []
    # the same calls, numbered alike: checkpoint rows are not calls
    assert with_cp.count_calls() == without.count_calls()
    assert [cp.calls for cp in cps] == sorted(cp.calls for cp in cps)
    assert all(cp.calls >= 700 * (i + 1) for i, cp in enumerate(cps))
    a = [(t.number, t.call.method) for t in with_cp.top_calls() if t.number]
    b = [(t.number, t.call.method) for t in without.top_calls() if t.number]
    assert a == b
    segs = plan(with_cp, 2)
    assert len(segs) >= 3 and segs[0].start_row == 0 and segs[-1].end_row is None


@pytest.mark.slow_cases(
    "strict-builtin:swa@page-partial-clear",
    "strict-builtin:swa@unfiltered-page0",
    "remap-builtin:swa@page-partial-clear",
    "remap-builtin:swa@unfiltered-page0",
)
@pytest.mark.parametrize("build", ["builtin:swa", "builtin:swa@stale-tail",
                                   "builtin:swa@page-partial-clear", "builtin:swa@unfiltered-page0"])
@pytest.mark.parametrize("mode", ["strict", "remap"])
def test_jobs_give_the_serial_run(swa_trace, build, mode):
    serial = Replayer(swa_trace, build, mode=mode).run()
    parallel, version = replay_segments(str(swa_trace), build, jobs=2, mode=mode)
    _same_run(serial, parallel)
    assert version.startswith("kvreplay ")


def test_stop_first_and_paged_pools(tmp_path, swa_trace):
    serial = Replayer(swa_trace, "builtin:swa@stale-tail", stop_at_first=True).run()
    parallel, _ = replay_segments(str(swa_trace), "builtin:swa@stale-tail", jobs=2, stop_at_first=True)
    _same_run(serial, parallel)
    assert parallel.stopped_early
    paged = _synth(tmp_path, "decode", 400, "paged.parquet", requests=120)
    assert TraceReader(paged).checkpoints()
    for build in ("builtin:paged",):
        _same_run(Replayer(paged, build).run(), replay_segments(str(paged), build, jobs=2)[0])


def test_no_checkpoints_replays_serially(tmp_path):
    plain = _synth(tmp_path, "disagg-mtp", 0, "plain.parquet", requests=40)
    assert replay_segments(str(plain), "builtin:swa", jobs=2) is None


def test_damaged_checkpoint_is_bad_input(tmp_path, swa_trace):
    table = pq.read_table(swa_trace)
    rows = table.to_pylist()
    for r in rows:
        if r["method"] == CHECKPOINT_METHOD:
            for a in r["args"]:
                if a["name"] == "checker":
                    a["s"] = json.dumps({"format": 1, "shadows": {"full": {"owned": "!!", "live": "!!"}}})
    bad = tmp_path / "bad.parquet"
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), bad)
    with pytest.raises(BadInput, match="checkpoint"):
        replay_segments(str(bad), "builtin:swa", jobs=2)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_cli_jobs(swa_trace, cli):
    r = cli("replay", str(swa_trace), "--build", "builtin:swa@stale-tail", "--no-store", "-j", "2", "--json")
    serial = cli("replay", str(swa_trace), "--build", "builtin:swa@stale-tail", "--no-store", "--json")
    assert r.returncode == serial.returncode == 1
    a, b = json.loads(r.stdout), json.loads(serial.stdout)
    for d in (a, b):
        d.pop("wall_s")
        d.pop("cpu_s")
        d.pop("calls_per_s")
    assert a == b
    bad = cli("replay", str(swa_trace), "--build", "builtin:swa", "--no-store", "-j", "0")
    assert bad.returncode == 2 and "--jobs" in bad.stderr


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_rotated_parts_start_from_snapshots_and_still_split_at_checkpoints(tmp_path):
    """A rotating recording with checkpoints: every later part starts from the pool's
    snapshot (its metadata's starting state), and the parts still replay in parallel
    from the checkpoints between them."""
    from kvreplay.recorder.recording import record
    from kvreplay.workload.synth import make_pool, run_model, validate

    out = tmp_path / "rot"
    cfg = SynthConfig(scenario="disagg-mtp", out=out, requests=150)
    sc = validate(cfg)
    pool, _ = make_pool(cfg, sc)
    rec = record(pool, out, snapshot=False, rotate_rows=1000, checkpoint_every=500)
    run_model(pool, cfg, sc)
    rec.close()
    reader = TraceReader(out)
    assert len(reader.parts) >= 3 and reader.meta.initial_state is None
    for part in reader.parts[1:]:
        assert TraceReader(part).meta.initial_state is not None
    assert reader.checkpoints()
    serial = Replayer(out, "builtin:swa@stale-tail").run()
    _same_run(serial, replay_segments(str(out), "builtin:swa@stale-tail", jobs=2)[0])
