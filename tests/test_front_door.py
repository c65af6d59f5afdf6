"""The front door keeps its word: the README is short, every link in it and in docs/
leads somewhere, every ``kvreplay`` command written in either parses against the real
CLI (right command, right options, right value types) and runs in a test (where each
runs: tests/docs_commands.py), and the README's tour runs, in order, after the
README's set-up."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import typer
from docs_commands import ALL_COMMANDS, DOCS_COMMANDS, PAGES, TIERS, blocks, staged, tier
from git_repos import commit_all, new_repo

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """Heading anchors as MkDocs (Python-Markdown's toc) makes them."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out = set()
    for title in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\s-]", "", title.replace("`", "")).strip().lower()
        out.add(re.sub(r"[\s]+", "-", slug))
    return out


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for machine_specific in ("this machine", "this 2-core", "on these machines"):
        assert machine_specific not in text, machine_specific


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_leads_somewhere(page):
    text = page.read_text()
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.is_file(), f"{page.name}: {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest.read_text()), f"{page.name}: {target}"


def test_the_pages_name_commands_at_all():
    assert len(ALL_COMMANDS) > 25
    assert {c[0] for _, c in ALL_COMMANDS} >= {"replay", "record", "synth", "matrix", "bisect", "minimize", "ci"}


@pytest.mark.parametrize("where, words", ALL_COMMANDS, ids=[f"{p}:{' '.join(c)[:60]}" for p, c in ALL_COMMANDS])
def test_every_written_command_parses(where, words):
    from kvreplay.cli.app import _ray_value, app

    root = typer.main.get_command(app)
    args = _ray_value(list(words))
    ctx = root.context_class(root, info_name="kvreplay")
    cmd, name = root, "kvreplay"
    while hasattr(cmd, "get_command") and args and not args[0].startswith("-"):
        name, args = args[0], args[1:]
        cmd = cmd.get_command(ctx, name)
        assert cmd is not None, f"{where}: no command {name!r} in {' '.join(words)}"
    with cmd.make_context(name, list(args), parent=ctx):
        pass


def _tour() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A tour"):]
    block = blocks(section)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _run_tour(tmp_path: Path, lines: list[str]) -> tuple[list[int], list[str], str]:
    """Run the tour's steps in order, in one shell; its last (serve) is asked for its
    first page. The exit code and output of each step before it, and that page."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    script = tmp_path / "tour.sh"
    assert lines[0].startswith("export KVREPLAY_DB=") and lines[-1] == "kvreplay serve"
    # serve runs until stopped: the tour's last step is checked by asking it for a page.
    body = ["set -u", *[f"{line} > {tmp_path}/step{i}.out 2>&1; echo \"$?\" > {tmp_path}/step{i}.rc"
                        for i, line in enumerate(lines[:-1])],
            f"exec kvreplay serve --port 0 > {tmp_path}/serve.out 2>&1"]
    script.write_text("\n".join(body) + "\n")
    proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, start_new_session=True)
    try:
        url = None
        deadline = time.monotonic() + 600
        serve_out = tmp_path / "serve.out"
        while url is None and time.monotonic() < deadline:
            said = serve_out.read_text() if serve_out.exists() else ""
            assert proc.poll() is None, said
            found = re.search(r"http://127\.0\.0\.1:\d+", said)
            url = found.group(0) if found else None
            time.sleep(0.2)
        assert url, "serve never said where it listens"
        page = urllib.request.urlopen(url + "/", timeout=10).read().decode()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    rc = [int((tmp_path / f"step{i}.rc").read_text()) for i in range(len(lines) - 1)]
    out = [(tmp_path / f"step{i}.out").read_text() for i in range(len(lines) - 1)]
    return rc, out, page


def _found_something(line: str, variant: str) -> bool:
    """A tour step that must exit 1: a replay on the bug variant, the diff of two builds."""
    return (variant in line and line.startswith("kvreplay replay")) or line.startswith("kvreplay diff")


@pytest.mark.slow
def test_the_readme_tour_runs_in_order(tmp_path):
    lines = [line.replace("/tmp/", f"{tmp_path}/") for line in _tour()]
    rc, out, page = _run_tour(tmp_path, lines)
    assert "stale-tail" in page
    expected = [1 if _found_something(line, "stale-tail") else 0 for line in lines[:-1]]
    assert rc == expected, list(zip(lines, rc, [o[-300:] for o in out], strict=False))
    step = {line.split()[1]: o for line, o in zip(lines, out, strict=False) if line.startswith("kvreplay")}
    assert "stored as run 2" in out[lines.index(next(x for x in lines if "stale-tail" in x))]
    assert "released-page-keeps-peer" in step["show"] and "#49" in step["show"]
    assert "tail-prealloc-nontail-mapped" in step["show"] and "#519" in step["show"]
    assert (tmp_path / "run2.html").stat().st_size > 10_000
    assert "#178" in step["diff"]


# The README's tour on a vLLM trace: its synth makes vLLM's scheduler's calls instead (the live
# trace's requests on a pool where admissions wait for room), every trace it names is that
# one, and sglang's builds are vLLM's (docs/vllm.md says so).
VLLM_SYNTH = ["vllm-prefix", "--requests", "120", "--workload", "workloads/mooncake/synthetic_trace.jsonl",
              "--length-scale", "0.03", "--output-scale", "0.5", "--block-tokens", "32", "--full-size", "8192",
              "--max-running", "32", "--speedup", "1000000"]
VLLM_VARIANT = "builtin:vllm@pin-before-room-check"


def _on_vllm(line: str, trace: str) -> str:
    words = shlex.split(line)
    if words[:2] == ["kvreplay", "synth"]:
        return shlex.join(["kvreplay", "synth", *VLLM_SYNTH, "-o", trace])
    out: list[str] = []
    for w in words:
        if w.endswith(".parquet") and (not out or out[-1] not in ("-o", "--out")):  # a trace read, not written
            w = trace
        elif w.startswith("builtin:swa@"):
            w = VLLM_VARIANT
        elif w == "builtin:swa":
            w = "builtin:vllm"
        out.append(w)
    return line if not line.startswith("kvreplay") else shlex.join(out)


@pytest.mark.slow
def test_the_readme_tour_runs_on_a_vllm_trace(tmp_path):
    trace = f"{tmp_path}/vllm.parquet"
    lines = [_on_vllm(line.replace("/tmp/", f"{tmp_path}/"), trace) for line in _tour()]
    assert any("vllm-prefix" in x for x in lines) and any(VLLM_VARIANT in x for x in lines)
    rc, out, page = _run_tour(tmp_path, lines)
    assert "pin-before-room-check" in page
    expected = [1 if _found_something(line, VLLM_VARIANT) else 0 for line in lines[:-1]]
    assert rc == expected, list(zip(lines, rc, [o[-300:] for o in out], strict=False))
    step = {line.split()[1]: o for line, o in zip(lines, out, strict=False) if line.startswith("kvreplay")}
    assert "blocks" in step["inspect"]
    assert "ref-count-not-owners" in step["show"] and "allocate_slots" in step["show"]
    assert (tmp_path / "run2.html").stat().st_size > 10_000
    assert "allocate_slots" in step["diff"]
    assert "ref-count-not-owners" in step["minimize"]


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_tiers_are_markers_on_the_tests_and_a_case_named_slow_must_exist(tmp_path):
    """No list of test names decides a tier (a renamed test kept its tier by its marker);
    ``slow_cases`` naming a case its test does not have stops the collection."""
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert "SLOW_TESTS" not in conftest and "SLOW_CASES" not in conftest
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "spec = importlib.util.spec_from_file_location('kvreplay_tests_conftest', "
        f"{str(ROOT / 'tests' / 'conftest.py')!r})\n"
        "ours = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(ours)\n"
        "pytest_collection_modifyitems = ours.pytest_collection_modifyitems\n")
    (tmp_path / "test_t.py").write_text("import pytest\n\n@pytest.mark.slow_cases('b', 'gone')\n"
                                        "@pytest.mark.parametrize('x', ['a', 'b'], ids=['a', 'b'])\n"
                                        "def test_x(x):\n    pass\n")
    ini = ["-o", "addopts=", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    got = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *ini, str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode != 0 and "slow_cases names ['gone']" in got.stdout + got.stderr, got.stdout[-2000:]
    (tmp_path / "test_t.py").write_text((tmp_path / "test_t.py").read_text().replace(", 'gone'", ""))
    got = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", *ini, str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 0 and "test_x[b]" in got.stdout and "test_x[a]" not in got.stdout, got.stdout[-2000:]


def test_every_docs_command_has_a_tier_that_runs_it():
    for page, words in DOCS_COMMANDS:
        assert words[0] != "serve", f"{page}: kvreplay serve runs only in the README's tour test"
        assert tier(words, page) in TIERS
        if tier(words, page) == "live":  # the live tier runs that page's block as one script
            assert page in ("recording.md", "mamba.md"), (page, words)
    assert {tier(w, p) for p, w in DOCS_COMMANDS} == set(TIERS)


# A pool of the reader's, as bisect.md's --repo bisect names it: good at v1.4, broken on main.
MYPOOL_GOOD = "from kvreplay.families.sglang.swa import SWAPool as Pool\n"
MYPOOL_BAD = "from kvreplay.families.sglang.variants import StaleTailSWAPool as Pool\n"


def _stage_mypool(home: Path) -> None:
    repo = home / "src" / "mypool"
    new_repo(repo)
    (repo / "mypkg").mkdir()
    (repo / "mypkg" / "__init__.py").write_text("")
    (repo / "mypkg" / "pool.py").write_text(MYPOOL_GOOD)
    commit_all(repo, "a good pool", tag="v1.4")
    for i in range(3):
        (repo / "NOTES").write_text(f"change {i}\n")
        commit_all(repo, f"change {i}")
    (repo / "mypkg" / "pool.py").write_text(MYPOOL_BAD)
    commit_all(repo, "the tail stays mapped")
    (repo / "NOTES").write_text("last\n")
    commit_all(repo, "after it")


HERE_PAGES = sorted({p for p, w in DOCS_COMMANDS if tier(w, p) == "here"})


@pytest.mark.slow
@pytest.mark.parametrize("page", HERE_PAGES)
def test_the_docs_commands_of_this_tier_run(tmp_path, page):
    """Every command the docs pages write that needs no sglang and no server runs as
    written, from a copy of the repository's corpus, and exits 0 or 1: a git repository
    of the reader's (~/src/mypool) is made under a home of the test's. A page's commands
    run in its order, each page on its own (the slow tier's workers share them). The
    sglang and live tiers run the others (tests/docs_commands.py)."""
    import shutil

    assert sum(tier(w, p) == "here" for p, w in DOCS_COMMANDS) >= 7
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copytree(ROOT / "traces", work / "traces")  # corpus add writes to the manifest
    (work / "workloads").symlink_to(ROOT / "workloads")
    outside, home = tmp_path / "tmp", tmp_path / "home"
    outside.mkdir()
    _stage_mypool(home)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(home),
           "KVREPLAY_DB": str(tmp_path / "docs.db"), "TMPDIR": str(outside),
           "KVREPLAY_CACHE": str(tmp_path / "cache")}
    for made in (work / "t.parquet", outside / "t.parquet"):  # the trace the pages call t.parquet
        subprocess.run(["kvreplay", "synth", "disagg-mtp", "--requests", "300", "-o", str(made)], env=env,
                       check=True, capture_output=True)
    ran = []
    for p, words in DOCS_COMMANDS:
        if p != page or tier(words, p) != "here":
            continue
        r = subprocess.run(["kvreplay", *staged(words, outside, home)], cwd=work, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode in (0, 1), (page, " ".join(words), r.stderr[-2000:])
        ran.append((words[0], r))
    assert ran
    if page == "bisect.md":
        (repo_bisect,) = [r for w, r in ran if w == "bisect" and "--repo" in r.args]
        assert "the tail stays mapped" in repo_bisect.stdout + repo_bisect.stderr
