"""The saved corpus: every trace replays as its manifest says, on every build it names.

Correct builtin pools replay clean (strict and remap); every bug variant trips the
invariant the manifest names, first at the call that creates the bad state."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreplay.contract.registry import BUILTINS, family
from kvreplay.corpus.expectations import check_report
from kvreplay.corpus.manifest import load_manifest
from kvreplay.replay.dispatch import replay
from kvreplay.trace.hashing import content_hash as sha256_of
from kvreplay.trace.reader import TraceReader
from kvreplay.trace.summary import summarize

CORPUS = Path(__file__).resolve().parents[1] / "traces"
ENTRIES = load_manifest(CORPUS)
# The builtin builds' expectations only: one on an engine's release (vllm==0.32.0) is the vLLM tier's.
CASES = [(e, x, mode) for e in ENTRIES for x in e.expect for mode in x.modes if x.build.startswith("builtin:")]
# A case on a corpus trace of more than this many calls is in the slow tier (.ci/run's
# kvreplay ci step replays those expectations too).
SMALL_CALLS = 6_000
_BIG = {e.name for e in ENTRIES if TraceReader(e.file).count_calls() > SMALL_CALLS}


def _tiered(cases: list[tuple], ids: list[str]) -> list:
    return [pytest.param(*c, id=i, marks=[pytest.mark.slow] if c[0].name in _BIG else []) for c, i in
            zip(cases, ids, strict=True)]


def test_manifest_files_exist_match_their_hash_and_stay_small():
    names = {e.file.name for e in ENTRIES}
    assert names == {p.name for p in CORPUS.glob("*.parquet")}
    for e in ENTRIES:
        assert e.file.stat().st_size < 5 * 1024 * 1024, e.name
        assert sha256_of(e.file) == e.sha256, f"{e.name} changed without its manifest entry"
        # Reproducible: made by the workload model, minimized from a corpus trace (deterministic),
        # or by a script in scripts/ for hand-built cases.
        # Live recordings (live-*) are kept as a real server left them: its timing makes
        # every recording different, so their command says how, not what, to rebuild.
        made = ("kvreplay synth ", "kvreplay minimize traces/", "python scripts/")
        assert e.command.startswith(("kvreplay record ",) if e.name.startswith("live-") else made), e.command


def test_corpus_has_a_disagg_mtp_trace_of_2000_requests():
    s = summarize(CORPUS / "disagg-mtp-2000.parquet")
    assert s.calls_per_method["alloc_extend_swa_tail"] >= 2000
    assert s.meta["extra"]["synth"]["requests"] == 2000


@pytest.mark.parametrize("entry, exp, mode", _tiered(CASES, [f"{e.name}-{x.build.removeprefix('builtin:')}-{m}"
                                                             for e, x, m in CASES]))
def test_corpus_expectation(entry, exp, mode):
    report = replay(entry.file, exp.build, mode=mode, device="cpu")
    assert check_report(report, exp) == []


# The C index kernels serve the slot checker (sglang's pools); a block pool's checker has none.
BUGGY = [(e, b) for n, b in sorted({(e.name, x.build) for e in ENTRIES for x in e.expect
                                    if x.status == "violation" and x.build.startswith("builtin:")})
         for e in ENTRIES if e.name == n and family(BUILTINS[b.removeprefix("builtin:")].family).slots]


@pytest.mark.parametrize("entry, build", _tiered(BUGGY, [f"{e.name}-{b.removeprefix('builtin:')}" for e, b in BUGGY]))
def test_native_and_numpy_checkers_find_the_same_violations(entry, build, monkeypatch):
    """The C index kernels are an optimisation: the numpy fallback must report the
    same violations, in the same order, with the same indices and counts."""
    from kvreplay.check import kernels

    if kernels.native is None:
        pytest.skip("native shadow kernels not built")
    used: list[str] = []

    class Counting:  # the C module, counting its calls: the fast replay must go through it
        def __getattr__(self, name):
            used.append(name)
            return getattr(native, name)

    native = kernels.native
    monkeypatch.setattr(kernels, "native", Counting())
    fast = replay(entry.file, build, mode="strict", device="cpu")
    assert used, "the C kernels were not used"
    monkeypatch.setattr(kernels, "native", None)
    slow = replay(entry.file, build, mode="strict", device="cpu")
    assert fast.violations, "a bug variant must be caught"
    assert [vars(v) for v in fast.violations] == [vars(v) for v in slow.violations]
    assert fast.violation_counts == slow.violation_counts
