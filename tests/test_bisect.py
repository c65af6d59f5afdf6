"""kvreplay bisect: the first commit (or build) that breaks a trace."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from git_repos import commit_all, git, new_repo

from kvreplay.jobs.bisect import bisect, build_candidates, git_candidates
from kvreplay.replay.report import Failure

N_COMMITS = 30  # after the good root commit
BROKEN_AT = 15  # this commit does not import; the next one mends it
CULPRIT_AT = 23  # this commit brings the stale-tail bug back

POOL_GOOD = '''"""A small SWA pool package, as a pool engineer's repository would hold it."""

import torch

from kvreplay.families.sglang.swa import SWAPool


class Pool(SWAPool):
    def _mapping_to_clear(self, free_index: torch.Tensor) -> torch.Tensor:
        # Clear every token of a page whose SWA peer is released, not only those passed.
        return super()._mapping_to_clear(free_index)
'''
POOL_BUGGY = POOL_GOOD.replace("return super()._mapping_to_clear(free_index)", "return free_index  # cheaper")


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """31 commits: a good root, one that breaks the import (mended by the next), one
    that introduces the bug, and plain edits around them."""
    repo = tmp_path_factory.mktemp("pools")
    new_repo(repo, "Pool Dev", "dev@example.com")
    pkg = repo / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pool.py").write_text(POOL_GOOD)
    commits = {"good": commit_all(repo, "pool: first version")}
    source = POOL_GOOD
    for i in range(1, N_COMMITS + 1):
        if i == CULPRIT_AT:
            source = source.replace("return super()._mapping_to_clear(free_index)", "return free_index  # cheaper")
            message = "pool: skip the page expansion on SWA frees"
        else:
            message = f"pool: tidy {i}"
        (pkg / "notes.txt").write_text(f"edit {i}\n")
        broken = "import no_such_dependency_kvreplay\n" if i == BROKEN_AT else ""
        (pkg / "pool.py").write_text(broken + source)
        commits[i] = commit_all(repo, message)
    return repo, commits


@pytest.fixture
def trace(swa_trace_80):
    return swa_trace_80


@pytest.fixture(autouse=True)
def _cache(git_tree_cache):
    pass


@pytest.mark.slow
def test_bisect_names_the_culprit_within_the_replay_budget_and_skips_the_broken_commit(history, trace, tmp_path):
    repo, commits = history
    db = str(tmp_path / "k.db")
    good, order = git_candidates(repo, commits["good"], "main", "mypkg.pool:Pool")
    assert len(order) == N_COMMITS
    res = bisect(trace, good, order, db=db, device="cpu")
    assert res.verdict == "found", res.to_dict()
    assert res.first_bad.commit == commits[CULPRIT_AT]
    assert res.first_bad.subject == "pool: skip the page expansion on SWA frees"
    assert res.target.id == "swa-mapping" and "swa-mapping" in res.bad_shows
    assert res.replays <= math.ceil(math.log2(N_COMMITS)) + 2, [(s.label, s.verdict) for s in res.steps]
    by_commit = {s.spec.split("@")[1].split(":")[0]: s for s in res.steps}
    broken = by_commit[commits[BROKEN_AT]]
    assert broken.verdict == "skip" and broken.status == "unloadable" and "no_such_dependency" in broken.why
    assert {s.verdict for s in res.steps if s.spec.split("@")[1].startswith(commits[CULPRIT_AT])} == {"bad"}

    again = bisect(trace, good, order, db=db, device="cpu")
    assert again.first_bad.commit == commits[CULPRIT_AT]
    # every step from the store but the one whose build did not load (a missing package:
    # the environment's fault, maybe fixed since, so store/runs.py's rule tries it again)
    assert again.replays == 1 and [s.status for s in again.steps if not s.cached] == ["unloadable"]


def test_a_skip_next_to_the_culprit_leaves_a_candidate_range(trace, tmp_path):
    good, order = build_candidates(["builtin:swa", "builtin:swa@unfiltered-page0", "py:no_such_module_kv:Pool",
                                    "builtin:swa@stale-tail"])
    res = bisect(trace, good, order, db=str(tmp_path / "k.db"), device="cpu")
    assert res.verdict == "range" and res.first_bad is None
    assert [c.spec for c in res.candidates] == ["py:no_such_module_kv:Pool", "builtin:swa@stale-tail"]
    assert [s.verdict for s in res.steps if s.spec.startswith("py:")] == ["skip"]


def test_the_bad_end_must_fail(trace, tmp_path):
    from kvreplay.errors import BadInput

    good, order = build_candidates(["builtin:swa@stale-tail", "builtin:swa"])
    with pytest.raises(BadInput, match="does not show the failure"):
        bisect(trace, good, order, db=str(tmp_path / "k.db"), device="cpu")


def test_bisect_over_an_ordered_list_of_builds(trace, tmp_path):
    good, order = build_candidates(["builtin:swa", "builtin:swa@unfiltered-page0", "builtin:swa@deferred-lookup",
                                    "builtin:swa@page-partial-clear", "builtin:swa@stale-tail"])
    res = bisect(trace, good, order, db=str(tmp_path / "k.db"), device="cpu")
    assert res.verdict == "found" and res.first_bad.spec == "builtin:swa@page-partial-clear"
    assert res.target.id == "swa-mapping"


@pytest.mark.slow
def test_cli_bisect_prints_the_commit_and_the_step_log(history, trace, tmp_path):
    repo, commits = history
    db = str(tmp_path / "k.db")
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "bisect", str(trace), "--repo", str(repo),
                          "--good", commits["good"], "--bad", "main", "--class", "mypkg.pool:Pool", "--db", db,
                          "--device", "cpu", "--json"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["first_bad"]["commit"] == commits[CULPRIT_AT] and d["verdict"] == "found"
    assert any(s["verdict"] == "skip" for s in d["steps"])
    assert "skip" in res.stderr and commits[CULPRIT_AT][:12] in res.stderr  # the step log, as it went

    text = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "bisect", str(trace), "--repo", str(repo),
                           "--good", commits["good"], "--bad", "main", "--class", "mypkg.pool:Pool", "--db", db,
                           "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert text.returncode == 0
    assert f"first bad commit: {commits[CULPRIT_AT][:12]} pool: skip the page expansion" in text.stdout
    # The second time every step comes from the store but the broken commit's: a build that
    # did not load is tried again (store/runs.py's reuse rule: its cause may be the
    # environment, and the try is cheap).
    assert "1 replays, 6 from the store, 1 skipped" in text.stdout


def test_bad_bisect_input_is_a_one_line_error(history, trace, tmp_path, cli):
    repo, commits = history
    cases = [
        ["--repo", str(repo), "--good", "main", "--bad", commits["good"]],  # reversed ends
        ["--repo", str(tmp_path), "--good", "a", "--bad", "b"],  # not a repository
        ["--repo", str(repo), "--good", commits["good"], "--bad", "no-such-rev"],
        ["--builds", "builtin:swa"],
        [],
    ]
    for args in cases:
        res = cli("bisect", str(trace), *args, "--db", str(tmp_path / "k.db"))
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, (args, res.stderr)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_bisect_run_with_kvreplay_replay(history, trace, tmp_path):
    """The README's recipe: git bisect run drives kvreplay replay on each checkout."""
    repo, commits = history
    work = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(work)], check=True)
    kvreplay = Path(sys.executable).with_name("kvreplay")
    env = dict(os.environ, PATH=f"{kvreplay.parent}{os.pathsep}{os.environ['PATH']}")
    git(work, "bisect", "start", "main", commits["good"])
    out = subprocess.run(["git", "-C", str(work), "bisect", "run", "kvreplay", "replay", str(trace), "--build",
                          "git:.@HEAD:mypkg.pool:Pool", "--no-store", "--device", "cpu", "--git-bisect"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{commits[CULPRIT_AT]} is the first bad commit" in out.stdout


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_followed_divergence_is_named_where_a_violation_comes_first(tmp_path):
    """--failure result follows a divergence kind: the step that shows it is described by
    that divergence, not by the violation the replay met first (here the leak at #1174,
    then the first admission the leaked blocks make fail, #1193, in remap mode)."""
    trace = Path(__file__).resolve().parents[1] / "traces" / "vllm-11565-pin-before-room-check.parquet"
    good, order = build_candidates(["builtin:vllm", "builtin:vllm@pin-before-room-check"])
    res = bisect(trace, good, order, mode="remap", failure=Failure.parse("result"), db=str(tmp_path / "b.db"))
    assert res.first_bad.spec == "builtin:vllm@pin-before-room-check"
    assert "result divergence at call #1193 allocate_slots" in res.bad_shows, res.bad_shows
    assert "None where the recording has a value" in res.bad_detail, res.bad_detail
