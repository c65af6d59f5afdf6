"""The front door keeps its word: the README is short, every link in it and in docs/
leads somewhere, every ``kvreplay`` command written in either parses against the real
CLI (right command, right options, right value types), and the README's tour runs, in
order, after the README's set-up."""

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

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(text: str, langs: tuple[str, ...] = ("bash", "sh", "")) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) in langs]


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


def _commands(text: str) -> list[list[str]]:
    out = []
    for block in _blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("$ "):
                line = line[2:]
            for part in re.split(r"\s*(?:&&|;|\|\||\|)\s*", line):
                part = part.strip().rstrip("&").strip()
                if part.startswith("kvreplay "):
                    words = shlex.split(part)
                    if "--" in words:  # kvreplay record -- CMD: CMD is someone else's
                        words = words[:words.index("--") + 1]
                    out.append(words[1:])
    return out


ALL_COMMANDS = [(page.name, c) for page in PAGES for c in _commands(page.read_text())]


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
    block = _blocks(section)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_tour_runs_in_order(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    script = tmp_path / "tour.sh"
    lines = [line.replace("/tmp/", f"{tmp_path}/") for line in _tour()]
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
        assert "stale-tail" in page
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    rc = [int((tmp_path / f"step{i}.rc").read_text()) for i in range(len(lines) - 1)]
    out = [(tmp_path / f"step{i}.out").read_text() for i in range(len(lines) - 1)]
    expected = {i: (1 if "stale-tail" in line and line.startswith("kvreplay replay") or "kvreplay diff" in line
                    else 0) for i, line in enumerate(lines[:-1])}
    assert rc == [expected[i] for i in range(len(rc))], list(zip(lines, rc, [o[-300:] for o in out], strict=False))
    step = {line.split()[1]: o for line, o in zip(lines, out, strict=False) if line.startswith("kvreplay")}
    assert "stored as run 2" in out[lines.index(next(x for x in lines if "stale-tail" in x))]
    assert "released-page-keeps-peer" in step["show"] and "#49" in step["show"]
    assert "tail-prealloc-nontail-mapped" in step["show"] and "#519" in step["show"]
    assert (tmp_path / "run2.html").stat().st_size > 10_000
    assert "#178" in step["diff"]


def test_slow_tests_are_marked_in_one_place():
    marker = "mark." + "slow"
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name != "conftest.py":
            assert marker not in path.read_text(), f"{path.name}: slow tests are named in conftest.py only"


OUTSIDE = ("sglang", "git:", "--ray", "s3://", "http://", "--repo", "cuda", "traces/live/")  # the last: record's


def _needs_outside(words: list[str]) -> str | None:
    """Why a written command cannot run in a test here (a server, a GPU, sglang, a
    repository of the reader's), or None."""
    if words[0] in ("record", "drive", "serve"):
        return f"kvreplay {words[0]} runs against a server or a program of the reader's"
    hit = next((w for w in words for o in OUTSIDE if o in w), None)
    return f"needs {hit}" if hit else None


def test_the_docs_commands_that_need_nothing_outside_run(tmp_path):
    """Every command the docs pages write that needs nothing outside this repository
    (no server, GPU, sglang install or release, git repository, Ray, object store) runs
    as written, from a copy of the repository's corpus, and exits 0 or 1; the others
    are only parsed (test_every_written_command_parses) and run by the sglang tier's
    and the GPU script's own tests."""
    import shutil

    work = tmp_path / "repo"
    work.mkdir()
    shutil.copytree(ROOT / "traces", work / "traces")  # corpus add writes to the manifest
    (work / "workloads").symlink_to(ROOT / "workloads")
    outside = tmp_path / "tmp"
    outside.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "KVREPLAY_DB": str(tmp_path / "docs.db"), "TMPDIR": str(outside)}
    for made in (work / "t.parquet", outside / "t.parquet"):  # the trace the pages call t.parquet
        subprocess.run(["kvreplay", "synth", "disagg-mtp", "--requests", "300", "-o", str(made)], env=env,
                       check=True, capture_output=True)
    ran, skipped = [], []
    for page, words in ALL_COMMANDS:
        if page == "README.md":
            continue  # the tour runs in test_the_readme_tour_runs_in_order
        why = _needs_outside(words)
        if why:
            skipped.append((page, words[0], why))
            continue
        argv = [w.replace("/tmp/", f"{outside}/") for w in words]
        r = subprocess.run(["kvreplay", *argv], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode in (0, 1), (page, " ".join(words), r.stderr[-2000:])
        ran.append((page, words[0]))
    assert len(ran) >= 6, (ran, skipped)
