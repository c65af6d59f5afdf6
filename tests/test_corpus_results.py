"""The corpus replays to the same reports as before a change of the shared code (issue 61:
the family contract moved sglang's replayer, checker and vocabulary out of the shared
modules; the results must not move with them).

tests/data/corpus-results.json holds, per (trace, builtin build, mode) of the corpus
manifest, a digest of the replay's whole report less its timings, taken by the code
before the move. Each case replays and compares. A change that means to alter what a
replay reports rewrites the file on purpose:

    python tests/test_corpus_results.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "traces"
GOLDEN = Path(__file__).resolve().parent / "data" / "corpus-results.json"
TIMINGS = {"wall_s", "cpu_s", "calls_per_s", "trace"}  # what differs run to run, and where the file lies
MAX_BYTES = 300_000  # the slow tier replays the corpus's small traces; `kvreplay ci` in .ci/run all of it


def _without_timings(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, (list, tuple)):
        return [_without_timings(v) for v in value]
    if isinstance(value, str):
        # an assertion's first line: under pytest, kvreplay's own asserts (a pytest plugin's
        # package) explain themselves on the lines after it
        return value.split("\n", 1)[0]
    return value


def digest(report: object) -> str:
    plain = json.loads(json.dumps(_without_timings(report.to_dict()), default=str))
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:20]


def cases() -> list[tuple[str, str, str]]:
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    return [(t["file"], e["build"], mode) for t in manifest["traces"] for e in t["expect"]
            if e["build"].startswith("builtin:") for mode in e.get("modes", ["strict"])]


def _replay(file: str, build: str, mode: str) -> object:
    from kvreplay.replay.dispatch import replay

    return replay(str(CORPUS / file), build, mode=mode)


def _key(file: str, build: str, mode: str) -> str:
    return f"{file} {build} {mode}"


SMALL = [c for c in cases() if (CORPUS / c[0]).stat().st_size <= MAX_BYTES]


def test_every_case_has_a_digest_and_the_small_ones_are_enough_to_matter():
    golden = json.loads(GOLDEN.read_text())
    assert {_key(*c) for c in cases()} <= set(golden)
    assert len(SMALL) >= 20 and {b.partition("@")[0] for _, b, _ in SMALL} >= {"builtin:swa", "builtin:vllm",
                                                                                 "builtin:mamba"}


@pytest.mark.slow
@pytest.mark.parametrize(("file", "build", "mode"), SMALL, ids=[_key(*c) for c in SMALL])
def test_a_corpus_replay_reports_what_it_reported_before(file, build, mode):
    golden = json.loads(GOLDEN.read_text())
    report = _replay(file, build, mode)
    assert digest(report) == golden[_key(file, build, mode)], (
        f"{file} on {build} ({mode}) now reports {report.status} with {report.violation_counts} and "
        f"{report.divergence_counts}: not what it reported before (python tests/test_corpus_results.py --write "
        "if the change means it)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_corpus_results.py --write")
    GOLDEN.write_text(json.dumps({_key(*c): digest(_replay(*c)) for c in cases()}, indent=1, sort_keys=True) + "\n")
