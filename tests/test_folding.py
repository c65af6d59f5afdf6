"""Folded counter reads: a scheduler's repeated reads cost no rows, and a trace recorded
that way replays with the same findings, call for call, as one recorded read by read."""

from __future__ import annotations

from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from unfolded import unfolded

from kvreplay.families.sglang.swa import SWAPool
from kvreplay.families.sglang.vocabulary import COUNTER_READS
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


@pytest.mark.slow  # both engines' cases: the fast tier holds the README's three minutes
@pytest.mark.parametrize("engine", ENGINES)
def test_folded_and_unfolded_recordings_replay_alike_call_for_call(tmp_path, engine):
    plain, folded = tmp_path / "plain.parquet", tmp_path / "folded.parquet"
    _recorded(plain, engine, fold=False)
    _recorded(folded, engine, fold=True)
    # the same calls, with the same numbers and answers...
    assert unfolded(plain) == unfolded(folded)
    a, b = summarize(plain), summarize(folded)
    assert a.calls == b.calls and a.calls_per_method == b.calls_per_method and a.folded_reads == 0
    # every group the model freed nothing in folds, with its sub-allocators' pairs (a batch
    # may start between the two, and one fold's row may hold a group already: almost every)
    top = [c.method for c in TraceReader(plain).calls(top_level_only=True)]
    pairs = zip(top, top[1:], strict=False)
    empty = sum(1 for m, n in pairs if (m, n) == ("free_group_begin", "free_group_end"))
    assert empty >= 10 and empty - 2 <= b.folded_groups <= empty and a.folded_groups == 0
    assert set(pq.read_table(folded, columns=["folded_group_targets"]).column(0).drop_null().to_pylist()) \
        == {"full"}  # sglang's SWA pool opens a group on its full side only
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


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.slow_cases("1")
def test_an_older_trace_reads_as_one_without_the_folds_it_predates(tmp_path, version):
    path = tmp_path / "t.parquet"
    _recorded(path, ENGINES[-1], fold=False)
    table = pq.read_table(path)
    added = [c for c, since in trace_format.ADDED_COLUMNS.items() if since > version]
    old = table.drop_columns(added)
    md = dict(table.schema.metadata)
    md[b"kvreplay.schema_version"] = str(version).encode()
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


def _grouped(path, engine: str, program) -> list:
    from kvreplay.families.sglang.paged import PagedPool

    pool = PagedPool(256, 4)
    rec = record(pool, path, backend=engine)
    program(pool)
    rec.close()
    return pq.read_table(path, columns=["method", "depth", "folded_reads", "folded_group_at",
                                        "folded_group_bounds"]).to_pylist()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_groups_bounds_fold_into_its_calls_and_an_empty_group_into_the_row_before(tmp_path, engine):
    """An empty pair folds (one per row, after the reads before it); a group that holds
    calls folds its begin into its first call and its end into its last; a second empty
    pair on a row stays rows."""
    def program(pool):
        held = pool.alloc(16)
        pool.available_size()
        pool.free_group_begin()  # empty: folds after the one read
        pool.free_group_end()
        pool.available_size()
        pool.free_group_begin()  # a second empty pair on the same row: rows
        pool.free_group_end()
        pool.free_group_begin()  # a free in it: both bounds fold into the free's row
        pool.free(held[:4])
        pool.free_group_end()
        pool.free_group_begin()  # two frees: the begin folds into the first, the end into the second
        pool.free(held[4:8])
        pool.free(held[8:12])
        pool.free_group_end()
        pool.free_group_begin()  # a read in it (news: a group's begin reads no counters) is a call like any
        pool.available_size()
        pool.free_group_end()

    rows = _grouped(tmp_path / "t.parquet", engine, program)
    methods = [r["method"] for r in rows]
    assert methods[0] == "alloc" and rows[0]["folded_group_at"] == 1 and rows[0]["folded_reads"] == 2
    assert [(m, r["folded_group_bounds"]) for m, r in zip(methods[1:], rows[1:], strict=True)] == [
        ("free_group_begin", None), ("free_group_end", None), ("free", 3), ("free", 1), ("free", 2),
        ("available_size", 3)]
    calls = [(c.method, c.from_fold) for c in TraceReader(tmp_path / "t.parquet").calls()]
    assert calls[:5] == [("alloc", False), ("available_size", True), ("free_group_begin", True),
                         ("free_group_end", True), ("available_size", True)]
    assert calls[7:14] == [("free_group_begin", True), ("free", False), ("free_group_end", True),
                           ("free_group_begin", True), ("free", False), ("free", False), ("free_group_end", True)]
    assert [c.seq for c in TraceReader(tmp_path / "t.parquet").calls()] == list(range(17))
    s = summarize(tmp_path / "t.parquet")
    assert s.calls == 17 and s.folded_bounds == 6 and s.calls_per_method["free_group_end"] == 5
    assert replay(tmp_path / "t.parquet", "builtin:paged", device="cpu").status == "clean"


def test_a_build_that_changes_its_state_in_an_empty_group_diverges_at_the_next_read(tmp_path):
    """The folded group's end carries no counters (none were read); a build whose empty
    group changes the pool is caught by the read after it."""
    from kvreplay.families.sglang.paged import PagedPool

    path = tmp_path / "t.parquet"
    pool = PagedPool(256, 4)
    rec = record(pool, path)
    pool.alloc(8)
    pool.free_group_begin()
    pool.free_group_end()
    pool.available_size()
    rec.close()
    assert summarize(path).folded_groups == 1

    class Leaky(PagedPool):
        def free_group_end(self):
            super().free_group_end()
            self.alloc(4)

    import sys
    sys.modules[__name__].Leaky = Leaky
    got = replay(path, f"py:{__name__}:Leaky", device="cpu")
    # the checker sees the allocation nobody holds; the read after the group differs
    assert got.status == "violation" and got.first_divergence.method == "available_size"


@pytest.mark.parametrize("at, targets, hint", [
    (5, "", "more reads than the row folds"),
    (-3, "", "negative number"),
    (0, "full,nowhere", "names sub-allocators"),
    (0, "full,swa,full,swa", "names sub-allocators"),
    (0, None, "names sub-allocators"),
])
def test_a_damaged_folded_group_is_a_one_line_trace_error(tmp_path, at, targets, hint):
    from kvreplay.errors import TraceFormatError

    path = tmp_path / "t.parquet"
    _recorded(path, ENGINES[-1], fold=True)
    table = pq.read_table(path)
    g = table.column("folded_group_at").to_pylist()
    row = next(i for i, v in enumerate(g) if v is not None)
    g[row] = at
    t = table.column("folded_group_targets").to_pylist()
    t[row] = targets
    n = table.column("folded_reads").to_pylist()
    n[row] = 0
    table = table.set_column(table.schema.get_field_index("folded_group_at"), "folded_group_at",
                             pa.array(g, pa.int32()))
    table = table.set_column(table.schema.get_field_index("folded_group_targets"), "folded_group_targets",
                             pa.array(t, pa.string()))
    table = table.set_column(table.schema.get_field_index("folded_reads"), "folded_reads", pa.array(n, pa.int64()))
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    with pytest.raises(TraceFormatError, match=hint):
        TraceReader(bad).check_calls()


@pytest.mark.parametrize("bounds, targets, method, hint", [
    (4, "", None, "not 1 \\(begin\\), 2 \\(end\\) or 3"),
    (-1, "", None, "not 1 \\(begin\\), 2 \\(end\\) or 3"),
    (3, "nowhere", None, "names sub-allocators"),
    (3, None, None, "names sub-allocators"),
    (1, "", "free_group_end", "folds another group's bounds"),
])
def test_damaged_folded_group_bounds_are_a_one_line_trace_error(tmp_path, bounds, targets, method, hint):
    from kvreplay.errors import TraceFormatError

    def program(pool):
        held = pool.alloc(8)
        pool.free_group_begin()
        pool.free(held)
        pool.free_group_end()

    _grouped(tmp_path / "t.parquet", ENGINES[-1], program)
    table = pq.read_table(tmp_path / "t.parquet")
    row = table.column("folded_group_bounds").to_pylist().index(3)
    for name, value, kind in (("folded_group_bounds", bounds, pa.int32()),
                              ("folded_group_bounds_targets", targets, pa.string()),
                              ("method", method, pa.string())):
        if name == "method" and value is None:
            continue
        col = table.column(name).to_pylist()
        col[row] = value
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(col, kind))
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    with pytest.raises(TraceFormatError, match=hint):
        TraceReader(bad).check_calls()


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_plain_sql_counts_a_folded_traces_calls_as_the_format_page_says(tmp_path):
    """docs/trace-format.md's count of calls, run by duckdb on the file alone, agrees
    with kvreplay's reader on a trace whose rows fold reads, empty groups and bounds."""
    import duckdb

    path = tmp_path / "t.parquet"
    _recorded(path, ENGINES[-1], fold=True)
    s = summarize(path)
    assert s.folded_reads and s.folded_groups and s.folded_bounds
    (n,) = duckdb.connect().execute(
        "select count(*) + sum(coalesce(folded_reads, 0)) + 2 * count(folded_group_at) "
        "+ sum(coalesce(folded_group_bounds, 0) & 1) + sum(coalesce(folded_group_bounds, 0) >> 1) "
        f"from read_parquet('{path}') where depth = 0").fetchone()
    assert n == s.calls == len(list(TraceReader(path).calls(top_level_only=True)))
