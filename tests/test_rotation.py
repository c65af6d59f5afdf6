"""Rotation: a trace written as a directory of closed parts that reads as one trace."""

from __future__ import annotations

import textwrap

import pytest
from conftest import kill_a_second_after_its_mark
from unfolded import unfolded

from kvreplay.errors import TraceFormatError
from kvreplay.pools.swa import SWAPool
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


def test_killed_with_its_writer_a_rotated_trace_keeps_its_closed_parts(tmp_path):
    """The writer thread dies with the process: only parts closed before the kill
    survive, and with a part closed every 0.2 s nothing older than a second is lost."""
    path = tmp_path / "parts"
    script = textwrap.dedent(
        f"""
        import time
        from kvreplay.recorder.recording import record
        from kvreplay.pools.paged import PagedPool
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
