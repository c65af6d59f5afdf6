"""Rotation: a trace written as a directory of closed parts that reads as one trace."""

from __future__ import annotations

import textwrap

import pytest
from conftest import kill_a_second_after_its_mark
from unfolded import unfolded

from kvreplay.errors import TraceFormatError
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.recorder.recording import record
from kvreplay.replay.dispatch import replay
from kvreplay.trace.hashing import content_hash as file_hash
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model

CFG = SynthConfig(scenario="disagg-mtp", out="unused.parquet", requests=60, full_size=512, swa_size=256)


def _table(path) -> list:
    return unfolded(path)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_rotated_trace_reads_as_the_same_trace_in_parts(tmp_path, writer):
    one, parts = tmp_path / "one.parquet", tmp_path / "parts"
    for path, kw in ((one, {}), (parts, {"rotate_rows": 300})):
        pool = SWAPool(512, 256, 4, need_sort=True)
        rec = record(pool, path, writer=writer, rows_per_batch=64, **kw)
        run_model(pool, CFG, SCENARIOS["disagg-mtp"])
        rec.close()
    reader = TraceReader(parts)
    assert len(reader.parts) > 3 and [p.name for p in reader.parts][0] == "part-000000.parquet"
    assert _table(parts) == _table(one)
    assert reader.count_calls() == TraceReader(one).count_calls()  # rows may differ: folds follow batches
    assert replay(parts, "builtin:swa", device="cpu").status == "clean"
    assert file_hash(parts) == file_hash(parts) != file_hash(one)


@pytest.mark.slow
def test_killed_with_its_writer_a_rotated_trace_keeps_its_closed_parts(tmp_path):
    """The writer thread dies with the process: only parts closed before the kill
    survive, and with a part closed every 0.2 s nothing older than a second is lost."""
    path = tmp_path / "parts"
    script = textwrap.dedent(
        f"""
        import time
        from kvreplay.recorder.recording import record
        from kvreplay.families.sglang.paged import PagedPool
        pool = PagedPool(64, 4)
        record(pool, {str(path)!r}, writer="thread", rotate_s=0.2)
        n = 0
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            pool.free(pool.alloc(8))
            n += 1
        print(n, flush=True)
        while True:
            pool.free(pool.alloc(8))
        """
    )
    done = kill_a_second_after_its_mark(script)
    reader = TraceReader(path)
    calls = list(reader.calls(top_level_only=True))
    assert len(reader.parts) >= 3
    assert len(calls) >= 2 * done and [c.method for c in calls[: 2 * done]] == ["alloc", "free"] * done
    assert list(path.glob("*.tmp"))  # the part open at the kill is left unfinished and not read
    report = replay(path, "builtin:paged", device="cpu")
    assert not report.divergences


def test_a_directory_without_parts_is_a_clear_error(tmp_path):
    with pytest.raises(TraceFormatError, match="without trace parts"):
        TraceReader(tmp_path)


def _rotated(tmp_path, scenario: str = "disagg-mtp", requests: int = 150, **kw):
    from kvreplay.workload.synth import make_pool, validate

    out = tmp_path / "parts"
    cfg = SynthConfig(scenario=scenario, out=out, requests=requests)
    sc = validate(cfg)
    pool, _ = make_pool(cfg, sc)
    rec = record(pool, out, snapshot=False, rows_per_batch=64, **kw)
    run_model(pool, cfg, sc)
    rec.close()
    return out


def test_each_part_replays_alone_from_the_snapshot_at_its_start(tmp_path):
    out = _rotated(tmp_path, rotate_rows=400)
    whole = TraceReader(out)
    assert len(whole.parts) > 3
    first_calls, total = [], 0
    for part in whole.parts:
        alone = TraceReader(part)
        info = alone.meta.extra.get("part", {"index": 0, "first_call": 1, "standalone": True})
        first_calls.append(info["first_call"])
        assert info["standalone"] and (alone.meta.initial_state is not None) == (info["index"] > 0)
        r = replay(part, "builtin:swa", device="cpu")
        assert r.status == "clean" and r.calls_replayed == alone.count_calls()
        total += r.calls_replayed
    assert total == whole.count_calls()
    # Each part's first call is numbered in the whole recording: the parts before hold exactly that many.
    before = [sum(TraceReader(p).count_calls() for p in whole.parts[:k]) for k in range(len(whole.parts))]
    assert first_calls == [1 + n for n in before]


def test_a_bug_is_still_found_in_the_part_that_holds_it(tmp_path):
    out = _rotated(tmp_path, rotate_rows=400)
    found = [p for p in TraceReader(out).parts if replay(p, "builtin:swa@stale-tail", device="cpu").status != "clean"]
    whole = replay(out, "builtin:swa@stale-tail", device="cpu")
    assert whole.status != "clean" and found


@pytest.mark.parametrize("bound", [{"keep_parts": 3}, {"keep_bytes": 150_000}])
def test_retention_keeps_the_last_parts_and_what_stays_replays_as_one_trace(tmp_path, bound):
    out = _rotated(tmp_path, requests=300, rotate_rows=400, **bound)
    reader = TraceReader(out)
    names = [p.name for p in reader.parts]
    assert names[0] != "part-000000.parquet"  # the oldest went
    sizes = [p.stat().st_size for p in reader.parts]
    if "keep_parts" in bound:
        assert len(names) == 3
    else:
        assert sum(sizes[:-1]) <= 150_000 and len(names) >= 3
    assert reader.meta.initial_state is not None  # the oldest kept part starts from its snapshot
    r = replay(out, "builtin:swa", device="cpu")
    assert r.status == "clean" and r.calls_replayed == reader.count_calls()


def test_a_family_without_snapshots_rotates_but_keeps_every_part(tmp_path):
    """vLLM's manager has no snapshot kvreplay can restore: its later parts need the
    ones before them, so none is retired, and the directory replays whole."""
    out = _rotated(tmp_path, scenario="vllm-prefix", requests=120, rotate_rows=300, keep_parts=2)
    reader = TraceReader(out)
    assert len(reader.parts) > 2 and reader.parts[0].name == "part-000000.parquet"
    assert all(not TraceReader(p).meta.extra["part"]["standalone"] for p in reader.parts[1:])
    assert replay(out, "builtin:vllm", device="cpu").status == "clean"
