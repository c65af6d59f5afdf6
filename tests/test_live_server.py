"""The live tier: a real sglang server on CPU, recorded under ``kvreplay record``,
driven with the Mooncake trace, stopped the ways servers stop, and replayed.

Run by scripts/sglang-tier.sh (marker ``live``) in the sglang venv. Each server is a
tiny Llama with random weights made here (scripts/tiny_model.py), served with token
ids in; on CPU sglang needs ``--device cpu --model-impl transformers``."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from servers import RecordedServer, finished_traces, pids, run_page_block, sitecustomize_patching

pytest.importorskip("sglang.srt.mem_cache.allocator.swa", reason="sglang not installed")

from kvreplay.replay.dispatch import replay  # noqa: E402
from kvreplay.trace.reader import TraceReader  # noqa: E402
from kvreplay.workload.drive import DriveConfig, drive  # noqa: E402
from kvreplay.workload.requests import load_requests  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.live]
ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT / "workloads" / "mooncake" / "synthetic_trace.jsonl"
START_S = float(os.environ.get("KVREPLAY_LIVE_START_S", "600"))  # a loaded 2-core machine took 3 minutes


def _tiny(out: Path, swa: int = 0) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from tiny_model import make
    finally:
        sys.path.pop(0)
    return make(out, swa)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {"llama": _tiny(base / "llama"), "swa": _tiny(base / "swa", swa=128)}


class Server(RecordedServer):
    """A recorded ``python -m sglang.launch_server`` of a tiny model on CPU."""

    def __init__(self, model: Path, out: Path, page_size: int, *extra: str, small: bool = True,
                 record_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        super().__init__(out, lambda port: [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--skip-tokenizer-init",
            "--device", "cpu", "--model-impl", "transformers", "--page-size", str(page_size),
            "--port", str(port), "--disable-cuda-graph", "--mem-fraction-static", "0.05",
            *(("--max-total-tokens", "65536") if small else ()), "--log-level", "warning", *extra],
            start_s=START_S, record_args=record_args, env=env)

    def drive(self, n: int, **kw) -> object:
        reqs = load_requests(MOONCAKE, count=n, seed=0, block_tokens=16, length_scale=kw.pop("length_scale", 0.03),
                             output_scale=kw.pop("output_scale", 0.5))
        return drive(DriveConfig(url=self.url, concurrency=kw.pop("concurrency", 16), **kw), reqs)

    def scheduler_pid(self) -> int:
        """The scheduler process (sglang names it ``sglang::scheduler``)."""
        found = (pids("cmdline", b"sglang::scheduler", under=self.proc.pid)
                 or pids("comm", b"sglang::scheduler", under=self.proc.pid))
        if not found:
            pytest.fail("no sglang::scheduler process found")
        return found[0]


# A page-16 server fed 300 requests is the recording page's block (its test, below, stops it
# with SIGTERM); this one is Ctrl-C on a token-by-token pool.
@pytest.mark.parametrize("page_size, builtin", [(1, "builtin:token")])
def test_ctrl_c_leaves_a_trace_per_allocator_that_replays_strict_clean(models, tmp_path, page_size, builtin):
    n = 300 if page_size == 16 else 80
    server = Server(models["llama"], tmp_path / "out", page_size, record_args=("--watch",))
    try:
        served = server.drive(n)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == n, served.error_kinds
    # watched, a correct pool: nothing to say, every call checked
    assert "kvreplay watch" not in server.tail() and not (tmp_path / "out" / "kvreplay-watch.jsonl").exists()
    (counters,) = (tmp_path / "out").glob(".kvreplay-metrics-*.json")
    doc = json.loads(counters.read_text())
    assert doc["violations"] == {} and doc["watching"] and doc["checked"] == doc["calls"] > doc["rows"]
    (trace,) = finished_traces(tmp_path / "out")
    meta = TraceReader(trace).meta
    assert meta.family == ("paged" if page_size > 1 else "token") and meta.ctor_args["dtype"] == "torch.bfloat16"
    for build in ("sglang", builtin):
        r = replay(trace, build, mode="strict", device="cpu")
        assert r.status == "clean", (build, r.first_divergence, r.first_violation)
        assert r.calls_replayed > n


def test_hybrid_swa_server_records_its_swa_allocator(models, tmp_path):
    # The full pool's default size: with a small one, sglang 0.5.23's CPU attention
    # indexes the SWA layer's cache with full-pool slots past the SWA pool's end and
    # the scheduler dies (IndexError), a bug above the allocator (its trace replays clean).
    server = Server(models["swa"], tmp_path / "out", 16, small=False)
    try:
        served = server.drive(120)
    finally:
        server.stop(signal.SIGTERM)
    assert served.ok == 120, served.error_kinds
    (trace,) = finished_traces(tmp_path / "out")
    assert TraceReader(trace).meta.family == "swa"
    for build in ("sglang", "builtin:swa"):
        r = replay(trace, build, mode="strict", device="cpu")
        assert r.status == "clean", (build, r.first_divergence, r.first_violation)


@pytest.mark.mamba
def test_the_state_pool_page_block_runs_as_written(tmp_path):
    """docs/mamba.md's block, as a reader runs it: a hybrid LFM2 served by sglang's own
    model code on CPU (its convolution in sglang's Triton kernel under the interpreter;
    without the extra buffer, which sglang allows on GPUs only, page size 1 and no
    overlap), 24 state slots for 8 rows, so the prefix cache's copies of prefilled states
    press on the pool; the state pool's trace replays strict-clean on sglang and the builtin."""
    from docs_commands import blocks

    text = (ROOT / "docs" / "mamba.md").read_text()
    (block,) = [b for b in blocks(text) if "kvreplay record --cpu-compat --out traces/live/mamba" in b]
    work = tmp_path / "work"
    (work / "traces").mkdir(parents=True)  # the reader's checkout has it
    ran = run_page_block(block, tmp_path, work, "30000", START_S + 600)
    for line, (rc, said) in ran.items():
        if not line.startswith("kill"):
            assert rc == 0, (line, rc, said)
    traces = {TraceReader(t).meta.family: t for t in finished_traces(work / "traces" / "live" / "mamba")}
    assert set(traces) == {"mamba", "token"} and traces["mamba"].name.endswith("-0.parquet"), traces
    args = TraceReader(traces["mamba"]).meta.ctor_args
    assert args["mamba_size"] == 24 and args["extra_buffer"] is False
    replays = [said for line, (_, said) in ran.items() if line.startswith("kvreplay replay")]
    assert len(replays) == 2 and all("clean" in out for out in replays), replays
    r = replay(traces["mamba"], "builtin:mamba", mode="strict", device="cpu")
    assert r.calls_replayed > 24 * 3  # a row and a state slot given and taken back per request, and the cache's


# The seed bug's setting, as far as CPU goes without speculation: a disaggregated decode
# server (the fake transfer backend stands in for the prefill side; its host KV backup for
# retraction kept in CPU tensors, as the default backup registers host memory with CUDA).
DISAGG_DECODE = ("--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
                 "--disaggregation-decode-retraction-backup", "cpu_tensor")


def test_disaggregated_decode_server_records_its_tail_preallocations(models, tmp_path):
    server = Server(models["swa"], tmp_path / "out", 16, *DISAGG_DECODE, small=False)
    try:
        served = server.drive(120, disagg_decode=True)
    finally:
        server.stop(signal.SIGTERM)
    assert served.ok == 120, served.error_kinds
    (trace,) = finished_traces(tmp_path / "out")
    reader = TraceReader(trace)
    assert reader.meta.family == "swa"
    calls = [c for c in reader.calls(top_level_only=True) if c.method == "alloc_extend_swa_tail"]
    assert len(calls) >= 120  # each request's prompt KV, preallocated as the transfer's target
    assert all(int(c.args["swa_tail_len"]) <= int(c.args["seq_lens"][0]) for c in calls)
    for build in ("sglang", "builtin:swa"):
        r = replay(trace, build, mode="strict", device="cpu")
        assert r.status == "clean", (build, r.first_divergence, r.first_violation)


# Speculative decoding on CPU: the EAGLE worker with the model itself as its draft, one draft
# step, attention in Triton's interpreter, and the layer's one patch (the draft tree's kernels).
SPECULATIVE = ("--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "1", "--speculative-eagle-topk",
               "1", "--speculative-num-draft-tokens", "2", "--attention-backend", "triton")


def test_speculative_decoding_server_records_through_the_cpu_compat_layer(models, tmp_path):
    server = Server(models["swa"], tmp_path / "out", 16, *SPECULATIVE, "--speculative-draft-model-path",
                    str(models["swa"]), small=False, record_args=("--cpu-compat", "--part-s", "0"))
    try:
        # short requests: every attention step runs in Triton's interpreter
        served = server.drive(8, length_scale=0.01, output_scale=0.25)
    finally:
        server.stop(signal.SIGTERM)
    assert served.ok == 8, served.error_kinds
    assert "cpu-compat patch eagle-tree-triton applied" in server.log_path.read_text(errors="replace")
    (trace,) = finished_traces(tmp_path / "out")
    methods = {c.method for c in TraceReader(trace).calls(top_level_only=True)}
    # sglang 0.5.23's speculative path: draft slots in batched extends, no token-by-token decode
    assert "alloc_extend" in methods and "alloc_decode" not in methods
    # The patches touch no allocator: the unpatched release (this process) answers every call alike.
    for build in ("sglang", "builtin:swa"):
        r = replay(trace, build, mode="strict", device="cpu")
        assert r.status == "clean", (build, r.first_divergence, r.first_violation)


def test_sigkill_of_the_scheduler_keeps_every_call_older_than_a_second(models, tmp_path):
    server = Server(models["llama"], tmp_path / "out", 16)
    done: list[object] = []
    try:
        t = threading.Thread(target=lambda: done.append(server.drive(400, output_scale=1.0)), daemon=True)
        t.start()
        time.sleep(25)  # the server is busy: prefill and decode calls every few milliseconds
        victim = server.scheduler_pid()
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        code = server.proc.wait(timeout=180)  # sglang notices and tears itself down
        t.join(timeout=120)
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert code != 0
    (trace,) = finished_traces(tmp_path / "out")
    reader = TraceReader(trace)
    calls = list(reader.calls(top_level_only=True))
    last_end = max(c.t_end_ns for c in calls) / 1e9
    # The promise: nothing that finished more than a second before the kill is lost.
    # The scheduler called its allocator continuously up to the kill, so the trace
    # must reach within a second of it.
    assert last_end >= killed_at - 1.0, f"trace ends {killed_at - last_end:.2f} s before the kill"
    # Against the server's own count: every request it answered a second before the
    # kill was prefilled through alloc_extend (one prefix_lens entry per request).
    answered = sum(1 for at in (done[0].finished_at if done else []) if at < killed_at - 1.0)
    prefilled = sum(len(c.args["prefix_lens"]) for c in calls if c.method == "alloc_extend")
    assert answered > 0 and prefilled >= answered, (prefilled, answered)
    r = replay(trace, "builtin:paged", mode="strict", device="cpu")
    assert r.status == "clean", (r.first_divergence, r.first_violation)


def test_the_recording_page_block_runs_as_written(tmp_path):
    """docs/recording.md's block, line by line in one shell, as a reader runs it: the
    tiny model, the server under kvreplay record in the background, drive (which waits
    for the server), the stop, the two replays. The test owns /tmp/ and the port."""
    from docs_commands import blocks

    text = (ROOT / "docs" / "recording.md").read_text()
    (block,) = [b for b in blocks(text) if "kvreplay record --out traces/live" in b]
    work = tmp_path / "work"
    work.mkdir()
    (work / "traces").mkdir()  # the reader's checkout has it; record makes only the directory it is given
    ran = run_page_block(block, tmp_path, work, "30000", START_S + 900)
    for line, (rc, said) in ran.items():
        if not line.startswith("kill"):  # wait $! passes on the server's own exit status
            assert rc == 0, (line, rc, said)
    (trace,) = finished_traces(work / "traces" / "live")
    meta = TraceReader(trace).meta
    assert meta.family == "paged" and meta.ctor_args["dtype"] == "torch.bfloat16"
    replays = [said for line, (_, said) in ran.items() if line.startswith("kvreplay replay")]
    assert len(replays) == 2 and all("clean" in out for out in replays), replays


# This bug makes sglang's paged allocator give every 25th released page list back twice
# (a double free), loaded as a sitecustomize of the user's (servers.sitecustomize_patching).
DOUBLE_FREE = sitecustomize_patching("sglang.srt.mem_cache.allocator.paged", '''
def _patch(module):
    cls = module.PagedTokenToKVPoolAllocator
    release = cls._release_page_ids
    seen = [0]

    def twice(self, page_ids):
        release(self, page_ids)
        seen[0] += 1
        if seen[0] % 25 == 0 and len(page_ids):
            release(self, page_ids)
    cls._release_page_ids = twice
''')


def test_watch_names_a_patched_allocators_double_free_within_a_second(models, tmp_path):
    import urllib.request

    from servers import free_port

    bug = tmp_path / "bug"
    bug.mkdir()
    (bug / "sitecustomize.py").write_text(DOUBLE_FREE)
    port = free_port()
    out = tmp_path / "out"
    server = Server(models["llama"], out, 16, env={"PYTHONPATH": str(bug)},
                    record_args=("--watch", "--metrics-port", str(port), "--minimize-s", "60"))
    try:
        # Four in flight, not sixteen: the promise is the watch's second, and on two cores a
        # server saturated with requests starves the writer that checks its calls.
        served = server.drive(60, concurrency=4)
        # Scraped as soon as the watch's finding is counted: once idle, sglang's own check
        # may end the server (the double free counts slots twice), and the endpoint with it.
        metrics = ""
        for _ in range(40):
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            if 'kvreplay_violations_total{trace="kvreplay-' in metrics:
                break
            time.sleep(0.25)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == 60, served.error_kinds
    log = server.log_path.read_text(errors="replace")  # the server's shutdown may fill the tail
    assert "kvreplay watch: violation" in log, server.tail()
    assert 'kvreplay_violations_total{trace="kvreplay-' in metrics
    findings = [json.loads(line) for line in (out / "kvreplay-watch.jsonl").read_text().splitlines()]
    first = next(f for f in findings if f["kind"] == "violation")
    trace = out / first["trace"]
    ends = {tc.number: tc.call.t_end_ns for tc in TraceReader(trace).top_calls() if tc.number}
    assert first["t"] - ends[first["call"]] / 1e9 < 1.0, first
    offline = replay(trace, "sglang", device="cpu")  # this process has no patch: the release is correct...
    assert offline.status != "clean"  # ...and the recorded double free diverges from it
    assert list(out.glob("repro-*.parquet"))
