"""Fault injection: whatever goes wrong in the recorder, the recorded program runs on
with the same results, and the trace marks the calls it lost."""

from __future__ import annotations

import errno

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvreplay.errors import BadInput
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.recorder.raw_batch import RawBatch
from kvreplay.recorder.recording import record
from kvreplay.recorder.writer import ParquetSink
from kvreplay.replay.dispatch import replay
from kvreplay.trace.format import GAP_TARGET
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model

CFG = SynthConfig(scenario="disagg-mtp", out="unused.parquet", requests=120, full_size=512, swa_size=256)


def _model(recorded: dict | None, path=None):
    pool = SWAPool(512, 256, 4, need_sort=True)
    rec = record(pool, path, **recorded) if recorded is not None else None
    stats = run_model(pool, CFG, SCENARIOS["disagg-mtp"])
    if rec is not None:
        rec.close()
    return stats, rec


@pytest.fixture(scope="module")
def unrecorded():
    return _model(None)[0]


@pytest.fixture(scope="module")
def all_calls(tmp_path_factory):
    """Top-level calls of the model, from a recording nothing went wrong with."""
    path = tmp_path_factory.mktemp("clean") / "t.parquet"
    _model(dict(writer="thread"), path)
    return len(_calls(path))


def _accounted(path, all_calls: int) -> None:
    """Every call is either in the trace or counted by a gap that covers its place."""
    gaps, seqs = _gaps(path), [c.seq for c in _calls(path)]
    assert len(seqs) + sum(g.args["lost_calls"] for g in gaps) == all_calls
    for g in gaps:
        assert not any(g.args["first_seq"] <= s <= g.args["last_seq"] for s in seqs)


def _gaps(path):
    return TraceReader(path).gaps()


def _calls(path):
    return [c for c in TraceReader(path).calls(top_level_only=True) if c.target != GAP_TARGET]


def test_a_full_writer_queue_drops_calls_without_blocking_and_marks_the_gap(tmp_path, monkeypatch, unrecorded,
                                                                            all_calls):
    import time

    slow_add = ParquetSink.add

    def slow(self, item):
        time.sleep(0.02)  # a writer that cannot keep up
        slow_add(self, item)

    monkeypatch.setattr(ParquetSink, "add", slow)
    path = tmp_path / "t.parquet"
    stats, rec = _model(dict(writer="thread", rows_per_batch=16, max_queued_rows=64), path)
    assert stats == unrecorded  # the program saw no difference
    gaps = _gaps(path)
    assert rec.lost_calls > 0 and gaps
    assert sum(g.args["lost_calls"] for g in gaps) == rec.lost_calls
    _accounted(path, all_calls)
    assert all(g.args["state"] for g in gaps) and "queue was full" in gaps[0].args["reason"]

    with pytest.raises(BadInput, match="gap"):
        replay(path, "builtin:swa", device="cpu")
    r = replay(path, "builtin:swa", device="cpu", after_gap=True)
    after = [c for c in _calls(path) if c.seq > gaps[-1].seq]
    assert r.calls_replayed == len(after) and r.status == "clean", (r.first_violation, r.first_divergence)


def test_a_writer_that_raises_on_a_batch_loses_only_that_batch(tmp_path, monkeypatch, unrecorded, all_calls):
    real = RawBatch.to_table
    seen = {"n": 0}

    def flaky(self):
        seen["n"] += 1
        if seen["n"] == 3:
            raise ValueError("injected conversion failure")
        return real(self)

    monkeypatch.setattr(RawBatch, "to_table", flaky)
    path = tmp_path / "t.parquet"
    stats, _ = _model(dict(writer="thread", rows_per_batch=64), path)
    assert stats == unrecorded
    gaps = _gaps(path)
    assert len(gaps) == 1 and "injected conversion failure" in gaps[0].args["reason"]
    assert gaps[0].args["lost_calls"] > 0
    _accounted(path, all_calls)
    with pytest.raises(BadInput, match="no pool snapshot"):  # the writer cannot snapshot the pool
        replay(path, "builtin:swa", device="cpu", after_gap=True)


class _FullDisk:
    """pyarrow's ParquetWriter as a full disk leaves it: the write that fails raises
    ENOSPC and closes the writer, so every later write on it fails too (what a real
    full tmpfs does), and the file under it has no footer. Dead writers are kept, not
    their id()s: a new writer could reuse a freed one's id and be taken for dead."""

    def __init__(self, monkeypatch, fail_at: set[int]):
        self.real, self.n, self.fail_at, self.dead = pq.ParquetWriter.write_table, 0, fail_at, []
        monkeypatch.setattr(pq.ParquetWriter, "write_table", self)

    def __get__(self, writer, owner):
        return lambda table, *a, **k: self.write(writer, table, *a, **k)

    def write(self, writer, table, *a, **k):
        self.n += 1
        if any(w is writer for w in self.dead):
            raise pa.ArrowInvalid("Operation on closed file")
        if self.n in self.fail_at:
            self.dead.append(writer)
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(writer, table, *a, **k)


@pytest.mark.parametrize("rotate_rows", [0, 400])
def test_a_full_disk_costs_at_most_the_open_part_and_the_trace_goes_on(tmp_path, monkeypatch, unrecorded,
                                                                       all_calls, rotate_rows):
    disk = _FullDisk(monkeypatch, fail_at={4, 9})
    path = tmp_path / "t"
    pool = SWAPool(512, 256, 4, need_sort=True)
    rec = record(pool, path, writer="thread", rows_per_group=128, rows_per_batch=64, rotate_rows=rotate_rows)
    stats = run_model(pool, CFG, SCENARIOS["disagg-mtp"])
    rec.close()
    assert stats == unrecorded
    assert disk.n > 9 and len(disk.dead) == 2
    gaps = _gaps(path)
    assert gaps and all("No space left" in g.args["reason"] for g in gaps)
    _accounted(path, all_calls)  # every file there reads, and nothing is lost unmarked
    assert len(_calls(path)) > 100  # the calls written after the failures are there
    lost = sum(g.args["lost_calls"] for g in gaps)
    if rotate_rows:  # only the open part (at most ~400 rows, some nested) and the failed group (128 rows),
        # a row holding its call and at most a free group's begin and end folded into it
        assert lost < 3 * (400 + 128) and len(list(path.glob("part-*.parquet"))) > 3
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_disk_that_stays_full_leaves_no_unreadable_file(tmp_path, monkeypatch, unrecorded):
    _FullDisk(monkeypatch, fail_at=set(range(2, 10_000)))
    path = tmp_path / "t.parquet"
    pool = SWAPool(512, 256, 4, need_sort=True)
    rec = record(pool, path, writer="thread", rows_per_group=128, rows_per_batch=64)
    stats = run_model(pool, CFG, SCENARIOS["disagg-mtp"])
    with pytest.raises(RuntimeError, match="No space left|could not write"):
        rec.close()
    assert stats == unrecorded
    assert not path.exists() and not list(tmp_path.glob("*.tmp"))


def test_a_recorder_that_stops_says_so_at_the_end_of_its_trace(tmp_path, monkeypatch, cli):
    from kvreplay.recorder.writer import TraceWriter

    pool = SWAPool(64, 32, 4, need_sort=False)
    rec = record(pool, tmp_path / "t.parquet", writer="thread", rows_per_batch=1)
    import torch

    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)

    def broken(*a, **k):
        raise OSError("writer gone")

    monkeypatch.setattr(TraceWriter, "offer", broken)
    second = pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)
    assert second.tolist() == [8, 9, 10, 11]
    monkeypatch.undo()
    rec.close()
    gaps = _gaps(tmp_path / "t.parquet")
    assert len(gaps) == 1 and gaps[0].args["lost_calls"] == -1 and "writer gone" in gaps[0].args["reason"]
    res = cli("replay", str(tmp_path / "t.parquet"), "--build", "builtin:swa", "--no-store")
    assert res.returncode == 2 and "gap" in res.stderr and res.stderr.count("\n") == 1


def test_a_dropped_batchs_snapshot_is_encoded_on_the_writers_side(tmp_path):
    """The program's thread only captures the pool (device copies); the gap's JSON is
    made where the writer takes it, and a merged gap keeps the newest state."""
    import pickle

    from kvreplay.recorder.writer import settled
    from kvreplay.trace.format import GapRecord

    calls = []

    def later_state() -> str:
        calls.append(1)
        return '{"format": 1}'

    first = GapRecord(0, 4, 5, "queue full", "", 1, pending_state=lambda: '{"old": 1}')
    gap = first.merged(GapRecord(5, 9, 5, "queue full", "", 2, pending_state=later_state))
    assert not calls and (gap.first_seq, gap.last_seq, gap.lost_calls) == (0, 9, 10)
    done = settled(gap)
    assert calls == [1] and done.state == '{"format": 1}' and done.pending_state is None
    assert pickle.loads(pickle.dumps(done)) == done  # what the process writer sends
    broken = GapRecord(0, 0, 1, "x", pending_state=lambda: 1 / 0).settled()
    assert broken.state == "" and broken.lost_calls == 1
