"""The ``kvreplay`` commands the README and the docs pages write, and where each runs.

Every written command runs in a test, as written but for the paths a test must own:
``/tmp/`` becomes the test's own directory and ``~`` a home made for the test, as a
shell would expand it.

- ``here`` (the fast and slow tiers): commands that need nothing outside the repository,
  or a git repository of the reader's, which the test makes under its home;
- ``sglang`` (the integration tier, tests/test_docs_sglang.py): commands that replay on
  the installed sglang, its releases or a sglang checkout; the corpus they name is
  staged small there (the whole corpus on 24 releases takes hours on CPU);
- ``live`` (the live tier, tests/test_live_server.py): a real server, recorded and
  driven; that page's command block runs as one script;
- ``vllm`` (the vLLM tier, tests/test_vllm_live.py): the vLLM page's commands that need
  a real vLLM (its server, its manager as a build); their block runs as one script.

The README's tour runs in order in tests/test_front_door.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIERS = ("here", "sglang", "live", "vllm")


def blocks(text: str, langs: tuple[str, ...] = ("bash", "sh", "")) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) in langs]


def commands(text: str) -> list[list[str]]:
    """The kvreplay commands of a page's shell blocks, as argument lists without
    ``kvreplay`` (``record -- CMD`` ends at ``--``: CMD is the reader's)."""
    out = []
    for block in blocks(text):
        joined = re.sub(r"\\\n", "", block)  # as a shell joins a continued line: nothing in between
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("$ "):
                line = line[2:]
            for part in re.split(r"\s*(?:&&|;|\|\||\|)\s*", line):
                part = part.strip().rstrip("&").strip()
                if part.startswith("kvreplay "):
                    words = shlex.split(part)
                    if "--" in words:
                        words = words[:words.index("--") + 1]
                    out.append(words[1:])
    return out


ALL_COMMANDS = [(page.name, c) for page in PAGES for c in commands(page.read_text())]
DOCS_COMMANDS = [(page, words) for page, words in ALL_COMMANDS if page != "README.md"]
VLLM_PAGE = "vllm.md"


def tier(words: list[str], page: str = "") -> str:
    """Which tier runs a written command (see the module's docstring)."""
    if page == VLLM_PAGE and (words[0] in ("record", "drive") or any("vllm-traces" in w or w == "vllm"
                                                                     for w in words)):
        return "vllm"  # a real vLLM server, or the installed vLLM as a build
    if words[0] in ("record", "drive") or any("traces/live/" in w for w in words):
        return "live"
    if any("sglang" in w and not w.endswith(".parquet") for w in words):  # a trace's name says nothing
        return "sglang"
    return "here"


def staged(words: list[str], tmp: Path, home: Path) -> list[str]:
    """A written command's arguments with the test's ``/tmp/`` and ``~``."""
    out = []
    for w in words:
        w = w.replace("/tmp/", f"{tmp}/")
        w = re.sub(r"(^|(?<=git:))~/", f"{home}/", w)
        out.append(w)
    return out
