"""The docs pages' commands that need sglang, run as written in the integration tier
(scripts/sglang-tier.sh, marker ``sglang``): replays on sglang releases, the release
matrix, the bisect over releases, and a ``git:`` build of a sglang checkout.

What is staged, and why: releases before 0.5.22 run their kernels in Triton's
interpreter, so one release replays the 37,830-call production trace in about three
minutes on CPU, and the corpus on 24 releases would take hours. The corpus the
commands name (``traces``) is therefore staged with two of the corpus' small traces, the
169-call seed reproducer under the production trace's name: it shows the seed bug on
0.5.12 and its fix in 0.5.12.post1, as the pages say. The sglang checkout
(``~/src/sglang``) is a git repository of the installed sglang's Python sources, tagged
v0.5.23, in sglang's layout (``python/sglang``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docs_commands import DOCS_COMMANDS, staged, tier
from git_repos import commit_all, new_repo

sglang = pytest.importorskip("sglang", reason="sglang not installed")

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parents[1]
SMALL = ("sglang-0.5.12-swa-tail-prealloc.parquet", "sglang-0.5.23-swa-page0.parquet")
# Traces a page's commands name, staged for that page only: the release matrices replay
# every trace in the staged corpus on every release.
PAGE_TRACES = {"tree.md": ("sglang-0.5.3-tree-no-output-leak.parquet", "sglang-0.5.5-tree-partial-page-leak.parquet",
                           "sglang-0.5.8-tree-decode-not-cached.parquet")}
# What a page's `bisect --fixed` must name, by the trace it bisects.
FIXED_IN = {"disagg-mtp-2000.parquet": "0.5.12.post1", "sglang-0.5.3-tree-no-output-leak.parquet": "0.5.3.post2",
            "sglang-0.5.5-tree-partial-page-leak.parquet": "0.5.6",
            "sglang-0.5.8-tree-decode-not-cached.parquet": "0.5.9"}


def _stage_corpus(traces: Path) -> None:
    import json

    traces.mkdir()
    manifest = json.loads((ROOT / "traces" / "manifest.json").read_text())
    kept = [e for e in manifest["traces"] if e["file"] in SMALL]
    for name in SMALL:
        shutil.copy(ROOT / "traces" / name, traces / name)
    # The production trace's name, the seed reproducer's calls.
    shutil.copy(ROOT / "traces" / SMALL[0], traces / "disagg-mtp-2000.parquet")
    (traces / "manifest.json").write_text(json.dumps({**manifest, "traces": kept}, indent=1))


def _stage_sglang_checkout(home: Path) -> None:
    repo = home / "src" / "sglang"
    new_repo(repo)
    src = Path(sglang.__file__).parent
    # What a checkout holds: sources and data, no bytecode and no built extensions.
    shutil.copytree(src, repo / "python" / "sglang", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    commit_all(repo, "sglang 0.5.23's Python sources", tag="v0.5.23")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    base = tmp_path_factory.mktemp("docs")
    work, outside, home = base / "repo", base / "tmp", base / "home"
    work.mkdir()
    outside.mkdir()
    _stage_corpus(work / "traces")
    _stage_sglang_checkout(home)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(home),
           "KVREPLAY_DB": str(base / "docs.db"), "TMPDIR": str(outside),
           # Releases are big: keep them where CI keeps them.
           "KVREPLAY_CACHE": os.environ.get("KVREPLAY_RELEASE_CACHE", os.path.expanduser("~/.cache/kvreplay"))}
    subprocess.run(["kvreplay", "synth", "disagg-mtp", "--requests", "100", "-o", str(work / "t.parquet")],
                   env=env, check=True, capture_output=True)
    return work, outside, home, env


SGLANG_COMMANDS = [(page, words) for page, words in DOCS_COMMANDS if tier(words, page) == "sglang"]
# A page's commands run in its order, in one process' store, as a reader runs them: a later
# command finds the runs an earlier one stored (the second release matrix replays only the
# releases the first did not), which halves what the matrices cost the tier.
SGLANG_PAGES = {page: [w for p, w in SGLANG_COMMANDS if p == page] for page, _ in SGLANG_COMMANDS}


@pytest.mark.parametrize("page", list(SGLANG_PAGES))
def test_the_docs_sglang_commands_run_as_written(stage, page):
    traces = stage[0] / "traces"
    for name in PAGE_TRACES.get(page, ()):
        shutil.copy(ROOT / "traces" / name, traces / name)
    try:
        for words in SGLANG_PAGES[page]:
            _runs_as_written(stage, page, words)
    finally:
        for name in PAGE_TRACES.get(page, ()):
            (traces / name).unlink(missing_ok=True)


def _runs_as_written(stage, page, words):
    work, outside, home, env = stage
    r = subprocess.run(["kvreplay", *staged(words, outside, home)], cwd=work, env=env, capture_output=True,
                       text=True, timeout=1500)
    said = r.stdout + r.stderr
    assert r.returncode in (0, 1), (page, " ".join(words), said[-3000:])
    if words[0] == "replay" and "sglang==0.5.12" in words:
        assert r.returncode == 1 and "tail-prealloc-nontail-mapped" in said  # "exit 1: the seed bug"
    if words[0] == "ci":
        assert r.returncode == 0, said[-3000:]  # "every expectation holds"
    if words[0] == "bisect" and "--fixed" in words:
        fix = FIXED_IN[Path(words[1]).name]
        assert f"first fixed build: sglang=={fix}\n" in r.stdout, said[-3000:]  # "names" the fix
    if words[0] == "matrix":
        assert "crashed" not in r.stdout.split("runs in")[-1] or " 0 crashed" in r.stdout, said[-3000:]
