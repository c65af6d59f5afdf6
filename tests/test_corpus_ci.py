"""kvreplay ci: a corpus replayed against one build, held to its manifest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1] / "traces"
SMALL = ["sglang-0.5.23-swa-page0", "sglang-0.5.23-decode-none-leak"]


@pytest.fixture
def corpus(tmp_path):
    """The two smallest SWA traces of the real corpus, with their manifest entries."""
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    manifest["traces"] = [e for e in manifest["traces"] if e["name"] in SMALL]
    for e in manifest["traces"]:
        shutil.copy(CORPUS / e["file"], tmp_path / e["file"])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return tmp_path


def _ci(cli, corpus, build, *extra):
    """``kvreplay ci`` in this process (the cases run in worker processes with -j 2)."""
    return cli("ci", str(corpus), "--build", build, "--db", str(corpus / "k.db"), *extra)


@pytest.mark.slow
def test_the_correct_pool_passes_and_the_junit_file_is_well_formed(corpus, cli):
    res = _ci(cli, corpus, "builtin:swa", "-j", "2", "--junit", str(corpus / "out.xml"), "--summary",
              str(corpus / "s.md"))
    assert res.returncode == 0, res.stdout + res.stderr
    root = ET.parse(corpus / "out.xml").getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    # the common JUnit schema: counts on the suite, name/classname/time on every case
    assert int(suite.get("tests")) == len(cases) == 4  # two traces, strict and remap each
    assert suite.get("failures") == "0" and suite.get("errors") == "0" and suite.get("skipped") == "0"
    for tc in cases:
        assert tc.get("name") and tc.get("classname") == "kvreplay.builtin:swa"
        float(tc.get("time"))
    assert "all expectations hold" in (corpus / "s.md").read_text()


def test_a_bug_variant_passes_when_it_is_caught_where_the_manifest_says(corpus, cli):
    res = _ci(cli, corpus, "builtin:swa@unfiltered-page0")
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_wrong_expectation_fails_and_says_which(corpus, cli):
    manifest = json.loads((corpus / "manifest.json").read_text())
    page0 = next(e for e in manifest["traces"] if e["name"] == "sglang-0.5.23-swa-page0")
    bad = next(x for x in page0["expect"] if x["build"] == "builtin:swa@unfiltered-page0")
    bad["violations"][0]["call"] = 222
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, corpus, "builtin:swa@unfiltered-page0", "--junit", str(corpus / "out.xml"))
    assert res.returncode == 1
    assert "sglang-0.5.23-swa-page0[strict]" in res.stdout and "#222" in res.stdout
    failure = ET.parse(corpus / "out.xml").getroot().find("testsuite/testcase/failure")
    assert failure is not None and "#222" in failure.get("message")


def test_a_known_bad_case_that_replays_clean_is_a_failure(corpus, cli):
    """The checker must keep its teeth: an expected violation that does not show fails."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    leak = next(e for e in manifest["traces"] if e["name"] == "sglang-0.5.23-decode-none-leak")
    leak["expect"].append({"build": "builtin:swa@stale-tail", "status": "violation",
                           "violations": [{"invariant": "swa-mapping"}]})
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, corpus, "builtin:swa@stale-tail", "--json")
    assert res.returncode == 1
    results = {r["case"]["trace"]: r for r in json.loads(res.stdout)["results"]}
    assert results["sglang-0.5.23-decode-none-leak"]["outcome"] == "fail"


@pytest.mark.slow
def test_the_pytest_plugin_makes_one_item_per_trace_and_mode(corpus, tmp_path_factory):
    here = tmp_path_factory.mktemp("project")
    # a project with tests of its own: given only --kvreplay-corpus, pytest runs the corpus alone
    (here / "test_unrelated.py").write_text("def test_unrelated():\n    raise AssertionError('collected')\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--kvreplay-corpus",
                          str(corpus), "--kvreplay-build", "builtin:swa"], cwd=here, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-2000:]
    # node ids are the manifest's path, then TRACE[MODE]
    ids = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("PASSED ")]
    assert all(i.split("::")[0].endswith("manifest.json") for i in ids), ids
    assert sorted(i.split("::", 1)[1] for i in ids) == [f"{t}[{m}]" for t in sorted(SMALL) for m in ("remap", "strict")]
    assert "test_unrelated" not in res.stdout


@pytest.mark.slow
def test_docs_ci_command_runs_from_the_repository_root(corpus):
    """docs/ci.md's pytest line where a contributor types it: the repository's own
    conftest and options (xdist, its slow marks) meet the corpus items and let them run."""
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--kvreplay-corpus", str(corpus),
                          "--kvreplay-build", "builtin:swa"], cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "INTERNALERROR" not in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]
    assert f"{2 * len(SMALL)} passed" in res.stdout, res.stdout[-500:]


@pytest.mark.slow
def test_the_pytest_plugin_fails_an_item_whose_expectation_does_not_hold(corpus, tmp_path_factory):
    manifest = json.loads((corpus / "manifest.json").read_text())
    for e in manifest["traces"]:
        e["expect"] = [{"build": "builtin:swa", "status": "violation", "violations": [{"invariant": "capacity"}]}]
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    here = tmp_path_factory.mktemp("empty")
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--kvreplay-corpus",
                          str(corpus), "--kvreplay-build", "builtin:swa"], cwd=here, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 1
    assert "2 failed" in res.stdout and "expected violation: capacity" in res.stdout


def test_a_divergence_expectation_holds_at_its_call_and_fails_elsewhere(tmp_path, cli):
    """A variant that breaks no rule but hands out other blocks (vLLM 0.27's free order)
    is held to its first divergence: kind, method and call."""
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    manifest["traces"] = [e for e in manifest["traces"] if e["name"] == "vllm-0.27-caching-off-free-order"]
    shutil.copy(CORPUS / manifest["traces"][0]["file"], tmp_path / manifest["traces"][0]["file"])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, tmp_path, "builtin:vllm@tail-with-caching-off")
    assert res.returncode == 0, res.stdout + res.stderr
    exp = next(x for x in manifest["traces"][0]["expect"] if x["build"] == "builtin:vllm@tail-with-caching-off")
    exp["divergence"]["call"] = 36
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, tmp_path, "builtin:vllm@tail-with-caching-off")
    assert res.returncode == 1 and "expected divergence: result at call #36" in res.stdout, res.stdout
    assert "first was result divergence at call #35" in res.stdout, res.stdout
    # the correct manager replays it clean: a divergence expected there would be a miss
    exp["build"] = "builtin:vllm"
    manifest["traces"][0]["expect"] = [exp]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, tmp_path, "builtin:vllm")
    assert res.returncode == 1 and "got clean" in res.stdout, res.stdout


def test_a_violation_expectation_may_pin_the_first_divergence_too(tmp_path, cli):
    """A build that breaks a rule and also answers otherwise (vLLM 0.32's deferred sibling
    hit beside its null-block count) is held to both: its violations and, where it first
    answered otherwise, its first divergence."""
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    manifest["traces"] = [e for e in manifest["traces"] if e["name"] == "vllm-11565-pin-before-room-check"]
    shutil.copy(CORPUS / manifest["traces"][0]["file"], tmp_path / manifest["traces"][0]["file"])
    build = "builtin:vllm@pin-before-room-check"
    exp = next(x for x in manifest["traces"][0]["expect"] if x["build"] == build)
    exp["divergence"] = {"kind": "counter", "method": "allocate_slots", "call": 1174}
    manifest["traces"][0]["expect"] = [exp]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, tmp_path, build)
    assert res.returncode == 0, res.stdout + res.stderr
    exp["divergence"]["call"] = 1175
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, tmp_path, build)
    assert res.returncode == 1 and "expected divergence: counter at call #1175" in res.stdout, res.stdout
    assert "first was counter divergence at call #1174" in res.stdout, res.stdout
    # a clean expectation names no divergence
    manifest["traces"][0]["expect"] = [{"build": build, "status": "clean", "divergence": {"kind": "result"}}]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    res = _ci(cli, tmp_path, build)
    assert res.returncode == 2 and "a clean expectation names no divergence" in res.stderr, res.stdout + res.stderr


def test_every_builtin_bug_variant_is_expected_to_be_caught_somewhere():
    """Mutation score: each variant has at least one corpus trace where it must show (a
    rule it breaks, or for one that breaks none, the call where it answers otherwise)."""
    from kvreplay.contract.registry import BUILTINS
    from kvreplay.corpus.manifest import load_manifest

    caught = {x.build for e in load_manifest(CORPUS) for x in e.expect if x.status != "clean"}
    variants = {f"builtin:{n}" for n in BUILTINS if "@" in n}
    assert variants <= caught, variants - caught


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_corpus_add_records_provenance_and_expectations_and_check_finds_problems(tmp_path):
    from kvreplay.corpus.manage import add_trace, check_corpus
    from kvreplay.errors import BadInput

    src = CORPUS / "sglang-0.5.23-swa-page0.parquet"
    entry = add_trace(src, "page0", tmp_path, ["builtin:swa", "builtin:swa@unfiltered-page0"])
    assert entry["command"].startswith("kvreplay synth radix-swa")  # provenance from the trace itself
    clean, caught = entry["expect"]
    assert clean == {"build": "builtin:swa", "status": "clean"}
    assert caught["status"] == "violation" and caught["violations"][0]["call"] == 223
    assert check_corpus(tmp_path).ok
    with pytest.raises(BadInput, match="already in"):
        add_trace(src, "page0", tmp_path)
    with pytest.raises(BadInput, match="over the corpus limit"):
        add_trace(src, "tiny", tmp_path, max_mb=0.001)
    # the manifest was not touched by the refused adds
    assert [e["name"] for e in json.loads((tmp_path / "manifest.json").read_text())["traces"]] == ["page0"]

    shutil.copy(src, tmp_path / "stray.parquet")
    (tmp_path / "page0.parquet").write_bytes((tmp_path / "page0.parquet").read_bytes()[:-100])
    problems = check_corpus(tmp_path).problems
    assert any("stray.parquet: no manifest entry" in p for p in problems)
    assert any("page0" in p and "changed" in p for p in problems)
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "corpus", "check", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "stray.parquet" in res.stdout


def test_corpus_add_takes_a_recordings_directory_of_one_part_and_refuses_many(tmp_path):
    # A recording leaves a directory of parts (rotation); added, it had been an internal error.
    from kvreplay.corpus.manage import add_trace
    from kvreplay.errors import BadInput

    src = CORPUS / "sglang-0.5.23-swa-page0.parquet"
    one = tmp_path / "rec" / "kvreplay-1-tp0pp0-0.parquet"
    one.mkdir(parents=True)
    shutil.copy(src, one / "part-000000.parquet")
    corpus = tmp_path / "corpus"
    entry = add_trace(one, "page0", corpus, ["builtin:swa"])
    assert entry["expect"] == [{"build": "builtin:swa", "status": "clean"}]
    assert (corpus / "page0.parquet").read_bytes() == src.read_bytes()
    shutil.copy(src, one / "part-000001.parquet")
    # (a copy of part 0 named part 1 is refused by the reader as a part out of place)
    with pytest.raises(BadInput, match="rotated trace of 2 parts|says it is part 0 of its recording"):
        add_trace(one, "two", corpus)
    assert not (corpus / "two.parquet").exists()


def test_a_worker_build_that_cannot_replay_a_trace_skips_it_unless_the_manifest_expects_otherwise(monkeypatch):
    """A release build answers "unsupported" in its report (a release before the pool
    kind existed), where a build in this process raises: both are a skip, not a
    failure. A case with an expectation is still held to it."""
    from kvreplay.corpus import ci
    from kvreplay.corpus.manifest import Expectation
    from kvreplay.jobs.stored_replay import StoredReplay
    from kvreplay.replay.report import untestable

    report = untestable("t.parquet", "sglang==0.5.3", "strict", "cpu", "unsupported",
                        "the tree's wire speaks sglang 0.5.1 to 0.5.5", 0.1)
    monkeypatch.setattr(ci, "replay_and_store", lambda *a, **k: StoredReplay(report=report, run_id=None))
    case = ci.Case("t", "t.parquet", "", "sglang==0.5.3", "strict", None)
    got = ci._run_case(case, "cpu", 0.0).result
    assert got.outcome == "skip" and "0.5.1 to 0.5.5" in got.problems[0], got
    expected = ci._run_case(ci.Case("t", "t.parquet", "", "sglang==0.5.3", "strict",
                                    Expectation(build="sglang==0.5.3", status="clean")), "cpu", 0.0).result
    assert expected.outcome == "fail", expected
