"""The live tier of the tree family: a real sglang 0.5.23 server on CPU whose prefix
cache (``UnifiedRadixCache``) is recorded through the tree's wire (``--class``), with
the watch on, then replayed on the release that recorded it.

Run by scripts/sglang-tier.sh (marker ``live``) in the sglang venv."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from servers import RecordedServer, finished_traces, sitecustomize_patching
from test_live_server import MOONCAKE, START_S, Server, _tiny

pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache", reason="sglang not installed")

from kvreplay.errors import BuildUnsupported  # noqa: E402
from kvreplay.replay.dispatch import replay  # noqa: E402
from kvreplay.trace.reader import TraceReader  # noqa: E402
from kvreplay.workload.drive import DriveConfig, drive  # noqa: E402
from kvreplay.workload.requests import Request, load_requests  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.live]
TREE = ("--class", "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache")

# sglang's own tree, made to keep a lock: a sitecustomize of the user's (kvreplay record
# runs it after its own start-up) makes every tenth unlock do nothing once the file ARM
# exists, so the node's path stays protected for ever.
KEEPS_LOCK = sitecustomize_patching("sglang.srt.mem_cache.unified_radix_cache", '''
import os

def _patch(module):
    cls = module.UnifiedRadixCache
    unlock = cls.unlock
    seen = [0]

    def keeps(self, lock):
        if lock is not None and os.path.exists(ARM):
            seen[0] += 1
            if seen[0] % 10 == 0:
                return None
        return unlock(self, lock)
    cls.unlock = keeps
''')


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("models") / "llama")


def _tree_trace(out: Path) -> Path:
    traces = [t for t in finished_traces(out) if TraceReader(t).meta.family == "tree"]
    assert len(traces) == 1, finished_traces(out)
    return traces[0]


def test_a_servers_tree_replays_strict_clean_on_the_release_that_recorded_it(llama, tmp_path):
    out = tmp_path / "out"
    server = Server(llama, out, 1, record_args=(*TREE, "--watch"))
    try:
        served = server.drive(60)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == 60, served.error_kinds
    assert not (out / "kvreplay-watch.jsonl").exists(), (out / "kvreplay-watch.jsonl").read_text()
    trace = _tree_trace(out)
    meta = TraceReader(trace).meta
    assert meta.pool_class.endswith(":UnifiedRadixCache") and meta.ctor_args["page_size"] == 1
    r = replay(trace, "sglang", mode="strict", device="cpu")
    assert r.status == "clean", (r.first_divergence, r.first_violation)
    assert r.calls_replayed > 60 * 4
    counts = {m: n for m, n in _methods(trace).items()}
    for method in ("match_prefix", "lock", "checkpoint", "free_kv_row", "unlock", "release", "extend"):
        assert counts.get(method, 0) >= 60, (method, counts)
    # a finished request's checkpoint carries its output count (releases before 0.5.6 need it)
    finished = [tc.call.args["outputs"] for tc in TraceReader(trace).top_calls()
                if tc.call.method == "checkpoint" and "outputs" in tc.call.args]
    assert len(finished) >= 60 and min(finished) >= 1, finished[:10]


def test_a_sliding_window_servers_tree_replays_strict_clean_on_the_release_that_recorded_it(tmp_path):
    """A hybrid model (a window of 128 tokens on half its layers) at page size 1: its tree
    has components full and sliding window over the composite allocator. The wire records
    both sides (target ``swa`` for the window's), the window sliding past running
    requests' oldest slots (``slide``) and evictions in both units; the trace replays
    strict-clean on the release, which builds the same tree on CPU."""
    model = _tiny(tmp_path / "swa", swa=128)
    out = tmp_path / "out"
    # A pool small enough that the tree evicts, and chunks that checkpoint (and slide) mid-prefill.
    # The window side as large as the full one: the CPU attention backend indexes the window
    # layers' cache by full slot, past its end once the full side hands out a slot above its size.
    server = Server(model, out, 1, "--max-total-tokens", "12288", "--swa-full-tokens-ratio", "1.0",
                    "--chunked-prefill-size", "512", small=False, record_args=(*TREE, "--watch"))
    try:
        served = server.drive(40, length_scale=0.1, output_scale=2.0)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == 40, served.error_kinds
    trace = _tree_trace(out)
    meta = TraceReader(trace).meta
    assert meta.ctor_args["sliding_window"] == 128 and meta.ctor_args["swa_size"] > 0, meta.ctor_args
    counts = _methods(trace)
    targets = {x.target for tc in TraceReader(trace).top_calls() for x in tc.nested}
    assert "swa" in targets and counts.get("slide", 0) > 0, (counts, targets)
    r = replay(trace, "sglang", mode="strict", device="cpu")
    assert r.status == "clean", (r.first_divergence, r.first_violation, r.message)
    assert not (out / "kvreplay-watch.jsonl").exists(), (out / "kvreplay-watch.jsonl").read_text()
    nested = {(tc.call.method, x.target) for tc in TraceReader(trace).top_calls() for x in tc.nested
              if x.method == "free"}
    assert {("slide", "swa"), ("evict", "kv"), ("evict", "swa")} <= nested, nested
    # kvreplay's own tree has no window component yet, and says so in one line
    with pytest.raises(BuildUnsupported, match="no sliding-window component"):
        replay(trace, "builtin:tree", device="cpu")


class Lfm2Server(RecordedServer):
    """A recorded tiny LFM2 (a convolution layer and a full-attention layer) on sglang's own
    model code on CPU (``--cpu-compat``): page size 1, no overlap, no extra buffer (what
    sglang allows a state pool on a CPU), 48 state slots, a 4,096-token pool, chunks of 64."""

    def __init__(self, tmp_path: Path, out: Path, record_args: tuple[str, ...], env: dict[str, str] | None = None
                 ) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
        try:
            from tiny_model import make
        finally:
            sys.path.pop(0)
        model = make(tmp_path / "lfm2", conv=True)
        super().__init__(out, lambda port: [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--skip-tokenizer-init",
            "--device", "cpu", "--page-size", "1", "--disable-overlap-schedule", "--disable-cuda-graph",
            "--mem-fraction-static", "0.05", "--max-total-tokens", "4096", "--max-mamba-cache-size", "48",
            "--chunked-prefill-size", "64", "--port", str(port), "--log-level", "warning"],
            start_s=START_S, record_args=("--cpu-compat", *TREE, *record_args), env=env)

    def drive(self, n: int, families: int = 0, **kw) -> object:
        """``families`` groups of requests sharing 192 tokens (three chunks: a family's first
        caches its chunks' states, the others' matches copy one), then ``n`` of Mooncake's."""
        shared = [Request(1000 + k, 0.0, 200, 16, tuple(100 * (k % 6) + b for b in range(12)) + (10_000 + k,))
                  for k in range(4 * families)]
        reqs = load_requests(MOONCAKE, count=n, seed=0, block_tokens=16, length_scale=0.05, output_scale=0.5) \
            if n else []
        return drive(DriveConfig(url=self.url, concurrency=kw.pop("concurrency", 8), **kw), shared + reqs)


def test_a_mamba_hybrids_tree_replays_strict_clean_on_the_release_that_recorded_it(tmp_path):
    """A hybrid LFM2 on sglang's own model code: its tree has components full and Mamba,
    each request a state slot of a pool of 48. The wire records the state slots (target
    ``state``) where the tree moves them (a hit's copy-on-write, a chunk's copy, a
    finished request's donation, eviction for states) and where the scheduler does
    (admission, a round's group, a copy given back); the trace replays strict-clean on
    the release, and kvreplay's own tree says it has no state component."""
    out = tmp_path / "out"
    server = Lfm2Server(tmp_path, out, ("--watch",))
    try:
        # Families first; then Mooncake's long prompts fill the state pool with chunks'
        # states and make the tree evict them
        served = server.drive(24, families=6)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == 48, served.error_kinds
    assert not (out / "kvreplay-watch.jsonl").exists(), (out / "kvreplay-watch.jsonl").read_text()
    trace = _tree_trace(out)
    meta = TraceReader(trace).meta
    assert meta.ctor_args["state_size"] == 48 and meta.ctor_args["page_size"] == 1, meta.ctor_args
    counts = _methods(trace)
    for method in ("hold_state", "group_states", "ungroup_states", "checkpoint", "evict"):
        assert counts.get(method, 0) > 0, (method, counts)
    nested = {(tc.call.method, x.method) for tc in TraceReader(trace).top_calls() for x in tc.nested
              if x.target == "state"}
    # a hit's copy-on-write, a chunk's copy into a slot of the tree's, eviction for states
    assert {("match_prefix", "alloc"), ("checkpoint", "alloc"), ("evict", "free")} <= nested, nested
    r = replay(trace, "sglang", mode="strict", device="cpu")
    assert r.status == "clean", (r.first_divergence, r.first_violation, r.message)
    with pytest.raises(BuildUnsupported, match="no Mamba state component"):
        replay(trace, "builtin:tree", device="cpu")


# sglang's Mamba tree, made to lose a state slot once: after ARM exists, the first eviction
# for KV tokens (the scheduler's, short of KV slots) that evicts a leaf with a state drops
# that state instead of freeing it (in the cache layer's drain, which either tree core's
# eviction goes through; an eviction for the one state slot a checkpoint needs is left
# alone, as sglang asserts that it yields it).
LOSES_EVICTED_STATE = sitecustomize_patching("sglang.srt.mem_cache.unified_radix_cache", '''
import os

def _patch(module):
    cls = module.UnifiedRadixCache
    free_values, evict_for_alloc = cls._free_values, cls.evict_for_alloc
    state = {"lost": False, "for_kv": False}

    def for_kv(self, params, *args, **kwargs):
        state["for_kv"] = os.path.exists(ARM) and not state["lost"] and params.num_tokens > 0
        try:
            return evict_for_alloc(self, params, *args, **kwargs)
        finally:
            state["for_kv"] = False

    def loses(self, device_frees, host_frees):
        if state["for_kv"] and not state["lost"]:
            for kind, values in device_frees.items():
                if getattr(kind, "name", "") == "MAMBA" and values:
                    state["lost"] = True
                    values.pop(0)  # taken off the list (drained), never freed
                    break
        return free_values(self, device_frees, host_frees)
    cls._free_values, cls.evict_for_alloc = loses, for_kv
''')


def test_watch_names_a_mamba_tree_that_loses_an_evicted_state_at_its_call_within_a_second(tmp_path):
    """A Mamba tree that evicts a leaf for KV slots frees its state too. A tree that drops
    one such state instead of freeing it loses a state slot: the watch names that eviction
    within a second (the state books, free + the nodes' states + what requests hold, fall
    one short there), and replay on the unpatched release names it too (the release frees
    a state slot the recording did not)."""
    bug = tmp_path / "bug"
    bug.mkdir()
    arm = tmp_path / "arm"
    (bug / "sitecustomize.py").write_text(f"ARM = {str(arm)!r}\n" + LOSES_EVICTED_STATE)
    out = tmp_path / "out"
    path = os.pathsep.join(p for p in (str(bug), os.environ.get("PYTHONPATH", "")) if p)
    server = Lfm2Server(tmp_path, out, ("--watch",), env={"PYTHONPATH": path})
    try:
        warm = _warm(server, out)
        arm.touch()
        served = server.drive(16)  # Mooncake's long prompts press on the KV pool: the tree evicts leaves
        time.sleep(2)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == 16, served.error_kinds
    findings = [json.loads(line) for line in (out / "kvreplay-watch.jsonl").read_text().splitlines()]
    assert findings and all(f["call"] > warm for f in findings), (warm, findings)
    # the watch's build is the patched tree too (the writer runs the user's sitecustomize):
    # it drops the state as the server did, and its own books say so at that eviction
    first = findings[0]
    trace = out / first["trace"]
    calls = {tc.number: tc.call for tc in TraceReader(trace).top_calls() if tc.number}
    assert first["rule"] == "tree-books/lost" and calls[first["call"]].method == "evict", first
    assert "1 state slot(s) lost here" in first["message"], first
    assert first["t"] - calls[first["call"]].t_end_ns / 1e9 < 1.0, first
    # unpatched here: the release frees the state the recording dropped, at that call
    offline = replay(trace, "sglang", device="cpu")
    d = offline.first_divergence
    assert d is not None and (d.call, d.kind) == (first["call"], "nested"), d
    assert "did not free 1 state slot(s)" in d.message and "lost in the recording" in d.message, d


def _methods(trace: Path) -> dict[str, int]:
    from collections import Counter

    return dict(Counter(tc.call.method for tc in TraceReader(trace).top_calls()))


def _metrics(out: Path) -> dict:
    for path in out.glob(".kvreplay-metrics-*.json"):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return {}


def _warm(server: Server, out: Path, tries: int = 60) -> int:
    """Requests one at a time until the watch has checked every call recorded before the
    last one (its build is loaded): the calls recorded by then. The counters are written
    as batches come, so each request also brings the news of the one before."""
    for _ in range(tries):
        before = int(_metrics(out).get("calls") or 0)
        server.drive(1)
        time.sleep(1.0)
        if before and int(_metrics(out).get("checked") or 0) >= before:
            return int(_metrics(out)["calls"])
    pytest.fail(f"the watch did not catch up with the recording: {_metrics(out)}")


def _bugged_server(llama: Path, tmp_path: Path, patch: str, **env: str) -> tuple[Server, Path, Path]:
    """A watched server whose tree carries ``patch`` (a sitecustomize), armed when the
    returned ARM file is made: the server, that file, the recording's directory."""
    bug = tmp_path / "bug"
    bug.mkdir()
    arm = tmp_path / "arm"
    (bug / "sitecustomize.py").write_text(f"ARM = {str(arm)!r}\n" + patch)
    out = tmp_path / "out"
    return Server(llama, out, 1, env={"PYTHONPATH": str(bug), **env}, record_args=(*TREE, "--watch")), arm, out


def test_watch_names_a_tree_that_keeps_a_lock_at_its_call_within_a_second(llama, tmp_path):
    server, arm, out = _bugged_server(llama, tmp_path, KEEPS_LOCK)
    try:
        # The watch's build is sglang's tree, imported in the writer's process when the
        # server builds its tree (about ten seconds on this machine, at the end of the
        # server's start-up): findings before then wait for it. The bug is armed after.
        warm = _warm(server, out)
        arm.touch()
        served = server.drive(40)
        time.sleep(2)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == 40, served.error_kinds
    findings = [json.loads(line) for line in (out / "kvreplay-watch.jsonl").read_text().splitlines()]
    late = [f for f in findings if f["kind"] == "violation"]
    assert late and all(f["call"] > warm for f in late), (warm, findings)
    trace = out / late[0]["trace"]
    calls = {tc.number: tc.call for tc in TraceReader(trace).top_calls() if tc.number}
    for f in late:
        # the unlock that did nothing: the scheduler's own, or the one a checkpoint makes
        # when it moves the request's lock to its new last node
        assert f["rule"] == "tree-lock/orphan" and calls[f["call"]].method in ("unlock", "checkpoint"), f
        assert f["t"] - calls[f["call"]].t_end_ns / 1e9 < 1.0, f
    # this process has no patch: the release releases the lock the recording kept. Its sizes
    # part from the recording's where they show it: at that call, or (a lock moved down a
    # path it still protects) at the next unlock of the path
    first = late[0]
    offline = replay(trace, "sglang", device="cpu")
    assert offline.status != "clean" and offline.first_divergence.call >= first["call"], offline.first_divergence
    assert offline.first_divergence.kind == "counter", offline.first_divergence



# sglang's own tree, made to forget a row: once ARM exists, a row free that has slots to
# give back gives back nothing. With page size 1 a finished request's checkpoint caches its
# whole row, so its row free is empty; a retracted request's is not (its decoded tail is
# not cached), and sglang's SGLANG_TEST_RETRACT retracts on a schedule.
FORGETS_ROW = sitecustomize_patching("sglang.srt.mem_cache.unified_radix_cache", '''
import os

def _patch(module):
    cls = module.UnifiedRadixCache
    free_kv_row = cls.free_kv_row

    def forgets(self, kv, ranges):
        if os.path.exists(ARM) and any(end > start for start, end in ranges):
            return None
        return free_kv_row(self, kv, ranges)
    cls.free_kv_row = forgets
''')
RETRACTS = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "20"}


def test_watch_names_a_tree_that_forgets_a_row_at_its_call_and_replay_reports_the_leak(llama, tmp_path):
    server, arm, out = _bugged_server(llama, tmp_path, FORGETS_ROW, **RETRACTS)
    try:
        warm = _warm(server, out)
        arm.touch()
        served = server.drive(32, output_scale=1.0)
        time.sleep(2)
    finally:
        server.stop(signal.SIGINT)
    assert served.ok == 32, served.error_kinds
    findings = [json.loads(line) for line in (out / "kvreplay-watch.jsonl").read_text().splitlines()]
    assert findings and all(f["call"] > warm for f in findings), (warm, findings)
    trace = out / findings[0]["trace"]
    calls = {tc.number: tc.call for tc in TraceReader(trace).top_calls() if tc.number}
    # named at the row free that let go of the slots, with how many, within a second
    first = findings[0]
    assert first["rule"] == "tree-owner/row-leak" and calls[first["call"]].method == "free_kv_row", first
    args = calls[first["call"]].args
    size = args["end"] - args["start"]
    assert f"left {size} slot(s)" in first["message"], first
    assert {f["rule"] for f in findings if f["call"] == first["call"]} == {"tree-owner/row-leak", "tree-books/lost"}
    for f in findings:
        assert f["t"] - calls[f["call"]].t_end_ns / 1e9 < 1.0, f
    # the release, unpatched here, frees what the recording kept: the replay parts from it at
    # that call, by that many free slots, and says it is a leak
    offline = replay(trace, "sglang", device="cpu")
    d = offline.first_divergence
    assert d is not None and d.call == first["call"] and d.kind == "counter", d
    assert d.actual[0] - d.expected[0] == size and f"lost {size} slot(s)" in d.message and "leak" in d.message, d
