"""Strings from data never reach a terminal raw: a trace's footer, a file name, a stored
run, a finding. Every control character (C0 with ESC, DEL, C1), bidi override and lone
surrogate is shown escaped (``\\x1b``, ``\\u202e``) by whichever command prints it, and
``--json`` stays JSON that gives the value back as it was (issue 60, class 7)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
from rich.table import Table
from rich.text import Text

CORPUS = Path(__file__).resolve().parents[1] / "traces"
PAGE0 = CORPUS / "sglang-0.5.23-swa-page0.parquet"

# An OSC 8 link, a screen clear, a cursor move, a CSI as one C1 byte, a bidi override,
# a bell, DEL, a newline that would start a line of its own.
HOSTILE = "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\\x1b[2J\x1b[1A\x9b31m\u202eexe.txt\x07\x7f\nforged"
# What a terminal would act on: C0 but newline, DEL, C1, bidi controls, separators, surrogates.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff]")


def _clean(text: str, table: bool = False) -> None:
    assert not RAW.search(text), repr(RAW.search(text).group())
    if not table:  # (a table's cell wraps where its width says: a word may start a line there)
        assert "forged" not in text or "\\nforged" in text, "a newline from data started a line"


def _with_footer(path: Path, **fields: object) -> Path:
    table = pq.read_table(PAGE0)
    md = dict(table.schema.metadata)
    for k, v in fields.items():
        key = f"kvreplay.{k}".encode()
        if isinstance(v, dict):
            v = json.dumps({**json.loads(md.get(key, b"{}")), **v})
        md[key] = str(v).encode()
    pq.write_table(table.replace_schema_metadata(md), path)
    return path


def test_inspect_shows_a_footers_escape_sequences_escaped(tmp_path, cli):
    trace = _with_footer(tmp_path / "t.parquet", host="h" + HOSTILE, rank="r" + HOSTILE, start_time="t" + HOSTILE,
                         extra={"command": "kvreplay " + HOSTILE, "part": {"index": HOSTILE, "first_call": 0}},
                         source_version={"v" + HOSTILE: HOSTILE})
    res = cli("inspect", str(trace))
    assert res.returncode == 0, res.stderr
    _clean(res.stdout)
    assert "host h\\x1b]8;;https://evil.example\\x1b\\click" in res.stdout
    assert "\\x9b31m\\u202eexe.txt\\x07\\x7f\\nforged" in res.stdout
    shown = cli("inspect", str(trace), "--json")
    assert shown.returncode == 0
    assert "\x1b" not in shown.stdout and "\u202e" not in shown.stdout  # escaped as \u001b, \u202e
    meta = json.loads(shown.stdout)["meta"]
    assert meta["host"] == "h" + HOSTILE and meta["extra"]["command"] == "kvreplay " + HOSTILE


def test_file_and_partition_names_are_escaped_in_listings_titles_and_errors(tmp_path, cli):
    part = tmp_path / "fleet" / ("host=h" + HOSTILE.replace("/", "_")) / "rank=0"
    part.mkdir(parents=True)
    (part / "t.parquet").write_bytes(PAGE0.read_bytes())
    listed = cli("inspect", str(tmp_path / "fleet"))
    assert listed.returncode == 0, listed.stderr
    _clean(listed.stdout)
    assert "h\\x1b]8;;https:" in listed.stdout
    named = tmp_path / ("p" + HOSTILE.replace("/", "_") + ".parquet")
    named.write_bytes(PAGE0.read_bytes())
    profiled = cli("profile", str(named))  # the table's title is the file's name
    assert profiled.returncode == 0, profiled.stderr
    _clean(profiled.stdout)
    missing = cli("inspect", str(tmp_path / ("gone" + HOSTILE.replace("/", "_"))))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert missing.stderr.startswith("kvreplay: error:") and not RAW.search(missing.stderr), missing.stderr


def test_stored_runs_show_what_came_from_the_trace_escaped(tmp_path, cli):
    trace = _with_footer(tmp_path / ("t" + HOSTILE.replace("/", "_") + ".parquet"), host=HOSTILE)
    db = str(tmp_path / "k.db")
    replayed = cli("replay", str(trace), "-b", "builtin:swa@unfiltered-page0", "--db", db)
    assert replayed.returncode == 1, replayed.stderr
    for res in (replayed, cli("runs", "--db", db), cli("show", "1", "--db", db), cli("show", "1", "--all", "--db", db)):
        assert res.returncode in (0, 1), res.stderr
        _clean(res.stdout + res.stderr, table=res.args[0] == "runs")
        # (the runs table wraps its cells at the terminal's width: the escape may be cut there)
        assert "\\x1b]8;;https:" in res.stdout or res.args[0] == "runs"


def test_every_print_through_the_consoles_is_escaped_not_only_say(monkeypatch):
    from kvreplay.cli import base

    sink = io.StringIO()
    console = base._PlainConsole(file=sink, force_terminal=True, width=100)
    monkeypatch.setattr(base, "out", console)
    base.say("say " + HOSTILE)
    console.print(Text.assemble(("text " + HOSTILE, "bold")), soft_wrap=True)
    t = Table("[link=https://evil.example]col[/link]", title="title " + HOSTILE)
    t.add_row("cell " + HOSTILE + "\udcff")
    console.print(t)
    shown = sink.getvalue()
    # rich's own styles are the only escape sequences left: SGR, nothing else
    without_styles = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    assert not RAW.search(without_styles.replace("\n", "")), repr(RAW.search(without_styles).group())
    assert "\x1b]8;" not in shown and "[link=https://evil.example]" in shown  # markup is text, never a link
    assert shown.count("\\x1b]8;;https://evil.example") == 4 and "\\udcff" in shown


def test_printable_escapes_what_a_terminal_acts_on_and_keeps_the_rest():
    from kvreplay.text import printable, printable_lines

    assert printable("a\x1b[2Jb\x9b\x7f\u202e\u2066\ud800\t\n") == "a\\x1b[2Jb\\x9b\\x7f\\u202e\\u2066\\ud800\\t\\n"
    assert printable_lines("a\x1bb\nc") == "a\\x1bb\nc"
    plain = "C:\\traces\\é 日本 [bold] ü"
    assert printable(plain) == plain and printable(17) == "17"


def test_a_finding_read_back_from_the_watch_file_is_one_escaped_line(tmp_path, cli, monkeypatch):
    from kvreplay.recorder import live

    forged = {"kind": "violation", "rule": "r" + HOSTILE, "call": 3, "method": "free\nkvreplay: error: forged",
              "trace": HOSTILE, "message": HOSTILE}

    def record_command(*args, on_finding, **kwargs):
        on_finding(forged)
        on_finding({"kind": "watch-stopped", "trace": HOSTILE, "reason": HOSTILE})
        raise SystemExit(0)

    monkeypatch.setattr(live, "record_command", record_command)
    res = cli("record", "--out", str(tmp_path / "o"), "--watch", "--minimize-s", "0", "--", "true")
    lines = res.stderr.splitlines()
    assert len(lines) == 2, res.stderr
    _clean(res.stderr)
    assert lines[0].startswith("kvreplay watch: violation r\\x1b]8;;") and "free\\nkvreplay: error:" in lines[0]
