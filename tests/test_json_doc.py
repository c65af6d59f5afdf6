"""docs/json.md against the real output: every key it lists is in the command's JSON,
and every key the command prints is in it (a promise the docs make is kept, and
nothing ships undocumented)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "json.md").read_text()
PAGE0 = str(ROOT / "traces" / "sglang-0.5.23-swa-page0.parquet")


def _keys(cell: str) -> set[str]:
    """The top-level keys a table cell names: backticked names outside parentheses."""
    depth, top = 0, []
    for i, ch in enumerate(cell):
        if depth == 0 and cell.startswith("; with ", i):
            break  # "; with --against: ..." describes another document
        depth += ch == "("
        if depth == 0:
            top.append(ch)
        depth -= ch == ")" and depth > 0
    return set(re.findall(r"`([a-z_]+)`", "".join(top)))


def _run_keys() -> set[str]:
    section = DOC[DOC.index("## A replay run"):DOC.index("**violation**")]
    keys = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            keys |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return keys


def _added(sentence_start: str) -> set[str]:
    i = DOC.index(sentence_start)
    return set(re.findall(r"`([a-z_]+)`", DOC[i:DOC.index(".", DOC.index(")", i))]))


def _other(command: str) -> set[str]:
    for line in DOC[DOC.index("## Other commands"):].splitlines():
        cells = line.split(" | ")
        if line.startswith(f"| `{command}` |"):
            return _keys(cells[1])
    raise AssertionError(f"docs/json.md lists no {command}")


RUN = _run_keys()
REPLAY_ADDS = _added("`replay --json` adds")
STORED_ADDS = {"trace_hash", "trace_calls", "build_version", "kvreplay_version", "started_at"}
RUNS_LEAVE_OUT = {"violations", "divergences", "first_divergence"}


def test_the_doc_is_read_as_meant():
    assert {"cpu_s", "violation_counts", "first_violation", "capacity_assert_call"} <= RUN
    assert REPLAY_ADDS == {"held_at_end", "stopped_early", "translated"}
    assert STORED_ADDS <= set(re.findall(r"`([a-z_]+)`", DOC[DOC.index("`show --json` and `runs --json` add"):]))
    assert _other("diff") >= {"first", "context", "exit_code"} and "call" not in _other("diff")


@pytest.fixture
def stored(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("KVREPLAY_DB", str(tmp_path / "j.db"))
    replayed = cli("replay", PAGE0, "--build", "builtin:swa@unfiltered-page0", "--json")
    assert replayed.returncode == 1, replayed.stderr
    return json.loads(replayed.stdout)


def test_a_replay_and_its_stored_run_print_what_the_doc_says(cli, stored):
    assert set(stored) == RUN | REPLAY_ADDS
    shown = json.loads(cli("show", str(stored["run_id"]), "--json").stdout)
    assert set(shown) == RUN | STORED_ADDS
    assert shown["cpu_s"] is not None and shown["violation_counts"] == stored["violation_counts"]
    (listed,) = json.loads(cli("runs", "--json").stdout)
    assert set(listed) == (RUN | STORED_ADDS) - RUNS_LEAVE_OUT
    assert listed["violation_counts"] == stored["violation_counts"]


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_the_other_commands_print_what_the_doc_says(cli, stored, tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    runs = {
        "diff": ("diff", PAGE0, "--base", "builtin:swa", "--candidate", "builtin:swa@unfiltered-page0"),
        "inspect": ("inspect", PAGE0),
        "synth": ("synth", "decode", "--requests", "5", "-o", str(out / "s.parquet")),
        "profile": ("profile", PAGE0),
        "bisect": ("bisect", PAGE0, "--builds", "builtin:swa,builtin:swa@unfiltered-page0"),
        "minimize": ("minimize", PAGE0, "-b", "builtin:swa@unfiltered-page0", "-o", str(out / "m.parquet")),
        "report": ("report", str(stored["run_id"]), "-o", str(out / "r.html")),
        "record": ("record", "--out", str(out / "rec"), "--", sys.executable, "-c", "pass"),
    }
    for command, argv in runs.items():
        r = cli(*argv, "--json") if "--" not in argv else cli(argv[0], "--json", *argv[1:])
        assert r.returncode in (0, 1), (command, r.stderr)
        assert set(json.loads(r.stdout)) == _other(command), command
    builds = json.loads(cli("builds", "--json").stdout)
    assert all(set(b) == {"build", "family", "summary"} for b in builds)
