"""The integration tier, across releases: sglang==VERSION builds on their own code.

Run by scripts/sglang-tier.sh (``-m sglang``), in an environment with sglang's
runtime dependencies (the tier's venv). Each release is fetched from the
package index once into the kvreplay cache (``KVREPLAY_CACHE``, kept between CI
runs); its paged allocators run their Triton kernels in Triton's interpreter. Three
releases cover the layouts: 0.5.12 (SWA allocator in swa_memory_pool.py, before the
allocator package), 0.5.17 (the allocator package, before the segment frees) and
0.5.23 (the reference)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang not installed")

from kvreplay.builds.releases import expand  # noqa: E402
from kvreplay.jobs.bisect import bisect, build_candidates  # noqa: E402
from kvreplay.jobs.matrix import run_matrix  # noqa: E402
from kvreplay.jobs.stored_replay import replay_and_store  # noqa: E402
from kvreplay.replay.dispatch import replay, run_many  # noqa: E402
from kvreplay.replay.report import Failure  # noqa: E402

pytestmark = pytest.mark.sglang
CORPUS = Path(__file__).resolve().parents[1] / "traces"
SEED = "swa-mapping/tail-prealloc-nontail-mapped"


@pytest.fixture(autouse=True)
def _shared_cache(monkeypatch):
    # Releases are big: keep them where CI keeps them, not in a per-test temp dir.
    monkeypatch.setenv("KVREPLAY_CACHE", os.environ.get("KVREPLAY_RELEASE_CACHE",
                                                        os.path.expanduser("~/.cache/kvreplay")))


def test_the_seed_bug_shows_on_0_5_12_at_the_tail_preallocation(cli, tmp_path):
    r = cli("replay", str(CORPUS / "disagg-mtp-2000.parquet"), "--build", "sglang==0.5.12", "--device", "cpu",
            "--db", str(tmp_path / "k.db"), "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 1, r.stderr
    seed = [v for v in d["violations"] if f"{v['invariant']}/{v['rule']}" == SEED]
    assert seed and seed[0]["method"] == "alloc_extend_swa_tail"
    assert d["kernels"] == "triton-interpreter" and d["build"] == "sglang==0.5.12"
    shown = cli("show", str(d["run_id"]), "--db", str(tmp_path / "k.db"), "--json")
    assert json.loads(shown.stdout)["kernels"] == "triton-interpreter"


def test_bisect_over_releases_names_the_fix(tmp_path):
    # The seed bug minimized (169 calls): the bisect's cost is the releases' imports.
    old, order = build_candidates(expand("sglang==0.5.11..0.5.23"))
    res = bisect(CORPUS / "sglang-0.5.12-swa-tail-prealloc.parquet", old, order, db=str(tmp_path / "k.db"),
                 device="cpu", mode="remap", failure=Failure.parse(SEED), fixed=True)
    assert res.verdict == "found" and res.first_bad.spec == "sglang==0.5.12.post1", res.steps


def test_the_minimal_seed_trace_shows_the_bug_and_the_fix():
    # the fix on the 169-call reproducer: the production trace on 0.5.12.post1 took three
    # minutes in Triton's interpreter to say the same
    trace = CORPUS / "sglang-0.5.12-swa-tail-prealloc.parquet"
    bug = replay(trace, "sglang==0.5.12", mode="remap", device="cpu")
    fix = replay(trace, "sglang==0.5.12.post1", mode="remap", device="cpu")
    assert bug.violation_counts.get(SEED) == 1 and bug.kernels == "triton-interpreter"
    assert SEED not in fix.rules and "swa-mapping/released-page-keeps-peer" in fix.rules  # #27779 still in


def test_three_layouts_replay_the_corpus_without_a_crash(tmp_path):
    traces = [CORPUS / f"{t}.parquet" for t in ("disagg-mtp-azure-1000", "sglang-0.5.23-swa-page0",
                                                 "sglang-0.5.23-decode-none-leak")]
    res = run_matrix(traces, ["sglang==0.5.12", "sglang==0.5.17", "sglang==0.5.23"], db=str(tmp_path / "m.db"),
                     mode="remap", device="cpu", jobs=2)
    assert len(res.cells) == 9
    assert not [c for c in res.cells if c.status in ("crashed", "timeout", "unloadable")], \
        [(c.build, c.status, c.message) for c in res.cells]
    # #38519: the page-0 free shows where free_swa_segment is the release's own (0.5.20 on).
    page0 = {c.build: c for c in res.cells if c.trace.endswith("sglang-0.5.23-swa-page0.parquet")}
    assert "free-list/padding-page-free" in page0["sglang==0.5.23"].rules
    # The release build of 0.5.23 is the installed 0.5.23, call for call.
    installed = replay(traces[1], "sglang", mode="remap", device="cpu")
    assert page0["sglang==0.5.23"].rules == {k: v.call for k, v in _firsts(installed).items()}


def _firsts(report):
    from kvreplay.replay.report import firsts_by_rule

    return firsts_by_rule(report.violations)


KERNELS = '''
from kvreplay.replay.kernels import instrument
counter = instrument("cpu")
import torch, triton, triton.language as tl

@triton.jit
def read_past(src, dst, n: tl.constexpr):
    tl.store(dst, tl.load(src + n))

@triton.jit
def write_past(dst, n: tl.constexpr):
    tl.store(dst + n, 7)

out = torch.full((1,), -1, dtype=torch.int64)
read_past[(1,)](torch.empty(0, dtype=torch.int64), out, 3)
print("read", out.item(), counter["launches"], counter["kind"])
try:
    write_past[(1,)](torch.zeros(2, dtype=torch.int64), 5)
    print("wrote")
except RuntimeError as exc:
    print("refused", exc)
'''


def test_interpreted_kernels_read_zeros_past_the_end_and_refuse_to_write_there():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", KERNELS], capture_output=True, text=True, timeout=300, env=env)
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and lines[0] == "read 0 1 triton-interpreter", res.stderr[-2000:]
    assert lines[1].startswith("refused Triton kernel write_past wrote past the end of its argument 0")


def test_the_live_disaggregated_decode_trace_is_clean_on_the_seed_bugs_release():
    # Real alloc_extend_swa_tail traffic from a disaggregated decode server (no speculation):
    # 0.5.12 has the seed bug, yet nothing here takes its path (no rejected drafts). (The
    # live tier replays its own recording on 0.5.23; 0.5.12.post1 is clean too, 100 s more.)
    build = "sglang==0.5.12"
    r = replay(CORPUS / "live-sglang-0.5.23-disagg-decode-mooncake300.parquet", build, mode="remap", device="cpu")
    assert r.status == "clean", (build, r.first_divergence, r.first_violation)
    assert r.calls_replayed == 2_530_447


SPEC = CORPUS / "live-sglang-0.5.23-swa-speculative-mooncake24.parquet"
PEER = "swa-mapping/released-page-keeps-peer"


def test_live_speculative_traffic_meets_exact_token_clearing_until_0_5_14(tmp_path):
    # A real speculative-decoding server frees the slots past a request's accepted tokens
    # inside a partly used page; releases before 0.5.14 clear only the tokens passed
    # (#27779), so the page goes back still mapped to its SWA slots. The replays are stored
    # where the bisect looks, so it replays none of these releases again.
    db = str(tmp_path / "k.db")
    for build in ("sglang==0.5.12", "sglang==0.5.13.post1"):
        r = replay_and_store(SPEC, build, db=db, mode="remap", device="cpu").report
        assert r.first_violation is not None and r.first_violation.call == 50329, build
        assert f"{r.first_violation.invariant}/{r.first_violation.rule}" == PEER, build
    assert replay_and_store(SPEC, "sglang==0.5.14", db=db, mode="remap", device="cpu").report.status == "clean"
    old, order = build_candidates(expand("sglang==0.5.12..0.5.23"))
    res = bisect(SPEC, old, order, db=db, device="cpu", mode="remap", failure=Failure.parse(PEER), fixed=True)
    assert res.verdict == "found" and res.first_bad.spec == "sglang==0.5.14", res.steps


MAMBA_STALE = CORPUS / "sglang-0.5.12-mamba-stale-ping-pong.parquet"
STALE_RULE = "state-pool/request-holds-free-slot"


@pytest.mark.mamba
def test_a_hybrid_state_pool_trace_replays_strict_on_the_release_the_builtin_mirrors():
    """builtin:mamba is sglang 0.5.23's pool: the installed release hands out the same
    rows and slots, call for call."""
    r = replay(MAMBA_STALE, "sglang", device="cpu")
    assert r.status == "clean", (r.status, r.first_divergence, r.first_violation, r.message)


LIVE_MAMBA = CORPUS / "live-sglang-0.5.23-lfm2-mamba-mooncake40.parquet"


@pytest.mark.mamba
def test_the_live_state_pool_trace_replays_clean_on_a_release_that_reads_other_request_fields():
    """The live LFM2 server's trace (no extra buffer) on 0.5.13, whose pool reads another
    field of a request: 0.5.13 to 0.5.19 let a request keep its row only as a chunk in
    flight or with KV committed, which the wire's KV length answers (it crashed the
    replay before); in remap mode every release from 0.5.9 agrees with 0.5.23."""
    r = replay(LIVE_MAMBA, "sglang==0.5.13", mode="remap", device="cpu")
    assert r.status == "clean", (r.status, r.message, r.first_divergence, r.first_violation)


@pytest.mark.mamba
@pytest.mark.parametrize(("release", "why"), [("0.5.2", "mamba_utils came in 0.5.4"),
                                              ("0.5.5", "no free_mamba_cache (it came in sglang 0.5.9)")])
def test_a_release_before_the_state_pool_took_its_calls_says_why_in_one_line(release, why):
    r = replay(LIVE_MAMBA, f"sglang=={release}", mode="remap", device="cpu")
    assert r.status == "unsupported" and why in r.message, (r.status, r.message)


@pytest.mark.mamba
def test_sglang_0_5_12_gives_a_retracted_request_its_freed_tracking_pair_and_0_5_13_does_not():
    bad = replay(MAMBA_STALE, "sglang==0.5.12", mode="remap", device="cpu")
    first = bad.first_violation
    assert (first.invariant, first.rule, first.method, first.call) == ("state-pool", "request-holds-free-slot",
                                                                        "alloc_reqs", 3025), first
    # 0.5.12 has no grouped allocation and copies states into the cache: said, not hidden
    assert {"alloc_group_begin", "donate_track"} <= set(bad.translated), bad.translated
    good = replay(MAMBA_STALE, "sglang==0.5.13", mode="remap", device="cpu")
    assert good.status == "clean", (good.status, good.first_violation, good.first_divergence)
    old = replay(MAMBA_STALE, "sglang==0.5.5", mode="remap", device="cpu")
    assert old.status == "unsupported" and "tracking pair" in old.message, old.message


@pytest.mark.mamba
def test_bisect_fixed_names_0_5_13_for_the_stale_tracking_pair(tmp_path):
    old, order = build_candidates(expand("sglang==0.5.9..0.5.16"))
    res = bisect(MAMBA_STALE, old, order, db=str(tmp_path / "b.db"), device="cpu", mode="remap",
                 failure=Failure.parse(STALE_RULE), fixed=True)
    assert res.verdict == "found" and res.first_bad.spec == "sglang==0.5.13", res.steps


NO_OUTPUT = CORPUS / "sglang-0.5.3-tree-no-output-leak.parquet"
LIVE_TREES = [CORPUS / "live-sglang-0.5.23-tree-mooncake60.parquet",
              CORPUS / "live-sglang-0.5.23-tree-retract32.parquet"]


def test_sglang_0_5_3_post1_leaks_the_last_prompt_slot_of_a_request_with_no_output_and_post2_does_not():
    """Up to 0.5.3.post1 cache_finished_req cached (origin_input_ids + output_ids)[:-1]:
    a request that asked for no output token (max_new_tokens=0) kept one prompt slot
    neither cached nor freed. The checkpoint parts from the recording there, and the
    request gives its row back holding the slot; 0.5.3.post2 is clean, as the manifest
    says (the bisect that names it: docs/tree.md, run by the docs test)."""
    from kvreplay.corpus.expectations import check_report
    from kvreplay.corpus.manifest import load_manifest

    entry = next(e for e in load_manifest(CORPUS) if e.file == NO_OUTPUT)
    reports = {}
    for x in entry.expect:
        if x.build.startswith("sglang=="):
            reports[x.build] = replay(NO_OUTPUT, x.build, device="cpu")
            assert check_report(reports[x.build], x) == [], x.build
    bad = reports["sglang==0.5.3.post1"]
    d = bad.first_divergence
    assert (d.kind, d.method, d.call) == ("result", "checkpoint", 125) and "1 fewer cached" in d.message, d
    v = bad.first_violation
    assert (v.invariant, v.rule, v.method, v.call) == ("tree-owner", "row-leak", "release", 128), v
    assert bad.violation_counts["quiescence/tree-idle"] == 1, bad.violation_counts
    assert reports["sglang==0.5.3.post2"].status == "clean"


# 0.5.1: keys are token lists (key objects from 0.5.3); 0.5.10: parameter objects, lock results as
# objects; 0.5.18: get_fill_ids(), kv_len_to_handle, cache_salt, and the unified tree beside RadixCache
@pytest.mark.parametrize("release", ["0.5.1", "0.5.10", "0.5.18"])
def test_the_live_tree_traces_replay_strict_clean_on_a_release_before_checkpoint(release):
    """A trace recorded before the wire carried a finished request's output count
    replays every checkpoint as a chunk's (cache_unfinished_req): the same books."""
    for trace in LIVE_TREES:
        r = replay(trace, f"sglang=={release}", device="cpu")
        assert r.status == "clean", (trace.name, r.status, r.first_divergence, r.first_violation, r.message)


def _replays(traces, build, **options):
    """Each trace replayed on a release build in one worker (the release imported once):
    ``{trace name: report}``."""
    got = {}
    run_many([str(t) for t in traces], build, lambda r, code_id: got.__setitem__(Path(r.trace).name, r),
             device="cpu", **options)
    assert len(got) == len(traces), sorted(got)
    return got


@pytest.mark.parametrize("release", ["0.5.19", "0.5.20", "0.5.21"])
def test_a_plain_models_unified_tree_before_checkpoint_replays_as_the_wires_era_does(release, tmp_path):
    """0.5.19 to 0.5.21 ran a plain model on the unified tree, released through
    cache_finished_req (0.5.20: with lock receipts, and the prompt as a node of its own)
    or, in 0.5.21, insert_req with the caller's free_kv_row and unpin.
    The live traces replay clean, a finished request's release included, and a trace of a
    tree that forgets rows meets the same books on the release as on kvreplay's tree."""
    from kvreplay.workload.synth import SynthConfig, synthesize

    forgets = tmp_path / "forgets.parquet"
    synthesize(SynthConfig(scenario="prefix-tree", out=forgets, requests=120, full_size=65536, page_size=1,
                           build="builtin:tree@forgets-row"))
    got = _replays([*LIVE_TREES, NO_OUTPUT, forgets], f"sglang=={release}")
    for trace in (*LIVE_TREES, NO_OUTPUT):
        r = got[trace.name]
        assert r.status == "clean", (trace.name, r.status, r.first_divergence, r.first_violation, r.message)
    ours, theirs = replay(forgets, "builtin:tree"), got[forgets.name]
    assert theirs.status == "divergence", (theirs.status, theirs.message)
    assert theirs.divergence_counts["counter"] == ours.divergence_counts["counter"] > 0, theirs.divergence_counts
    first = next(d for d in theirs.divergences if d.kind == "counter")
    assert first == ours.first_divergence and "(a leak)" in first.message, (first, ours.first_divergence)


DECODE_NOT_CACHED = CORPUS / "sglang-0.5.8-tree-decode-not-cached.parquet"


def _held_to_the_manifest(trace):
    """Replay ``trace`` on every release its manifest entry names, in each of its modes,
    and hold each report to its expectation: ``{(build, mode): report}``."""
    from kvreplay.corpus.expectations import check_report
    from kvreplay.corpus.manifest import load_manifest

    entry = next(e for e in load_manifest(CORPUS) if e.file == trace)
    reports = {}
    for x in entry.expect:
        if x.build.startswith("sglang=="):
            # every mode in one worker: the release is imported once
            got: list = []
            run_many([str(trace)] * len(x.modes), x.build, lambda r, code_id, got=got: got.append(r),
                     device="cpu", modes=list(x.modes))
            assert [r.mode for r in got] == list(x.modes), [r.mode for r in got]
            for mode, r in zip(x.modes, got, strict=True):
                reports[x.build, mode] = r
                assert check_report(r, x) == [], (x.build, mode)
    return reports


def test_sglang_0_5_6_to_0_5_8_post1_cache_a_finished_requests_prompt_only_and_0_5_9_its_decode_too():
    """0.5.6 to 0.5.8.post1 keyed a finished request's insert by fill_ids (its last
    prefill): the decoded slots were freed as the unaligned tail, not cached. Nothing is
    lost, so no rule fires; the checkpoint caches fewer tokens than the recording, and
    both modes follow the build's node names after that parting. The era's
    adapter meets CacheInitParams (0.5.6), MatchPrefixParams (0.5.8) and EvictParams
    (0.5.9); the release imports sgl_kernel's host kernels, stood in for here."""
    reports = _held_to_the_manifest(DECODE_NOT_CACHED)
    for mode in ("strict", "remap"):
        bad = reports["sglang==0.5.8.post1", mode]
        d = bad.first_divergence
        assert (d.kind, d.method, d.call) == ("result", "checkpoint", 263) and "8 fewer cached" in d.message, d
        assert bad.violation_counts == {} and bad.status == "divergence", (mode, bad.violation_counts)
    assert {m for b, m in reports if b == "sglang==0.5.9"} == {"strict", "remap"}


SWA_TREE = CORPUS / "live-sglang-0.5.23-tree-swa40.parquet"


def test_a_sliding_window_servers_tree_replays_on_the_wires_era_and_before_it_says_why_not():
    """The live hybrid server's tree (full and sliding-window components): 0.5.22 and 0.5.23
    build the same tree on CPU and answer it call for call, the window side's rows
    included; 0.5.21's tree adapter has no window component, and says so in one line."""
    reports = _held_to_the_manifest(SWA_TREE)
    assert {k for k in reports} == {("sglang==0.5.23", "strict"), ("sglang==0.5.23", "remap"),
                                    ("sglang==0.5.22", "strict")}
    assert all(r.calls_replayed > 28000 for r in reports.values())
    before = replay(SWA_TREE, "sglang==0.5.21", device="cpu")
    assert before.status == "unsupported" and "sliding-window tree replays on the wire's own era" in before.message


MAMBA_TREE = CORPUS / "live-sglang-0.5.23-tree-mamba48.parquet"


def test_a_mamba_hybrids_tree_replays_on_the_wires_era_and_before_it_says_why_not():
    """The live Mamba hybrid's tree (full and Mamba components): 0.5.22 and 0.5.23 build the
    same tree over their own request pool class and state slot allocator, and answer it
    call for call, the state side's rows included; 0.5.21's adapter has no state side
    the wire speaks, and says so in one line."""
    reports = _held_to_the_manifest(MAMBA_TREE)
    assert {k for k in reports} == {("sglang==0.5.23", "strict"), ("sglang==0.5.23", "remap"),
                                    ("sglang==0.5.22", "strict")}
    assert all(r.calls_replayed > 5000 for r in reports.values())
    before = replay(MAMBA_TREE, "sglang==0.5.21", device="cpu")
    assert before.status == "unsupported" and "Mamba tree replays on the wire's own era" in before.message


PARTIAL_PAGE = CORPUS / "sglang-0.5.5-tree-partial-page-leak.parquet"


def test_sglang_0_5_5_post3_loses_a_chunks_partial_page_that_another_request_cached_and_0_5_6_does_not():
    """Pages of 16 tokens: up to 0.5.5.post3 a chunk's cache_unfinished_req took the whole
    prefix_indices (partial page included) as the tree's, so a partial page another request
    cached meanwhile was neither freed nor cached; 0.5.6 frees from cache_protected_len."""
    reports = _held_to_the_manifest(PARTIAL_PAGE)
    bad = reports["sglang==0.5.5.post3", "strict"]
    v = bad.first_violation
    assert (v.invariant, v.rule, v.method, v.call) == ("tree-owner", "row-leak", "checkpoint", 8009), v
    assert len(v.indices) == 2 and "request 43" in v.message, v
    assert {k for k in reports if k[0] == "sglang==0.5.6"} == {("sglang==0.5.6", "strict"), ("sglang==0.5.6", "remap")}


def test_the_unified_trees_releases_replay_pages_of_16_as_radix_cache_did():
    """Pages of 16 tokens on 0.5.19 (cache_finished_req) and 0.5.23 (the wire's era): the
    corpus' page-16 traces replay as the manifest says, the partial-page zoo trace clean
    (its bug was fixed in 0.5.6), and a trace of a tree that forgets rows with the
    recording's leak on 0.5.23. The unified tree frees a checkpoint's duplicates node by
    node; consecutive frees compare as one."""
    for release in ("0.5.19", "0.5.23"):
        for name, r in _replays([PARTIAL_PAGE, CORPUS / "tree-prefix-mooncake-100.parquet"],
                                f"sglang=={release}").items():
            assert r.status == "clean", (release, name, r.status, r.first_divergence, r.message)
    reports = _held_to_the_manifest(CORPUS / "tree-forgets-row-200.parquet")
    assert ("sglang==0.5.23", "strict") in reports


