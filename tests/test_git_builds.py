"""git: builds: pool code at a revision, replayed in its own worker process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from git_repos import commit_all, new_repo

from kvreplay.replay.dispatch import replay

GOOD = "from kvreplay.families.sglang.swa import SWAPool as Pool\n"
BUGGY = "from kvreplay.families.sglang.variants import StaleTailSWAPool as Pool\n"
BROKEN = "from kvreplay.families.sglang.swa import SWAPool as Pool\nimport no_such_module_kvreplay\n"
CRASH = "import os\nfrom kvreplay.families.sglang.swa import SWAPool\n\n\nclass Pool(SWAPool):\n" \
        "    def alloc_extend(self, *a, **k):\n        os.abort()\n"
LATE_CRASH = "import os\nfrom kvreplay.families.sglang.variants import StaleTailSWAPool\n\n\n" \
             "class Pool(StaleTailSWAPool):\n" \
             "    n = 0\n\n    def free_group_begin(self):\n        Pool.n += 1\n" \
             "        if Pool.n == 400:\n            os.abort()\n        return super().free_group_begin()\n"
HANG = "import time\nfrom kvreplay.families.sglang.swa import SWAPool\n\n\nclass Pool(SWAPool):\n" \
       "    def alloc_extend(self, *a, **k):\n        time.sleep(600)\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("poolrepo")
    new_repo(repo, "t", "t@example.com")
    for tag, body in (("good", GOOD), ("buggy", BUGGY), ("broken", BROKEN), ("crash", CRASH), ("hang", HANG),
                      ("late-crash", LATE_CRASH)):
        (repo / "mypool.py").write_text(body)
        commit_all(repo, tag, tag=tag)
    return repo


@pytest.fixture
def trace(swa_trace_80):
    return swa_trace_80


@pytest.fixture(autouse=True)
def _cache(git_tree_cache):
    pass


@pytest.mark.slow
def test_two_revisions_replay_in_their_own_processes(repo, trace):
    good = replay(trace, f"git:{repo}@good:mypool:Pool", device="cpu")
    buggy = replay(trace, f"git:{repo}@buggy:mypool:Pool", device="cpu")
    assert good.status == "clean" and good.calls_replayed > 500
    assert buggy.status == "violation" and buggy.first_violation.invariant == "swa-mapping"
    assert buggy.build == f"git:{repo}@buggy:mypool:Pool"
    # the worker's timeline crosses the process boundary: the report draws a git: build too
    assert sum(map(len, buggy.timeline["marks"]["violation"].values())) == sum(buggy.violation_counts.values())
    assert any(v is not None for v in good.timeline["hi"]["full"])


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_broken_revision_is_unloadable_with_exit_125_and_is_stored(repo, trace, tmp_path, cli):
    db = tmp_path / "k.db"
    res = cli("replay", str(trace), "--build", f"git:{repo}@broken:mypool:Pool", "--db", str(db), "--json")
    assert res.returncode == 125, res.stderr
    d = json.loads(res.stdout)
    assert d["status"] == "unloadable" and "no_such_module_kvreplay" in d["message"]
    shown = cli("runs", "--db", str(db), "--json")
    assert json.loads(shown.stdout)[0]["status"] == "unloadable"


@pytest.mark.slow
def test_a_crashing_or_hanging_build_does_not_take_kvreplay_down(repo, trace):
    crashed = replay(trace, f"git:{repo}@crash:mypool:Pool", device="cpu")
    assert crashed.status == "crashed" and crashed.exit_code == 125
    hung = replay(trace, f"git:{repo}@hang:mypool:Pool", device="cpu", timeout_s=5)
    assert hung.status == "timeout" and "5 s" in hung.message and hung.exit_code == 125


@pytest.mark.slow
def test_a_native_crash_says_what_killed_it_and_where_and_the_next_trace_gets_a_fresh_worker(repo, trace):
    from kvreplay.replay.worker import replay_many_in_worker

    # The pool aborts at its 400th free group in a worker: during the second trace.
    reports, _ = replay_many_in_worker([trace, trace, trace], f"git:{repo}@late-crash:mypool:Pool", device="cpu")
    assert [r.status for r in reports] == ["violation", "crashed", "violation"]
    msg = reports[1].message
    assert "killed by SIGABRT" in msg and "in call #" in msg and "free_group_begin" in msg, msg
    assert "first violation before it: swa-mapping/" in msg, msg


def test_the_tree_is_exported_once_per_commit_and_reused(repo, tmp_path_factory):
    from kvreplay.builds.git_tree import tree_at

    commit, first = tree_at(repo, "good")
    again = tree_at(repo, "good")[1]
    assert first == again and (first / "mypool.py").read_text() == GOOD
    assert len(commit) == 40


def test_bad_git_specs_are_one_line_errors(repo, trace, cli):
    for spec in (f"git:{repo}", f"git:{repo}@no-such-rev", "git:/no/such/repo@HEAD", f"git:{repo}@good:nocolon"):
        res = cli("replay", str(trace), "--build", spec, "--no-store")
        assert res.returncode == 2, (spec, res.stderr)
        assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, res.stderr


COUNTED = "import os\nfrom kvreplay.families.sglang.swa import SWAPool as Pool\n\n" \
          "with open(os.environ['KVREPLAY_TEST_IMPORTS'], 'a') as _f:\n    _f.write('imported\\n')\n"


@pytest.mark.slow
def test_ci_on_a_worker_build_imports_it_once_per_lane_not_once_per_case(tmp_path, trace, monkeypatch):
    """`kvreplay ci` on a git: or release build: a release's import costs more than most
    replays, so the cases, each in its mode, are dealt to ``jobs`` lanes of one worker each. A trace
    of another family is skipped where it comes, and the lane goes on in a new worker;
    results come back in the manifest's order."""
    import hashlib
    import shutil

    from kvreplay.corpus.ci import run_corpus

    repo = tmp_path / "counted"
    new_repo(repo, "t", "t@example.com")
    (repo / "mypool.py").write_text(COUNTED)
    commit_all(repo, "counted", tag="counted")
    build = f"git:{repo}@counted:mypool:Pool"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    entries = []
    tree = Path(__file__).resolve().parents[1] / "traces" / "tree-forgets-row-200.parquet"
    for name, src, modes in (("a", trace, ["strict", "remap"]), ("tree", tree, ["strict"]),
                             ("b", trace, ["strict", "remap"]), ("c", trace, ["strict"])):
        shutil.copy(src, corpus / f"{name}.parquet")
        entries.append({"name": name, "file": f"{name}.parquet",
                        "sha256": hashlib.sha256((corpus / f"{name}.parquet").read_bytes()).hexdigest(),
                        "expect": [{"build": build, "status": "clean", "modes": modes}]})
    (corpus / "manifest.json").write_text(json.dumps({"version": 2, "traces": entries}))
    imports = tmp_path / "imports.txt"
    monkeypatch.setenv("KVREPLAY_TEST_IMPORTS", str(imports))
    results = run_corpus(corpus, build, jobs=1, db="")
    assert [(r.case.trace, r.case.mode, r.outcome) for r in results] == [
        ("a", "strict", "pass"), ("a", "remap", "pass"), ("tree", "strict", "skip"), ("b", "strict", "pass"),
        ("b", "remap", "pass"), ("c", "strict", "pass")], [(r.case.name, r.outcome, r.problems) for r in results]
    assert "records a tree pool" in results[2].problems[0], results[2].problems
    # a in both modes, then the tree trace ends that worker; b (both modes) and c in a new one
    assert imports.read_text().count("imported") == 2, imports.read_text()
    assert all(r.calls > 500 for r in results if r.outcome == "pass")
