"""Recorder: records every call with its nested calls, changes nothing, survives its own failures."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
import torch
from conftest import kill_a_second_after_its_mark

from kvreplay.families.sglang.swa import SWAPool
from kvreplay.families.sglang.token import TokenPool
from kvreplay.recorder.capture import native_available
from kvreplay.recorder.recording import record
from kvreplay.replay.dispatch import replay
from kvreplay.trace.format import CALL_COLUMNS
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model


@pytest.fixture(autouse=True, params=["native", "python"])
def backend(request, monkeypatch):
    """Every recorder test runs on both capture engines."""
    if request.param == "native" and not native_available():
        pytest.skip("native capture not built")
    monkeypatch.setenv("KVREPLAY_RECORDER", request.param)
    return request.param


def t(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def _state(pool: SWAPool) -> list[torch.Tensor]:
    return [
        pool.full_to_swa_index_mapping.clone(),
        pool.full_attn_allocator.get_all_free_pages().clone(),
        pool.swa_attn_allocator.get_all_free_pages().clone(),
    ]


def test_recording_never_changes_what_the_pool_does(tmp_path):
    cfg = SynthConfig(scenario="disagg-mtp", out=tmp_path / "unused", requests=60, full_size=512, swa_size=256)
    plain = SWAPool(512, 256, 4, need_sort=True)
    stats_plain = run_model(plain, cfg, SCENARIOS["disagg-mtp"])
    recorded = SWAPool(512, 256, 4, need_sort=True)
    rec = record(recorded, tmp_path / "t.parquet")
    stats_rec = run_model(recorded, cfg, SCENARIOS["disagg-mtp"])
    rec.close()
    assert stats_plain == stats_rec
    for a, b in zip(_state(plain), _state(recorded), strict=True):
        assert torch.equal(a, b)
    assert "free" not in vars(recorded) and "alloc_extend" not in vars(recorded.full_attn_allocator)


def test_nested_calls_are_recorded_under_their_parent(tmp_path):
    pool = SWAPool(64, 32, 4, need_sort=False)
    with record(pool, tmp_path / "t.parquet"):
        row = pool.alloc_extend(t(0), t(0), t(6), t(6), t(-1), 6)
        pool.free(row)
    calls = list(TraceReader(tmp_path / "t.parquet").calls())
    top = [c for c in calls if c.depth == 0]
    assert [c.method for c in top] == ["alloc_extend", "free"]
    nested = [c for c in calls if c.depth == 1]
    assert {(c.target, c.method) for c in nested if c.parent == top[0].seq} == {
        ("full", "alloc_extend"), ("swa", "alloc_extend")
    }
    assert {(c.target, c.method) for c in nested if c.parent == top[1].seq} == {("swa", "free"), ("full", "free")}
    assert [c.seq for c in calls] == sorted(c.seq for c in calls)
    assert torch.equal(top[0].result, row)
    assert top[1].counters == {"available": 32, "full_available": 64, "swa_available": 32}


def test_exceptions_are_reraised_unchanged_and_recorded(tmp_path):
    pool = SWAPool(64, 32, 4, need_sort=False)
    rec = record(pool, tmp_path / "t.parquet")
    with pytest.raises(AssertionError) as e:
        pool.alloc_extend_swa_tail(t(0), t(0), t(4), t(4), t(-1), 4, 9)
    rec.close()
    (call,) = TraceReader(tmp_path / "t.parquet").calls()
    assert call.exc_type == "AssertionError" and call.exc_msg == str(e.value) and call.result is None


def test_recorded_values_are_those_at_call_time(tmp_path):
    pool = SWAPool(64, 32, 4, need_sort=False)
    with record(pool, tmp_path / "t.parquet"):
        row = pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)
        arg = row.clone()
        pool.free(arg)
        arg.fill_(0)  # the caller scribbles over its tensor afterwards
        row.fill_(0)
    calls = [c for c in TraceReader(tmp_path / "t.parquet").calls() if c.depth == 0]
    assert calls[0].result.tolist() == [4, 5, 6, 7]
    assert calls[1].args["free_index"].tolist() == [4, 5, 6, 7]


def test_a_failing_recorder_disables_itself_and_the_program_goes_on(tmp_path, caplog, monkeypatch):
    from kvreplay.recorder.writer_process import ProcessTraceWriter

    pool = SWAPool(64, 32, 4, need_sort=False)
    rec = record(pool, tmp_path / "t.parquet", rows_per_batch=1)

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ProcessTraceWriter, "offer", broken)
    first = pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)
    second = pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)
    assert first.tolist() == [4, 5, 6, 7] and second.tolist() == [8, 9, 10, 11]
    assert sum("recording disabled" in r.message for r in caplog.records) == 1
    monkeypatch.undo()
    rec.close()


def test_both_capture_engines_write_identical_rows(tmp_path, backend):
    if not native_available():
        pytest.skip("native capture not built")
    cfg = SynthConfig(scenario="disagg-mtp", out=tmp_path / "unused", requests=40, full_size=512, swa_size=256)
    tables = []
    for engine in ("native", "python"):
        pool = SWAPool(512, 256, 4, need_sort=True)
        # no flush by age: batches end at the same calls in both, so counter reads fold alike
        rec = record(pool, tmp_path / f"{engine}.parquet", backend=engine, rows_per_batch=97, flush_s=0)
        assert rec.backend == engine
        run_model(pool, cfg, SCENARIOS["disagg-mtp"])
        rec.close()
        tables.append(pq.read_table(tmp_path / f"{engine}.parquet", columns=CALL_COLUMNS))
    assert tables[0].num_rows > 500
    # (the SWA pool's groups open on its full side; their ends release pages, so stay rows)
    assert set(tables[0].column("folded_group_bounds_targets").drop_null().to_pylist()) == {"full"}
    assert tables[0].equals(tables[1])


@pytest.mark.slow_cases("python", "native")
def test_interpreter_exit_flushes_an_open_recording(tmp_path):
    path = tmp_path / "t.parquet"
    script = textwrap.dedent(
        f"""
        import torch
        from kvreplay.recorder.recording import record
        from kvreplay.families.sglang.paged import PagedPool
        pool = PagedPool(64, 4)
        record(pool, {str(path)!r})
        for _ in range(5):
            pool.free(pool.alloc(8))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    calls = list(TraceReader(path).calls(top_level_only=True))
    assert [c.method for c in calls] == ["alloc", "free"] * 5


@pytest.mark.slow
@pytest.mark.parametrize("then", ["busy", "idle"])
def test_sigkill_loses_no_call_older_than_a_second(tmp_path, backend, then):
    """kill -9 of a recording process, busy to the end or idle: every call that
    finished more than a second before the kill is in the trace, and it replays clean.
    (The kill comes 1.05 s after the test reads the mark. Once, about one run in forty
    lost its last few calls here: the sender left a frame's tail in its pipe's
    user-space buffer, and now flushes each frame.)"""
    path = tmp_path / "t.parquet"
    script = textwrap.dedent(
        f"""
        import time
        from kvreplay.recorder.recording import record
        from kvreplay.families.sglang.paged import PagedPool
        pool = PagedPool(64, 4)
        record(pool, {str(path)!r})  # default batch (4,096 rows): only time flushes this workload
        time.sleep(1.0)  # the writer process starting up (a server's start-up, not its steady state)
        n = 0
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            pool.free(pool.alloc(8))
            n += 1
        print(n, flush=True)  # n pairs done: from now on, all of them are a second old in a second
        while {then == "busy"}:
            pool.free(pool.alloc(8))
        time.sleep(600)
        """
    )
    done = kill_a_second_after_its_mark(script, wait_for=path)
    calls = list(TraceReader(path).calls(top_level_only=True))
    assert done > 100 and len(calls) >= 2 * done, (done, len(calls))
    assert [c.method for c in calls[: 2 * done]] == ["alloc", "free"] * done
    report = replay(path, "builtin:paged", device="cpu")
    assert not report.violations and not report.divergences


@pytest.mark.slow_cases("python", "native")
def test_sigkill_keeps_a_small_last_batch(tmp_path):
    """The idle flusher's last batch is a few calls, a frame of a few hundred bytes:
    it must reach the writer process, not wait in the sender's pipe buffer for a next
    frame that never comes (it did, and a kill lost those calls every time)."""
    path = tmp_path / "t.parquet"
    script = textwrap.dedent(
        f"""
        import time
        from kvreplay.recorder.recording import record
        from kvreplay.families.sglang.paged import PagedPool
        pool = PagedPool(64, 4)
        record(pool, {str(path)!r})
        time.sleep(1.0)  # the writer process starting up
        for _ in range(500):
            pool.free(pool.alloc(8))
        time.sleep(0.3)  # the idle flusher sends those
        for _ in range(5):
            pool.free(pool.alloc(8))
        print(505, flush=True)
        time.sleep(600)
        """
    )
    done = kill_a_second_after_its_mark(script, wait_for=path)
    calls = list(TraceReader(path).calls(top_level_only=True))
    assert len(calls) == 2 * done


class EchoPool(TokenPool):
    """A token pool whose alloc hands back the value it was given."""

    def alloc(self, *values, **named):  # type: ignore[override]
        return values[-1] if values else named.get("v")


ODD_VALUES = [
    torch.arange(200),  # past the small-tensor copy
    torch.arange(12).reshape(3, 4)[:, 1],  # not contiguous
    torch.tensor([1, 255], dtype=torch.uint8),
    torch.tensor([-3, 4], dtype=torch.int16),
    torch.tensor([-1, 1], dtype=torch.int8),
    torch.arange(6, dtype=torch.int32).reshape(1, 2, 3),
]


def test_every_value_kind_is_recorded_as_it_was(tmp_path):
    from test_trace_format import VALUES, _same

    pool = EchoPool(64)
    rec = record(pool, tmp_path / "t.parquet")
    values = [*VALUES, *ODD_VALUES]
    for v in values:
        pool.alloc(v)
    pool.alloc(*values)
    pool.alloc(v=values[-1])
    pool.alloc(2**70)  # beyond int64: kept as text, not lost silently
    pool.alloc(torch.tensor([0.5]))
    rec.close()
    calls = list(TraceReader(tmp_path / "t.parquet").calls())
    for v, c in zip(values, calls, strict=False):
        assert _same(v, c.args["arg0"]) and _same(v, c.result), (v, c.args, c.result)
    spread = calls[len(values)]
    assert all(_same(v, spread.args[f"arg{i}"]) for i, v in enumerate(values))
    assert _same(values[-1], calls[len(values) + 1].args["v"])
    assert calls[-2].has_opaque and "1180591620717411303424" in calls[-2].args["arg0"].text
    assert calls[-1].has_opaque and "torch.float32" in calls[-1].args["arg0"].text


def test_the_native_capture_engine_is_built_and_is_the_default(backend):
    # An install without a C compiler falls back to the Python engine silently; the
    # project's own CI must not, or the recorder's overhead figures would not hold.
    assert native_available(), "kvreplay.recorder._capture was not built (is gcc installed?)"
    from kvreplay.recorder.capture import default_backend

    assert default_backend() == backend


def test_device_copies_are_collected_by_the_writer_and_hold_the_value_at_call_time(tmp_path, monkeypatch):
    """The path CUDA tensors take (a copy the writer waits for, never the caller),
    forced on for CPU tensors that go through the encoder: same rows as copying on
    the spot, and a tensor changed after the call is recorded as it was."""
    from kvreplay.recorder import py_buffers as row_batch

    values = [torch.arange(12).reshape(3, 4)[:, 1], torch.arange(40)[::3], torch.tensor([[1, 2], [3, 4]])[:, 0],
              [(torch.arange(12)[::2], 3), (torch.arange(5, dtype=torch.int32), 9)]]  # segments, as free_segments
    made = []
    real_init = row_batch.DeviceCopy.__init__

    def counted(self, t, *kind):
        made.append(1)
        real_init(self, t, *kind)

    monkeypatch.setattr(row_batch.DeviceCopy, "__init__", counted)
    tables = []
    for defer in (False, True):
        monkeypatch.setattr(row_batch, "DEFER_ALL", defer)
        pool = EchoPool(64)
        rec = record(pool, tmp_path / f"{defer}.parquet", rows_per_batch=2)
        native = rec.backend == "native"  # the Python engine copies every CPU tensor inline
        for v in values:
            pool.alloc(v.clone()[::1] if isinstance(v, torch.Tensor) and v.is_contiguous() else v)
        changing = torch.arange(20)[::2].clone()[::1]
        strided = torch.zeros(20, dtype=torch.int64)[::2]
        strided.copy_(changing)
        pool.alloc(strided)
        strided.fill_(-7)  # after the call: the trace keeps what the call saw
        rec.close()
        tables.append(pq.read_table(tmp_path / f"{defer}.parquet", columns=CALL_COLUMNS))
        got = list(TraceReader(tmp_path / f"{defer}.parquet").calls())
        assert got[-1].result.tolist() == list(range(0, 20, 2))
    assert tables[0].equals(tables[1])
    # the segment list (argument and echoed result) takes the encoder in both engines, strided tensors in C only
    assert len(made) == (10 if native else 2)


def test_torchs_c_shim_reads_tensors_as_python_does(tmp_path, backend):
    """The native engine reads tensors through torch's C shim when it can verify it;
    the rows must be those of the Python reads, for every kind of tensor it meets."""
    if backend != "native":
        pytest.skip("only the native engine uses the shim")
    from test_trace_format import VALUES

    from kvreplay.recorder import _capture, capture, tensor_shim

    if sys.platform == "linux":  # where the wheels put libtorch_cpu.so: it must be found and pass
        assert capture.TENSOR_SHIM
    values = [*VALUES, *ODD_VALUES, torch.arange(10)[:0], torch.tensor(5), torch.zeros(2, 0, dtype=torch.int32),
              torch.arange(24).reshape(2, 3, 4).transpose(0, 2), [(torch.arange(4).reshape(2, 2).t(), 1)]]
    tables = []
    try:
        for shim in (True, False):
            if not shim:
                tensor_shim.uninstall(_capture)
            pool = EchoPool(64)
            rec = record(pool, tmp_path / f"{shim}.parquet")
            for v in values:
                pool.alloc(v)
            rec.close()
            tables.append(pq.read_table(tmp_path / f"{shim}.parquet", columns=CALL_COLUMNS))
    finally:
        capture.TENSOR_SHIM = tensor_shim.install(_capture)
    assert tables[0].num_rows == len(values)
    assert tables[0].equals(tables[1])


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_counters_every_n_reads_the_pool_after_every_nth_call_and_replays_clean(tmp_path, backend):
    """counters_every=4: the pool's counters are read after every 4th state-changing
    top-level call outside a free group (the others carry none), the same in both
    engines, and the trace replays clean. (Without folds: where a batch ends moves with
    time, and with it which calls fold into rows.)"""
    cfg = SynthConfig(scenario="disagg-mtp", out=tmp_path / "unused", requests=40, full_size=512, swa_size=256)
    got = {}
    for every in (1, 4):
        pool = SWAPool(512, 256, 4, need_sort=True)
        path = tmp_path / f"every{every}.parquet"
        rec = record(pool, path, counters_every=every, fold_reads=False)
        run_model(pool, cfg, SCENARIOS["disagg-mtp"])
        rec.close()
        got[every] = pq.read_table(path, columns=["seq", "depth", "method", "available"]).to_pylist()
        report = replay(path, "builtin:swa", device="cpu")
        assert report.status == "clean", (report.first_violation, report.first_divergence)
    full = [r for r in got[1] if r["available"] is not None]  # the calls whose counters are read at all
    sampled = [r["seq"] for r in got[4] if r["available"] is not None]
    assert len(full) > 100 and sampled == [r["seq"] for r in full[3::4]]
    by_seq = {r["seq"]: r["available"] for r in full}
    assert all(r["available"] == by_seq[r["seq"]] for r in got[4] if r["available"] is not None)


def test_both_engines_write_a_vllm_wires_strings_and_id_tuples_alike(tmp_path, backend):
    """The native engine puts strings and int tuples itself (a vLLM wire sends them on
    every call); the rows are the Python encoder's, kind for kind."""
    if not native_available():
        pytest.skip("native capture not built")
    from kvreplay.workload.synth import make_pool

    cfg = SynthConfig(scenario="vllm-prefix", out=tmp_path / "unused", requests=30)
    tables = []
    for engine in ("native", "python"):
        pool, _ = make_pool(cfg, SCENARIOS["vllm-prefix"])
        rec = record(pool, tmp_path / f"{engine}.parquet", backend=engine, rows_per_batch=97, flush_s=0)
        run_model(pool, cfg, SCENARIOS["vllm-prefix"])
        rec.close()
        tables.append(pq.read_table(tmp_path / f"{engine}.parquet", columns=CALL_COLUMNS))
    kinds = {a["kind"] for row in tables[0].column("args").to_pylist() for a in row}
    assert {"str", "ints"} <= kinds and tables[0].num_rows > 300
    assert tables[0].equals(tables[1])


@pytest.mark.gpu
def test_a_pool_on_cuda_is_recorded_off_the_callers_stream_and_replays_on_cuda(tmp_path):
    """The device path for real: index tensors on CUDA are copied off the device by the
    writer (never a sync on the caller's thread), and the trace replays strict-clean on
    CUDA and on CPU alike, with the same calls as a CPU recording of the same program."""
    calls = {}
    for device in ("cuda", "cpu"):
        cfg = SynthConfig(scenario="disagg-mtp", out=tmp_path / "unused", requests=40, full_size=512, swa_size=256,
                          device=device)
        pool = SWAPool(512, 256, 4, device=device, need_sort=True)
        rec = record(pool, tmp_path / f"{device}.parquet")
        run_model(pool, cfg, SCENARIOS["disagg-mtp"])
        rec.close()
        calls[device] = [(c.method, repr(c.result.tolist() if hasattr(c.result, "tolist") else c.result))
                         for c in TraceReader(tmp_path / f"{device}.parquet").calls()]
    assert calls["cuda"] == calls["cpu"] and len(calls["cpu"]) > 200
    for device in ("cuda", "cpu"):
        report = replay(tmp_path / "cuda.parquet", "builtin:swa", device=device)
        assert report.status == "clean" and report.device.startswith(device), report.status
