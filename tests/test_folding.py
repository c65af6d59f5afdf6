"""Folded counter reads: a scheduler's repeated reads cost no rows, and a trace recorded
that way replays with the same findings, call for call, as one recorded read by read."""

from __future__ import annotations

from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from unfolded import unfolded

from kvreplay.pool_api import COUNTER_READS
from kvreplay.pools.swa import SWAPool
from kvreplay.recorder import layout
from kvreplay.recorder.capture import native_available
from kvreplay.recorder.recording import record
from kvreplay.replay.dispatch import replay
from kvreplay.trace import format as trace_format
from kvreplay.trace.reader import TraceReader
from kvreplay.trace.summary import summarize
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model

CFG = SynthConfig(scenario="disagg-mtp", out="unused.parquet", requests=120, full_size=512, swa_size=256)
CHANGING = ("alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "free_group_end", "free_segments")
ENGINES = ["python"] + (["native"] if native_available() else [])


def _like_a_scheduler(pool, idle: int) -> None:
    """After each state change, poll the counters as sglang's scheduler does: a few
    reads of each while busy, and now and then a long idle stretch of them."""
    n = {"calls": 0}
    for name in CHANGING:
        recorded = getattr(pool, name)

        def polled(*a, _f=recorded, **k):
            out = _f(*a, **k)
            n["calls"] += 1
            for _ in range(idle if n["calls"] % 50 == 0 else 2):
                pool.full_available_size()
                pool.swa_available_size()
            pool.available_size()
            return out
        setattr(pool, name, polled)


def _read_rows(path) -> int:
    t = pq.read_table(path, columns=["depth", "method"]).to_pydict()
    return sum(1 for d, m in zip(t["depth"], t["method"], strict=True) if not d and m in COUNTER_READS)


def _recorded(path, engine: str, fold: bool) -> None:
    pool = SWAPool(512, 256, 4, need_sort=True)
    rec = record(pool, path, backend=engine, fold_reads=fold)
    _like_a_scheduler(pool, idle=400)
    run_model(pool, CFG, SCENARIOS["disagg-mtp"])
    rec.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_folded_and_unfolded_recordings_replay_alike_call_for_call(tmp_path, engine):
    plain, folded = tmp_path / "plain.parquet", tmp_path / "folded.parquet"
    _recorded(plain, engine, fold=False)
    _recorded(folded, engine, fold=True)
    # the same calls, with the same numbers and answers...
    assert unfolded(plain) == unfolded(folded)
    a, b = summarize(plain), summarize(folded)
    assert a.calls == b.calls and a.calls_per_method == b.calls_per_method and a.folded_reads == 0
    # ...with a tenth of the read rows or less (the first read in a free group is news), and fewer bytes
    assert _read_rows(folded) * 10 <= _read_rows(plain), (_read_rows(plain), _read_rows(folded))
    assert b.rows < a.rows and b.file_bytes < a.file_bytes
    # the same findings on a build with the seed bug, and none on the correct pool
    for build in ("builtin:swa", "builtin:swa@stale-tail", "builtin:swa@unfiltered-page0"):
        for mode in ("strict", "remap"):
            ra, rb = (replay(p, build, device="cpu", mode=mode) for p in (plain, folded))
            assert ra.calls_replayed == rb.calls_replayed == a.calls
            assert ra.status == rb.status
            assert [asdict(v) for v in ra.violations] == [asdict(v) for v in rb.violations]
            assert [asdict(d) for d in ra.divergences] == [asdict(d) for d in rb.divergences]
            assert ra.violation_counts == rb.violation_counts and ra.divergence_counts == rb.divergence_counts
    assert replay(folded, "builtin:swa@stale-tail", device="cpu").status == "violation"


def test_a_folded_read_that_would_answer_otherwise_is_a_divergence(tmp_path):
    """Replay calls every folded read on the build and checks its answer: a build whose
    counter drifts between two state changes diverges at the folded read itself."""
    path = tmp_path / "t.parquet"
    pool = SWAPool(512, 256, 4, need_sort=True)
    rec = record(pool, path)
    for _ in range(10):
        pool.available_size()
    rec.close()
    calls = list(TraceReader(path).calls())
    assert len(calls) == 10 and sum(c.from_fold for c in calls) == 9

    class Drifting(SWAPool):
        reads = 0

        def available_size(self):
            self.reads += 1
            return super().available_size() - (self.reads == 7)

    import sys
    sys.modules[__name__].Drifting = Drifting
    got = replay(path, f"py:{__name__}:Drifting", device="cpu")
    first = got.first_divergence
    assert got.status == "divergence" and first.method == "available_size" and 2 <= first.call <= 10


def test_a_version_1_trace_reads_as_one_without_folds(tmp_path):
    path = tmp_path / "t.parquet"
    _recorded(path, ENGINES[-1], fold=False)
    table = pq.read_table(path)
    old = table.drop_columns(["folded_reads", "folded_pattern"])
    md = dict(table.schema.metadata)
    md[b"kvreplay.schema_version"] = b"1"
    v1 = tmp_path / "v1.parquet"
    pq.write_table(old.replace_schema_metadata(md), v1)
    assert unfolded(v1) == unfolded(path)
    assert summarize(v1).calls == summarize(path).calls
    assert replay(v1, "builtin:swa", device="cpu").status == "clean"


@pytest.mark.parametrize("count, pattern, hint", [
    (-1, 2, "folds -1 counter reads"),
    (1 << 40, 2, "KVREPLAY_MAX_FOLDED_READS"),
    (3, 0, "names no counters"),
    (3, 4 * 2 + 2, "names no counters"),  # full, full: a pattern never repeats a counter
    (3, 5, "names no counters"),  # a digit 0 inside
])
def test_a_damaged_fold_is_a_one_line_trace_error(tmp_path, count, pattern, hint):
    from kvreplay.errors import TraceFormatError

    path = tmp_path / "t.parquet"
    _recorded(path, ENGINES[-1], fold=True)
    table = pq.read_table(path)
    n = table.column("folded_reads").to_pylist()
    at = next(i for i, v in enumerate(n) if v)
    n[at] = count
    p = table.column("folded_pattern").to_pylist()
    p[at] = pattern
    table = table.set_column(table.schema.get_field_index("folded_reads"), "folded_reads", pa.array(n, pa.int64()))
    table = table.set_column(table.schema.get_field_index("folded_pattern"), "folded_pattern",
                             pa.array(p, pa.int32()))
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    with pytest.raises(TraceFormatError, match=hint):
        TraceReader(bad).check_calls()


def test_the_capture_layout_and_the_trace_format_agree_on_the_pattern():
    assert layout.FOLD_MAX == trace_format.FOLD_MAX
