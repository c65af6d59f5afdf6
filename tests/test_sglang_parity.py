"""The integration tier: real sglang allocators (run with scripts/sglang-tier.sh).

Skipped where sglang is not installed. Every corpus trace recorded on a builtin pool
replays on the installed sglang's own class (``--build sglang``, constructed with a
memory-free KV stand-in) in strict mode with identical results, counters and nested
calls, except where 0.5.23 is known to differ (#38519, see traces/README.md); and a
program driving a real sglang SWA allocator under ``kvreplay record`` leaves a trace
that replays clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.allocator.swa", reason="sglang not installed")

from kvreplay.families.sglang import release as sglang_adapter  # noqa: E402
from kvreplay.replay.dispatch import replay  # noqa: E402

pytestmark = pytest.mark.sglang
CORPUS = Path(__file__).resolve().parents[1] / "traces"


@pytest.mark.parametrize("trace", ["decode-1000", "disagg-mtp-2000", "disagg-mtp-azure-1000"])
def test_builtin_pools_choose_the_same_slots_as_sglang(trace):
    r = replay(CORPUS / f"{trace}.parquet", "sglang", mode="strict", device="cpu")
    assert r.calls_replayed > 1000
    assert r.status == "clean", (r.first_divergence, r.first_violation)


@pytest.mark.parametrize("trace", ["live-sglang-0.5.23-tree-mooncake60", "live-sglang-0.5.23-tree-retract32"])
def test_the_live_tree_traces_replay_strict_clean_on_sglangs_tree_and_the_builtin(trace):
    """sglang's own UnifiedRadixCache and kvreplay's tree hand out the same slots, nodes and
    lock handles through a server's traffic, retraction included."""
    for build in ("sglang", "builtin:tree"):
        r = replay(CORPUS / f"{trace}.parquet", build, mode="strict", device="cpu")
        assert r.status == "clean", (build, r.first_divergence, r.first_violation)
        assert r.calls_replayed > 1000


def test_the_sglang_build_is_the_installed_release_of_the_trace_family():
    assert sglang_adapter.spec_for("swa").endswith("allocator.swa:SWATokenToKVPoolAllocator")
    assert sglang_adapter.spec_for("paged").endswith(":PagedTokenToKVPoolAllocator")
    assert sglang_adapter.version() == "0.5.23"


@pytest.mark.parametrize("trace", ["radix-swa-800", "radix-swa-mooncake-600", "sglang-0.5.23-swa-page0"])
def test_sglang_0_5_23_frees_swa_page_0_like_the_unfiltered_page0_variant(trace):
    """A real finding: #38519 is not fixed in 0.5.23."""
    real = replay(CORPUS / f"{trace}.parquet", "sglang", device="cpu")
    variant = replay(CORPUS / f"{trace}.parquet", "builtin:swa@unfiltered-page0", device="cpu")
    assert real.first_violation is not None
    assert real.first_violation.call == variant.first_violation.call
    assert real.first_violation.method == variant.first_violation.method
    assert real.first_violation.method in ("free_swa_segment", "free_segment")
    assert (real.first_violation.invariant, real.first_violation.rule) == (
        variant.first_violation.invariant, variant.first_violation.rule)


def test_the_page0_variant_is_sglang_0_5_23_call_for_call_through_its_bug(tmp_path):
    """Recorded on builtin:swa@unfiltered-page0 up to its capacity assertion, the
    prefix-cache trace replays on real sglang with not one divergence: results,
    counters, nested calls and the final AssertionError all agree."""
    from kvreplay.errors import PoolFailed
    from kvreplay.workload.synth import SynthConfig, synthesize

    out = tmp_path / "t.parquet"
    with pytest.raises(PoolFailed):
        synthesize(SynthConfig(scenario="radix-swa", out=out, requests=20, seed=1,
                               build="builtin:swa@unfiltered-page0"))
    r = replay(out, "sglang", mode="strict", device="cpu")
    assert r.calls_replayed > 500
    assert r.divergence_counts == {}
    assert r.first_violation is not None


def test_sglang_0_5_23_alloc_decode_leaks_a_full_page_when_it_returns_none():
    """A real finding: the SWA alloc_decode asks both sub-allocators and keeps what
    the one that succeeded handed out."""
    r = replay(CORPUS / "sglang-0.5.23-decode-none-leak.parquet", "sglang", device="cpu")
    first = r.first_violation
    assert (first.call, first.method, first.invariant) == (3, "alloc_decode", "none-unchanged")
    assert "quiescence/leaked-page" in r.violation_counts
    assert replay(CORPUS / "sglang-0.5.23-decode-none-leak.parquet", "builtin:swa", device="cpu").status == "clean"


def test_a_program_driving_real_sglang_under_kvreplay_record_leaves_a_clean_trace(tmp_path):
    program = tmp_path / "drive.py"
    program.write_text(textwrap.dedent("""
        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from kvreplay.families.sglang.release import kv_standin
        from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model

        pool = SWATokenToKVPoolAllocator(512, 256, 4, torch.int64, "cpu", kv_standin(), True)
        cfg = SynthConfig(scenario="disagg-mtp", out=None, requests=80, full_size=512, swa_size=256)
        stats = run_model(pool, cfg, SCENARIOS["disagg-mtp"])
        print("requests done", stats.requests_done)
    """))
    out = tmp_path / "live"
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(out), "--json", "--",
                          sys.executable, str(program)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout[res.stdout.index("{"):])
    (trace,) = info["traces"]  # one allocator: its sub-allocators are nested rows, not traces
    for build in ("sglang", "builtin:swa"):
        r = replay(trace, build, mode="strict", device="cpu")
        assert r.calls_replayed > 500
        assert r.status == "clean", (build, r.first_divergence, r.first_violation)


def test_minimize_on_real_sglang_gives_a_short_reproducer_of_its_page0_bug(tmp_path):
    """#38519 on the installed sglang: a few calls, a pytest file that fails on sglang
    and passes on builtin:swa."""
    from kvreplay.jobs.minimize import minimize

    res = minimize(CORPUS / "radix-swa-800.parquet", "sglang", tmp_path / "m.parquet", reference="builtin:swa",
                   emit_test=tmp_path / "test_page0.py")
    assert res.calls_after <= 5 and res.failure.id == "ownership"
    assert replay(tmp_path / "m.parquet", "sglang", device="cpu").first_violation.invariant == "ownership"

    def run(build: str) -> int:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(tmp_path / "test_page0.py")], capture_output=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "KVREPLAY_BUILD": build}).returncode

    assert run("sglang") == 1
    assert run("builtin:swa") == 0


def _sglang_tree(components: tuple[str, ...], page_size: int):
    """A real 0.5.23 UnifiedRadixCache on CPU (a small pool; no model, no server)."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if "SWA" in components:
        kv = SWAKVPool(size=256, size_swa=128, page_size=page_size, dtype=torch.bfloat16, head_num=1, head_dim=8,
                       swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
        alloc = SWATokenToKVPoolAllocator(256, 128, page_size=page_size, dtype=torch.bfloat16, device="cpu",
                                          kvcache=kv, need_sort=False)
    else:
        alloc = TokenToKVPoolAllocator(256, torch.int64, "cpu", None, False)
    rows = ReqToTokenPool(size=4, max_context_len=512, device="cpu", enable_memory_saver=False)
    return UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc, page_size=page_size,
        sliding_window_size=32 if "SWA" in components else None,
        tree_components=tuple(getattr(ComponentType, c) for c in components), tree_core_backend="python"))


def _mamba_tree(states: int = 4):
    """sglang 0.5.23's own Mamba tree (components full and Mamba) as the release adapter
    builds it: the release's request pool class over a state slot allocator of ``states``."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from kvreplay.families.tree.release import ReleaseTree

    return ReleaseTree(UnifiedRadixCache, {"size": 64, "page_size": 1, "state_size": states, "state_grid": 1,
                                           "state_path_cap": -1})


def test_a_mamba_tree_hands_state_slots_as_the_server_does_and_the_wire_records_it(capfd):
    """A Mamba tree behind the wire: an admitted request holds a state slot, a finished
    request's checkpoint gives it to the node (no free), a later match that hits the node
    copies its state into a new slot, an eviction for states frees a node's. The wire
    takes such a tree (its state side as rows of target state, its settings in the
    constructor), and says in a line why not when the states live elsewhere."""
    from kvreplay.families.tree.live import LiveTreeWire, wire_for

    t = _mamba_tree()
    states: list[tuple[str, tuple]] = []
    alloc, free = t.state.alloc, t.state.free
    t.state.alloc = lambda n: states.append(("alloc", alloc(n))) or states[-1][1]
    t.state.free = lambda runs: states.append(("free", tuple(runs))) or free(runs)
    pages = (11, 12, 13, 14)
    assert t.match_prefix(1, pages, 4, cow=1) == (0, 0)
    t.group_states(2)
    t.hold_state(1)
    t.lock(1, 0)
    t.extend(1, t.kv.alloc(5))
    _, _, handle = t.checkpoint(1, (15,), 5, outputs=1)  # the lock moves to the new node
    t.free_kv_row(1, 5, 5)
    t.unlock(1, handle)
    t.release(1)
    t.ungroup_states()
    assert states == [("alloc", (1, 2)), ("alloc", (1, 1)), ("free", (2, 1))], states
    assert t.tree.mamba_evictable_size() == 1  # the node holds the finished request's state slot
    assert t.match_prefix(2, (*pages, 15, 16), 6, cow=1)[0] == 5  # a hit: its state copied on write
    assert states[-1] == ("alloc", (3, 1)) and int(t.requests[2].kv.mamba_pool_idx) == 3
    t.evict(0, state_num=1)
    assert states[-1] == ("free", (1, 1)) and t.tree.mamba_evictable_size() == 0

    wire = wire_for(_mamba_tree().tree)
    assert isinstance(wire, LiveTreeWire) and wire.state is not None and wire.swa is None
    assert {k: wire.ctor_args[k] for k in ("state_size", "state_grid", "state_path_cap")} == \
        {"state_size": 4, "state_grid": 1, "state_path_cap": -1}
    assert capfd.readouterr().err.count("kvreplay:") == 0
    buffered = _mamba_tree().tree
    buffered.enable_mamba_extra_buffer = True
    assert wire_for(buffered) is None
    said = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("kvreplay:")]
    assert len(said) == 1 and "extra (ping-pong) buffer" in said[0], said


def test_a_mamba_tree_that_keeps_a_finished_requests_state_slot_unfreed_is_named_at_the_checkpoint(monkeypatch):
    """The live Mamba trace on sglang's own tree made to forget one thing: a finished
    request whose node already has a state must free its own slot, and this tree does
    not. The slot is neither freed nor the node's: the checker names it at that
    checkpoint, on the state side, where the unpatched tree replays clean."""
    from sglang.srt.mem_cache.unified_cache.components import mamba

    from kvreplay.replay.dispatch import replay

    trace = Path(__file__).resolve().parents[1] / "traces" / "live-sglang-0.5.23-tree-mamba48.parquet"
    real = mamba.MambaComponent.cleanup_after_caching_req

    def forgets(self, req, is_finished, insert_result=None, insert_params=None):
        if is_finished and insert_result is not None and insert_result.mamba_exist:
            return None  # the request's slot stays named by nothing
        return real(self, req, is_finished, insert_result=insert_result, insert_params=insert_params)

    monkeypatch.setattr(mamba.MambaComponent, "cleanup_after_caching_req", forgets)
    r = replay(trace, "sglang", mode="strict", device="cpu")
    v = r.first_violation
    assert v is not None and (v.invariant, v.rule, v.method, v.sub_pool) == \
        ("tree-owner", "row-leak", "checkpoint", "state"), (v, r.first_divergence)
    assert "neither freed its state slot" in v.message, v.message


def test_the_tree_wire_records_plain_and_sliding_window_token_trees_and_says_in_a_line_why_not_others(capfd):
    """The wire records a plain tree and a sliding-window one (its window side as rows of
    target swa); a tree with a component it does not speak (Mamba's state), or a paged
    one, is left alone with one line on stderr saying why: recorded as what it is not,
    such a server would show slots lost that are not."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from kvreplay.families.tree.live import LiveTreeWire, wire_for

    plain = wire_for(_sglang_tree(("FULL",), 1))
    assert isinstance(plain, LiveTreeWire) and plain.swa is None
    windowed = wire_for(_sglang_tree(("FULL", "SWA"), 1))
    assert isinstance(windowed, LiveTreeWire) and windowed.swa is not None
    assert (windowed.ctor_args["sliding_window"], windowed.ctor_args["swa_size"]) == (32, 128)
    assert capfd.readouterr().err.count("kvreplay:") == 0
    stateful = _sglang_tree(("FULL", "SWA"), 1)
    stateful.tree_components = (*stateful.tree_components, ComponentType.MAMBA)  # what a Mamba hybrid's has too
    assert wire_for(stateful) is None
    said = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("kvreplay:")]
    assert len(said) == 1 and "components are FULL, SWA, MAMBA" in said[0], said
    assert wire_for(_sglang_tree(("FULL",), 16)) is None
    said = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("kvreplay:")]
    assert len(said) == 1 and "page size 1 only" in said[0], said
