"""kvreplay minimize: a failing trace shrunk to a few calls, and a pytest reproducer."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvreplay.contract.registry import family
from kvreplay.jobs.minimize import Subject, minimize
from kvreplay.replay.dispatch import replay
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SynthConfig, synthesize

TRACES = Path(__file__).resolve().parent.parent / "traces"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvreplay.cli.app", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def _pytest(path: Path, build: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=path.parent,
                          env={**os.environ, "KVREPLAY_BUILD": build})


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "t.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=out, requests=60, full_size=512, swa_size=256))
    return out


@pytest.mark.slow
def test_the_seed_bug_trace_shrinks_to_a_reproducer_that_fails_only_on_the_bug(tmp_path):
    out, test_file = tmp_path / "min.parquet", tmp_path / "test_repro.py"
    res = _cli("minimize", str(TRACES / "disagg-mtp-2000.parquet"), "--build", "builtin:swa@stale-tail",
               "-o", str(out), "--emit-test", str(test_file), "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["calls_before"] > 30_000 and d["calls_after"] <= 20, d
    assert d["wall_s"] < 60 and not d["timed_out"]
    assert d["failure"] == {"kind": "violation", "id": "swa-mapping", "method_kind": "free", "rule": None}
    assert d["reference"] == "builtin:swa"

    # The minimal trace is a real trace: it replays strict on the bug variant with the
    # same failure, and clean on the fixed pool.
    bad = replay(out, "builtin:swa@stale-tail", device="cpu")
    assert bad.first_violation.invariant == "swa-mapping" and bad.first_violation.method.startswith("free")
    assert sum(1 for _ in TraceReader(out).top_calls()) == d["calls_after"]
    assert replay(out, "builtin:swa", device="cpu").violation_counts.keys() <= {"quiescence/orphan-swa-slot",
                                                                                "quiescence/leak"}
    # The reproducer: fails on the variant at the call that breaks the invariant, passes on builtin:swa.
    source = test_file.read_text()
    assert "CheckedPool(BUILD" in source and "# on builtin:swa@stale-tail: swa-mapping/" in source
    failing = _pytest(test_file, "builtin:swa@stale-tail")
    assert failing.returncode == 1 and "swa-mapping/" in failing.stdout, failing.stdout[-2000:]
    passing = _pytest(test_file, "builtin:swa")
    assert passing.returncode == 0, passing.stdout[-2000:]


@pytest.mark.slow_cases(
    "sglang-0.5.23-swa-page0-builtin:swa@unfiltered-page0",
    "radix-swa-800-builtin:swa@deferred-lookup",
)
@pytest.mark.parametrize("name,variant", [
    ("radix-swa-800", "builtin:swa@deferred-lookup"),
    ("sglang-0.5.23-swa-page0", "builtin:swa@unfiltered-page0")])
def test_other_corpus_bugs_shrink_too(name, variant, tmp_path):
    res = minimize(TRACES / f"{name}.parquet", variant, tmp_path / "m.parquet", emit_test=tmp_path / "test_m.py")
    assert res.calls_after <= 20 and res.failure.id == "ownership"
    assert _pytest(tmp_path / "test_m.py", variant).returncode == 1
    assert _pytest(tmp_path / "test_m.py", "builtin:swa").returncode == 0


def test_removing_calls_keeps_a_trace_that_makes_sense(small_trace):
    """Whatever allocations are dropped, what is left never frees or extends a slot
    nobody handed out: on the correct pool it breaks no invariant but leaks."""
    from kvreplay.jobs.minimize import Dependencies

    subject = Subject(small_trace, "builtin:swa")
    subject.calls = list(subject.reader.top_calls())
    subject.deps = deps = Dependencies(subject.calls, 512 + 4, 4, family("swa").vocabulary)
    allocs = [i for i, tc in enumerate(subject.calls) if tc.call.method.startswith("alloc")]
    rng = random.Random(7)
    everything = list(range(len(subject.calls)))
    for _ in range(5):
        kept = deps.without(everything, rng.sample(allocs, len(allocs) // 3))
        assert len(kept) < len(everything)
        r = subject._replayer(build="builtin:swa")
        for _ in subject.drive(r, kept):
            pass
        found = {f"{k[0]}/{k[1]}" for k in r.checker.log.counts}
        assert {f for f in found if not f.startswith("quiescence")} == set(), found
        # free groups stay balanced
        methods = [subject.calls[i].call.method for i in kept]
        assert kept == deps.without(kept, [])
        assert methods.count("free_group_begin") == methods.count("free_group_end")


def test_dropping_an_allocation_drops_the_calls_that_name_its_slots(small_trace):
    from kvreplay.jobs.minimize import Dependencies

    calls = list(TraceReader(small_trace).top_calls())
    deps = Dependencies(calls, 516, 4, family("swa").vocabulary)
    first_alloc = next(i for i, tc in enumerate(calls) if tc.call.method.startswith("alloc"))
    kept = deps.without(list(range(len(calls))), [first_alloc])
    dropped = set(range(len(calls))) - set(kept)
    assert first_alloc in dropped and len(dropped) > 1
    assert any(calls[i].call.method.startswith("free") for i in dropped)
    begin = next(i for i, tc in enumerate(calls) if tc.call.method == "free_group_begin")
    assert deps.partner[begin] in set(range(len(calls))) - set(deps.without(list(range(len(calls))), [begin]))


def test_timeout_writes_the_smallest_trace_found_so_far(tmp_path):
    res = minimize(TRACES / "disagg-mtp-2000.parquet", "builtin:swa@stale-tail", tmp_path / "m.parquet",
                   timeout_s=0.0)
    assert res.timed_out and res.calls_after >= 1
    assert replay(tmp_path / "m.parquet", "builtin:swa@stale-tail", device="cpu").status == "violation"


def test_bad_minimize_input_is_a_one_line_error(small_trace, tmp_path, cli):
    cases = [
        [str(small_trace), "--build", "builtin:swa", "-o", str(tmp_path / "m.parquet")],  # nothing fails
        [str(small_trace), "--build", "builtin:swa@stale-tail", "-o", str(small_trace)],
        [str(small_trace), "--build", "git:.@HEAD", "-o", str(tmp_path / "m.parquet")],
        [str(small_trace), "--build", "builtin:swa@stale-tail", "--reference", "builtin:swa@stale-tail",
         "-o", str(tmp_path / "m.parquet")],
        [str(tmp_path / "missing.parquet"), "--build", "builtin:swa@stale-tail", "-o", str(tmp_path / "m.parquet")],
        [str(small_trace), "--build", "builtin:swa@stale-tail", "-o", str(tmp_path / "no" / "m.parquet")],
    ]
    for args in cases:
        res = cli("minimize", *args)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, (args, res.stderr)
    assert not (tmp_path / "m.parquet").exists()
