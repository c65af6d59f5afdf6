"""Replay engine: modes, divergences, the checker's findings, exit codes."""

from __future__ import annotations

import pytest

from kvreplay.corpus.expectations import check_report
from kvreplay.corpus.manifest import Expectation, ExpectedViolation
from kvreplay.errors import BadInput, BuildUnloadable
from kvreplay.replay.dispatch import replay
from kvreplay.workload.synth import SynthConfig, synthesize


@pytest.fixture(scope="module")
def decode_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "decode.parquet"
    synthesize(SynthConfig(scenario="decode", out=out, requests=120, full_size=512))
    return out


@pytest.fixture(scope="module")
def disagg_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "disagg.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=out, requests=300))
    return out


def test_correct_pool_replays_clean_in_both_modes(decode_trace):
    for mode in ("strict", "remap"):
        r = replay(decode_trace, "builtin:paged", mode=mode, device="cpu")
        assert r.status == "clean" and r.exit_code == 0
        assert r.calls_replayed > 500 and r.held_at_end == {"pool": 0}


def test_other_free_policy_diverges_in_strict_and_replays_clean_in_remap(decode_trace):
    strict = replay(decode_trace, "py:pool_policies:HighPagesFirstPagedPool", mode="strict", device="cpu")
    # strict: the first allocation differs, and later recorded frees then name pages
    # the build never handed out, which the checker also reports
    assert strict.exit_code == 1 and strict.first_divergence.kind == "result"
    assert strict.first_divergence.method == "alloc_extend" and strict.first_divergence.call <= 2
    remap = replay(decode_trace, "py:pool_policies:HighPagesFirstPagedPool", mode="remap", device="cpu")
    assert remap.status == "clean", (remap.violation_counts, remap.divergence_counts)


def test_missing_method_stops_the_replay_as_unsupported_not_a_crash(decode_trace):
    r = replay(decode_trace, "py:pool_policies:NoDecodePagedPool", mode="remap", device="cpu")
    assert r.divergence_counts == {"unsupported": 1} and r.stopped_early
    assert r.first_divergence.kind == "unsupported" and r.first_divergence.method == "alloc_decode"
    assert r.status == "unsupported" and r.exit_code == 125
    assert f"no method alloc_decode and no translation applies (call #{r.first_divergence.call})" in r.message
    assert r.calls_replayed == r.first_divergence.call


def test_a_method_the_build_lacks_is_replayed_through_its_translation(decode_trace, disagg_trace):
    paged = replay(decode_trace, "py:pool_policies:NoSegmentFreePagedPool", mode="remap", device="cpu")
    assert paged.status == "clean", (paged.divergence_counts, paged.violation_counts)
    assert paged.translated.get("free_segments", 0) > 0
    swa = replay(disagg_trace, "py:pool_policies:OldAPISWAPool", mode="remap", device="cpu")
    assert swa.status == "clean", (swa.first_divergence, swa.first_violation)
    assert {"free_swa_segment", "free_segments", "free_full_segments"} <= set(swa.translated)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_an_older_swa_surface_replays_the_prefix_cache_through_translations(tmp_path_factory):
    from kvreplay.workload.synth import SynthConfig, synthesize

    radix = tmp_path_factory.mktemp("t") / "radix.parquet"
    synthesize(SynthConfig(scenario="radix-swa", out=radix, requests=300))
    r = replay(radix, "py:pool_policies:PreMappingAPISWAPool", mode="remap", device="cpu")
    assert r.status == "clean", (r.first_divergence, r.first_violation)
    assert {"set_full_to_swa_mapping", "clear_full_to_swa_mapping", "available_size"} & set(r.translated)


def test_a_method_with_no_usable_translation_is_unsupported(disagg_trace):
    r = replay(disagg_trace, "py:pool_policies:NoSWAFreeSWAPool", mode="remap", device="cpu")
    assert r.first_divergence.kind == "unsupported" and r.first_divergence.method == "free_swa_segment"
    assert "no translation applies" in r.first_divergence.message


def test_stale_tail_is_flagged_at_the_source_calls(disagg_trace):
    r = replay(disagg_trace, "builtin:swa@stale-tail", device="cpu")
    assert r.status == "violation"
    first = r.first_violation
    assert (first.invariant, first.rule, first.method) == ("swa-mapping", "released-page-keeps-peer", "free_segments")
    assert first.detected_call >= first.call  # found at its group's end, reported at the free
    rules = {(v.rule, v.method) for v in r.violations}
    assert ("tail-prealloc-nontail-mapped", "alloc_extend_swa_tail") in rules
    assert ("shared-swa-slot", "alloc_extend_swa_tail") in rules


def test_stop_first_stops_at_the_first_finding(disagg_trace):
    full = replay(disagg_trace, "builtin:swa@stale-tail", device="cpu")
    first = replay(disagg_trace, "builtin:swa@stale-tail", device="cpu", stop_at_first=True)
    assert first.stopped_early and first.calls_replayed < full.calls_replayed
    assert first.first_violation.call == full.first_violation.call


def test_go_on_keeps_every_rule_and_counts_repeats(disagg_trace):
    r = replay(disagg_trace, "builtin:swa@stale-tail", device="cpu", keep=2)
    kept = {}
    for v in r.violations:
        kept[(v.invariant, v.rule)] = kept.get((v.invariant, v.rule), 0) + 1
    assert all(n <= 2 for n in kept.values())
    assert sum(r.violation_counts.values()) > len(r.violations)


def test_a_build_that_raises_where_the_recording_did_not_is_an_exception_divergence(tmp_path):
    # builtin:swa@stale-tail raises sglang's capacity assertion once SWA pages are double freed
    out = tmp_path / "walk.parquet"
    import torch

    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.recorder.recording import record

    def t(*v):
        return torch.tensor(v, dtype=torch.int64)

    pool = SWAPool(20, 12, 4, need_sort=True)
    with record(pool, out):
        a = pool.alloc_extend(t(0), t(0), t(6), t(6), t(-1), 6)
        over = pool.alloc_extend(t(6), t(6), t(12), t(12), a[-1:], 6)
        row = torch.cat([a, over])
        pool.free_group_begin()
        pool.free_segment(row[:7], start_pos=0)
        pool.free(row[8:12])
        pool.free_group_end()
        b = pool.alloc_extend_swa_tail(t(0), t(0), t(12), t(12), t(-1), 12, 4)
        c = pool.alloc_extend(t(0), t(0), t(8), t(8), t(-1), 8)
        pool.free(b)
        pool.free(c)
    r = replay(out, "builtin:swa@stale-tail", device="cpu")
    # docs/design.md: flagged at A's free (slot 11 keeps SWA slot 11) ...
    fv = r.first_violation
    assert (fv.method, fv.rule, fv.indices) == ("free_segment", "released-page-keeps-peer", [11])
    # ... and again at B's tail preallocation, long before sglang's own assertion
    at_b = [v for v in r.violations if v.method == "alloc_extend_swa_tail"]
    assert {v.rule for v in at_b} >= {"tail-prealloc-nontail-mapped"}
    assert any(v.rule == "shared-swa-slot" and v.method == "alloc_extend" for v in r.violations)  # C takes slot 11
    assert r.divergence_counts.get("exception") == 1
    assert r.capacity_assert_call is not None and r.capacity_assert_after_calls > 0
    clean = replay(out, "builtin:swa", device="cpu")
    assert clean.status == "clean"


def test_bad_builds_and_mismatched_families(decode_trace):
    with pytest.raises(BadInput, match="unknown build"):
        replay(decode_trace, "builtin:nope")
    with pytest.raises(BadInput, match="records a paged pool but builtin:swa is a swa pool"):
        replay(decode_trace, "builtin:swa")
    with pytest.raises(BuildUnloadable):
        replay(decode_trace, "py:no_such_module_here:Pool")
    with pytest.raises(BadInput, match="unknown mode"):
        replay(decode_trace, "builtin:paged", mode="fuzzy")


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_expectations_catch_a_checker_that_lost_its_teeth(disagg_trace):
    r = replay(disagg_trace, "builtin:swa@stale-tail", device="cpu")
    good = Expectation("builtin:swa@stale-tail", "violation",
                       violations=[ExpectedViolation("swa-mapping", "released-page-keeps-peer", "free_segments",
                                                     r.first_violation.call)])
    assert check_report(r, good) == []
    late = Expectation("x", "violation", violations=[ExpectedViolation("swa-mapping", "released-page-keeps-peer",
                                                                       call=r.first_violation.call + 1)])
    assert check_report(r, late) and "first reported at" in check_report(r, late)[0]
    clean = replay(disagg_trace, "builtin:swa", device="cpu")
    assert check_report(clean, good) == ["expected violations, got none: the checker missed the bug"]
    assert check_report(r, Expectation("x", "clean")) != []


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_remap_translates_swa_slots_for_an_swa_build_with_another_policy():
    # radix-swa re-points mappings with set_full_to_swa_mapping(full, swa): remap must
    # translate the recorded SWA slots too (learned from the nested SWA allocations)
    from pathlib import Path

    trace = Path(__file__).resolve().parents[1] / "traces" / "radix-swa-800.parquet"
    build = "py:pool_policies:HighPagesFirstSWAPool"
    remap = replay(trace, build, mode="remap", device="cpu")
    assert remap.status == "clean", (remap.first_violation, remap.first_divergence)
    strict = replay(trace, build, mode="strict", device="cpu", stop_at_first=True)
    assert strict.exit_code == 1 and strict.first_divergence.kind == "result"


def test_the_replayer_and_diff_share_one_remap_equality(decode_trace):
    """replay/compare.py's remap_difference is the one definition: the replayer and
    diff agree on a build that returns a list where the recording has an index tensor
    (the replayer's own inline rule let that through before)."""
    import torch

    from kvreplay.replay.compare import alike, remap_difference
    from kvreplay.replay.diff import diff_builds

    assert remap_difference(torch.arange(3), [0, 1, 2]) is not None and not alike(torch.arange(3), [0, 1, 2])
    assert alike(torch.arange(3), torch.arange(5, 8)) and not alike(None, torch.arange(1))
    r = replay(decode_trace, "py:pool_policies:ListResultPagedPool", mode="remap", device="cpu")
    assert r.first_divergence is not None and r.first_divergence.kind == "result"
    assert r.first_divergence.method == "alloc_extend"
    d = diff_builds(decode_trace, "builtin:paged", "py:pool_policies:ListResultPagedPool", mode="remap")
    assert d.first is not None and d.first.call == r.first_divergence.call
