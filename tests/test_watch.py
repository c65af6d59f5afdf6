"""``kvreplay record --watch``: the invariant checker runs on the calls as the writer
writes them, the violation is printed within a second of its call, a reproducer is
left beside the trace, the counters are served on /metrics; and a writer that stalls
never slows the recorded program."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from servers import pids

from kvreplay.recorder.switches import FINDINGS_FILE, WATCH_ENV
from kvreplay.replay.dispatch import replay
from kvreplay.trace.reader import TraceReader

PROG = """
import sys, time
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.families.sglang.variants import StaleTailSWAPool
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model
cls = StaleTailSWAPool if sys.argv[1] == "buggy" else SWAPool
cfg = SynthConfig(scenario="disagg-mtp", out="unused.parquet", requests=int(sys.argv[2]), full_size=4096,
                  swa_size=2048)
pool = cls(4096, 2048, 16, need_sort=True)
time.sleep(3)  # a server loads its model after its pool: the watch starts meanwhile
run_model(pool, cfg, SCENARIOS["disagg-mtp"])
for _ in range(int(float(sys.argv[3]) * 10)):  # an idle server still polls its counters
    pool.full_available_size(); pool.swa_available_size()
    time.sleep(0.1)
"""


def _record(tmp_path: Path, kind: str, requests: int, idle_s: float, *extra: str, **kw) -> subprocess.Popen:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROG))
    return subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(tmp_path / "out"),
                             "--class", "kvreplay.families.sglang.swa:SWAPool", *extra, "--", sys.executable, str(prog),
                             kind, str(requests), str(idle_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.quiet  # (the live tier runs the same on a real server)
def test_a_watched_buggy_pool_is_named_at_its_call_within_a_second_with_a_reproducer(tmp_path):
    # The second is the watch's promise on a machine with a core to spare, so this runs in
    # the quiet tier: in the slow tier, two tests at once beside the soak's server on two
    # cores, CI saw findings 1.29 s and more after their calls (2026-12-07, twice in a row).
    late = _watched_buggy_run(tmp_path / "run")
    assert not late, late


def _watched_buggy_run(tmp_path: Path) -> list[dict]:
    """One recorded buggy program under the watch, held to everything but the second:
    the findings that came a second or more after their call."""
    tmp_path.mkdir()
    port = _free_port()
    proc = _record(tmp_path, "buggy", 300, 3, "--watch", "--metrics-port", str(port), "--minimize-s", "3",
                   "--json")
    metrics = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "kvreplay_violations_total{" not in metrics:
        time.sleep(0.3)
        try:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            pass
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err  # the program exited 0; its pool broke the rules
    # /metrics answered while the program ran, in Prometheus's text format
    assert "# TYPE kvreplay_calls_recorded_total counter" in metrics
    assert 'kvreplay_violations_total{trace="kvreplay-' in metrics and 'rule="swa-mapping/' in metrics
    res = json.loads(out)
    (trace,) = res["traces"]
    offline = replay(trace, "py:kvreplay.families.sglang.variants:StaleTailSWAPool", device="cpu")
    firsts = {}
    for v in offline.violations:
        firsts.setdefault(f"{v.invariant}/{v.rule}", v)
    seen = [f for f in res["findings"] if f["kind"] == "violation"]
    # the first of each rule, at the call an offline replay names
    assert {f["rule"]: (f["call"], f["method"]) for f in seen} == {r: (v.call, v.method) for r, v in firsts.items()}
    # a reproducer beside the trace for each, which fails there on the class that recorded it
    assert [r["rule"] for r in res["reproducers"]] == [f["rule"] for f in seen]
    first = res["reproducers"][0]
    assert Path(first["reproducer"]).parent == Path(trace).parent and first["calls"] < first["from_calls"]
    again = replay(first["reproducer"], first["build"], device="cpu")
    assert first["rule"] in {f"{v.invariant}/{v.rule}" for v in again.violations}
    # printed within a second of the call that broke the rule
    ends = {c_number: c.t_end_ns for c_number, c in _numbered(trace)}
    return [f for f in seen if f["t"] - ends[f["call"]] / 1e9 >= 1.0]


def _numbered(trace: str):
    return [(tc.number, tc.call) for tc in TraceReader(trace).top_calls() if tc.number]


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_watched_correct_pool_prints_nothing_and_exits_as_its_program(tmp_path):
    proc = _record(tmp_path, "clean", 150, 0, "--watch")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "kvreplay watch" not in err
    assert not (tmp_path / "out" / FINDINGS_FILE).exists() or not (tmp_path / "out" / FINDINGS_FILE).read_text()
    (metrics,) = (tmp_path / "out").glob(".kvreplay-metrics-*.json")
    doc = json.loads(metrics.read_text())
    assert doc["violations"] == {} and doc["unchecked"] == 0 and doc["checked"] == doc["calls"] > 1000


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_the_watch_carries_its_state_across_parts(tmp_path):
    """Rotated every 1,000 rows (a part ends with a batch: 4,096 rows or 0.1 s): the
    watch checks the recording as one, so it names the same calls an offline replay of
    the whole directory names, and the part that holds a violation names it alone."""
    proc = _record(tmp_path, "buggy", 600, 0, "--watch", "--part-rows", "1000", "--minimize-s", "0", "--json")
    out, err = proc.communicate(timeout=300)
    res = json.loads(out)
    (trace,) = res["traces"]
    reader = TraceReader(trace)
    assert proc.returncode == 1 and len(reader.parts) > 3, err
    build = "py:kvreplay.families.sglang.variants:StaleTailSWAPool"
    firsts = {}
    for v in replay(trace, build, device="cpu").violations:
        firsts.setdefault(f"{v.invariant}/{v.rule}", v)
    seen = {f["rule"]: (f["call"], f["method"]) for f in res["findings"] if f["kind"] == "violation"}
    assert seen == {r: (v.call, v.method) for r, v in firsts.items()}
    # The part that holds a violation's call names it on its own, numbered from the part's first call.
    rule, (call, _) = next(iter(seen.items()))
    for part in reader.parts:
        first = TraceReader(part).meta.extra.get("part", {}).get("first_call", 1)
        n = TraceReader(part).count_calls()
        if first <= call < first + n:
            alone = replay(part, build, device="cpu")
            assert any(f"{v.invariant}/{v.rule}" == rule and v.call == call - first + 1 for v in alone.violations)
            break
    else:
        pytest.fail(f"no part holds call #{call}")


@pytest.mark.slow
def test_a_clean_pool_watched_across_retired_parts_stays_clean(tmp_path):
    proc = _record(tmp_path, "clean", 600, 0, "--watch", "--part-rows", "1000", "--keep-parts", "2", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    (trace,) = json.loads(out)["traces"]
    (metrics,) = (tmp_path / "out").glob(".kvreplay-metrics-*.json")
    doc = json.loads(metrics.read_text())
    assert doc["violations"] == {} and doc["parts_retired"] > 0 and doc["parts"] == 2
    assert doc["writer_rss_bytes"] > 0
    reader = TraceReader(trace)
    assert len(reader.parts) == 2 and reader.parts[0].name != "part-000000.parquet"
    assert replay(trace, "builtin:swa", device="cpu").status == "clean"


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_stop_on_violation_ends_the_program_at_the_first_violation(tmp_path):
    proc = _record(tmp_path, "buggy", 300, 600, "--watch", "--stop-on-violation", "--minimize-s", "0", "--json")
    out, err = proc.communicate(timeout=120)  # 600 s of polling would outlast this: the watch stopped it
    res = json.loads(out)
    assert proc.returncode == 1 and res["stopped_on"]["rule"] == "swa-mapping/released-page-keeps-peer"
    assert res["traces"] and not res["reproducers"]


def test_stop_on_violation_needs_watch(cli, tmp_path):
    res = cli("record", "--out", str(tmp_path), "--stop-on-violation", "--", "true")
    assert res.returncode == 2 and "needs --watch" in res.stderr


def _writer_of(trace_dir: Path) -> int:
    (pid,) = pids("cmdline", b"kvreplay.jobs.watch", str(trace_dir).encode())
    return pid


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the writer in /proc")
def test_a_stalled_writer_never_slows_the_program_and_the_watch_counts_what_it_lost(tmp_path, monkeypatch):
    """SIGSTOP the writer for seconds: the recorded calls take no longer, the queue to
    the writer stays bounded, the lost calls are a gap in the trace, and the watch
    (which goes on from the gap's snapshot) counts them as unchecked."""
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.recorder.recording import record

    monkeypatch.setenv(WATCH_ENV, "check")
    path = tmp_path / "t.parquet"
    pool = SWAPool(4096, 2048, 16, need_sort=True)
    rec = record(pool, path, max_queued_rows=8192, rows_per_batch=512)

    def burst(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            pool.free(pool.alloc_extend(*_one_page()))
            times.append(time.perf_counter() - t0)
        return times

    before = burst(3000)
    writer = _writer_of(tmp_path)
    os.kill(writer, signal.SIGSTOP)
    queued = []
    try:
        stalled = []
        for _ in range(12):  # far more rows than the pipe and the queue hold
            stalled += burst(1000)
            queued.append(rec._writer._queued_rows)
    finally:
        os.kill(writer, signal.SIGCONT)
    after = burst(3000)
    rec.close()
    assert max(queued) <= 8192 + 512
    assert rec.lost_calls > 0
    # the program's calls did not wait for the stopped writer (medians: this machine is shared)
    med = sorted(before)[len(before) // 2]
    assert sorted(stalled)[len(stalled) // 2] < 3 * med + 20e-6, (med, sorted(stalled)[len(stalled) // 2])
    assert len(after) == 3000
    gaps = TraceReader(path).gaps()
    assert gaps and sum(g.args["lost_calls"] for g in gaps) == rec.lost_calls
    (metrics,) = tmp_path.glob(".kvreplay-metrics-*.json")
    doc = json.loads(metrics.read_text())
    assert doc["dropped"] == rec.lost_calls and doc["unchecked"] >= rec.lost_calls
    assert doc["watching"] and doc["violations"] == {}  # it went on from the gap's snapshot


def _one_page():
    import torch

    def t(*v):
        return torch.tensor(v, dtype=torch.int64)
    return t(0), t(0), t(16), t(16), t(-1), 16


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_class_that_inherits_its_constructor_is_recorded_by_its_own_name(tmp_path):
    """``--class`` naming a bug variant (its constructor is its base's) records it."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROG).replace("time.sleep(3)", "pass"))
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(tmp_path / "out"),
                          "--class", "kvreplay.families.sglang.variants:StaleTailSWAPool", "--json", "--",
                          sys.executable, str(prog), "buggy", "20", "0"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (trace,) = json.loads(res.stdout)["traces"]
    assert TraceReader(trace).meta.pool_class == "kvreplay.families.sglang.variants:StaleTailSWAPool"


def test_the_watch_compares_a_vllm_managers_block_calls_with_their_ids(tmp_path):
    """The vLLM family's replay compares each manager call's block-pool calls, ids and
    all; the watch must decode them as that replay does (it once dropped their arguments
    and called every free a divergence)."""
    import pyarrow as pa

    from kvreplay.jobs.watch import Watcher
    from kvreplay.workload.synth import SynthConfig, synthesize

    trace = tmp_path / "v.parquet"
    synthesize(SynthConfig(scenario="vllm-prefix", out=trace, requests=60, block_tokens=16, full_size=4096))
    reader = TraceReader(trace)
    table = pa.Table.from_batches(list(reader.iter_batches()))
    depth = table.column("depth").to_pylist()
    w = Watcher(tmp_path / "watched.parquet", reader.meta)
    start = 0
    for i in range(1, len(depth)):  # tables as the writer gets them: whole top-level calls
        if depth[i] == 0 and i - start >= 200:
            w.feed(table.slice(start, i - start))
            start = i
    w.feed(table.slice(start))
    w.finish()
    assert w.status == "watching" and w.checked == reader.count_calls() > 500
    assert dict(w.divergences) == {} and dict(w.violations) == {}
