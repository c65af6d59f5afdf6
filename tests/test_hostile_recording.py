"""Hostile input in a recording's directory: the findings and counter files kvreplay
record reads back, and the parts of a rotated trace. A neighbour on the same host who
can write to the directory must not make kvreplay import code, report violations,
hang, or take gigabytes; a rotated trace replays only as the one recording it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from hostile_checks import bad as _bad

from kvreplay.errors import TraceFormatError
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.recorder import live
from kvreplay.recorder.recording import record
from kvreplay.recorder.seal import new_key, seal
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model

CORPUS = Path(__file__).resolve().parents[1] / "traces"
PAGE0 = CORPUS / "sglang-0.5.23-swa-page0.parquet"
CFG = SynthConfig(scenario="disagg-mtp", out="unused.parquet", requests=60, full_size=512, swa_size=256)




@pytest.fixture(scope="module")
def rotated(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rotated") / "parts"
    pool = SWAPool(512, 256, 4, need_sort=True)
    rec = record(pool, path, writer="thread", rows_per_batch=64, rotate_rows=300)
    run_model(pool, CFG, SCENARIOS["disagg-mtp"])
    rec.close()
    assert len(list(path.glob("part-*.parquet"))) >= 4
    return path


# 1 -- data never chooses code: findings are this run's writers' own -------------------------
EVIL = """
import pathlib
pathlib.Path({flag!r}).write_text("imported")
class Pool:
    pass
"""

PROG = """
import json, pathlib, shutil, sys, time
out = pathlib.Path(sys.argv[1])
# a neighbour: a trace whose footer names their module, and a finding that points at it
shutil.copy(sys.argv[2], out / "kvreplay-evil.parquet")
line = {"trace": "kvreplay-evil.parquet", "kind": "violation", "rule": "ownership/double-free", "call": 1,
        "method": "free", "message": "forged", "build": "py:evilmod:Pool"}
time.sleep(1.0)
with open(out / "kvreplay-watch.jsonl", "a") as f:
    f.write(json.dumps(line) + "\\n")
time.sleep(1.0)
"""


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_forged_finding_neither_imports_code_nor_fails_the_recording(tmp_path):
    flag = tmp_path / "IMPORTED"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "evilmod.py").write_text(EVIL.format(flag=str(flag)))
    evil_trace = tmp_path / "evil.parquet"
    _with_class(PAGE0, evil_trace, "evilmod:Pool")
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROG))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(out), "--watch",
                          "--minimize-s", "5", "--json", "--", sys.executable, str(prog), str(out), str(evil_trace)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["findings"] == [] and doc["reproducers"] == [] and doc["forged"] == 1
    assert not flag.exists()


def _with_class(src: Path, dst: Path, pool_class: str) -> None:
    import pyarrow.parquet as pq

    t = pq.read_table(src)
    md = dict(t.schema.metadata)
    md[b"kvreplay.pool_class"] = pool_class.encode()
    pq.write_table(t.replace_schema_metadata(md), dst)


def test_a_reproducer_is_made_only_on_the_build_the_sealed_finding_names(tmp_path):
    from kvreplay.jobs.minimize import reproduce_findings

    trace = tmp_path / "kvreplay-1.parquet"
    _with_class(PAGE0, trace, "evilmod:Pool")
    finding = {"trace": trace.name, "kind": "violation", "rule": "r/x", "build": "builtin:swa"}
    done = reproduce_findings([finding], tmp_path, 1.0, traces=[trace])
    assert done and "another class" in done[0]["error"] and not list(tmp_path.glob("repro-*"))
    # a finding without a build, or about a trace this recording did not write: nothing at all
    assert reproduce_findings([{**finding, "build": None}], tmp_path, 1.0, traces=[trace]) == []
    assert reproduce_findings([finding], tmp_path, 1.0, traces=[]) == []


def test_the_follower_reads_only_sealed_lines_and_never_waits_on_a_fifo(tmp_path):
    key = new_key()
    path = tmp_path / "kvreplay-watch.jsonl"
    got: list[dict] = []
    f = live._Follower(path, got.append, key, every_s=0.05)
    real = seal({"trace": "kvreplay-1.parquet", "kind": "violation", "rule": "r/x"}, key)
    lines = [json.dumps(real), json.dumps({**real, "rule": "r/forged"}), json.dumps({"kind": "violation"}),
             "[" * 100_000, "x" * (1 << 17), "9" * 500, json.dumps(real)]
    path.write_text("\n".join(lines) + "\n")
    f.stop()
    assert [g["rule"] for g in got] == ["r/x", "r/x"] and f.forged == 5
    path.unlink()
    os.mkfifo(path)
    g = live._Follower(path, got.append, key, every_s=0.05)
    t0 = time.monotonic()
    g.stop()
    assert time.monotonic() - t0 < 5


def test_record_refuses_a_findings_file_that_is_not_a_regular_file(tmp_path, cli):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "kvreplay-watch.jsonl")
    _bad(cli("record", "--out", str(out), "--watch", "--", sys.executable, "-c", "pass"), "not a regular file")
    assert sorted(p.name for p in out.iterdir()) == ["kvreplay-watch.jsonl"]


# 2 -- the counter files /metrics serves -----------------------------------------------------
def _doc(name: str, **kw) -> dict:
    return {"trace": name, "calls": 10, "rows": 5, "bytes": 100, "violations": {}, "divergences": {}, **kw}


def test_metrics_serve_only_sealed_regular_small_files(tmp_path):
    key = new_key()
    out = tmp_path
    (out / ".kvreplay-metrics-a.json").write_text(json.dumps(seal(_doc("a", violations={"r/x": 2}), key)))
    (out / ".kvreplay-metrics-forged.json").write_text(json.dumps(_doc("forged", violations={"r/y": 9})))
    os.mkfifo(out / ".kvreplay-metrics-fifo.json")
    os.symlink("/dev/zero", out / ".kvreplay-metrics-zero.json")
    (out / ".kvreplay-metrics-big.json").write_text(" " * (15 << 20) + json.dumps(seal(_doc("big"), key)))
    (out / ".kvreplay-metrics-digits.json").write_text(json.dumps(seal(_doc("d"), key)).replace('"calls": 10',
                                                                                              '"calls": ' + "9" * 401))
    (out / ".kvreplay-metrics-deep.json").write_text("[" * 200_000 + "]" * 200_000)
    (out / ".kvreplay-metrics-nan.json").write_text(json.dumps(seal(_doc("n", calls=float("nan")), key)))
    t0 = time.monotonic()
    text = live.metrics_text(out, key)
    assert time.monotonic() - t0 < 5
    assert 'kvreplay_violations_total{trace="a",rule="r/x"} 2.0' in text
    assert "forged" not in text and "big" not in text and 'trace="d"' not in text and 'trace="n"' not in text


def test_metric_labels_show_escape_sequences_instead_of_running_them(tmp_path):
    key = new_key()
    name = "kvreplay-\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\x1b[2J\u202e\x07.parquet"
    (tmp_path / ".kvreplay-metrics-e.json").write_text(json.dumps(seal(_doc(name, violations={"\x1b[31mr": 1}), key)))
    text = live.metrics_text(tmp_path, key)
    assert "kvreplay_calls_recorded_total{trace=" in text
    assert not any(c in text for c in "\x1b\x07\u202e"), text
    assert "\\\\x1b]8;;http://x" in text


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_scraper_that_hangs_up_early_prints_nothing(tmp_path):
    key = new_key()
    for i in range(200):
        (tmp_path / f".kvreplay-metrics-{i}.json").write_text(json.dumps(seal(_doc(f"t{i}" + "x" * 150), key)))
    code = textwrap.dedent(f"""
        import socket, sys, time
        from pathlib import Path
        from kvreplay.recorder import live
        server = live._serve_metrics(Path({str(tmp_path)!r}), 0, {key!r})
        port = server.server_address[1]
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00")
            s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
            s.close()
        time.sleep(0.5)
        import urllib.request
        body = urllib.request.urlopen(f"http://127.0.0.1:{{port}}/metrics", timeout=5).read()
        print(len(body))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and int(res.stdout) > 10_000, res.stderr
    assert res.stderr == "", res.stderr


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_parallel_scrapes_of_big_counter_files_stay_small(tmp_path):
    key = new_key()
    for i in range(50):
        (tmp_path / f".kvreplay-metrics-{i}.json").write_text(" " * (15 << 20))
    server = live._serve_metrics(tmp_path, 0, key)
    port = server.server_address[1]
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    from conftest import PythonPeak

    with PythonPeak() as peak:
        threads = [threading.Thread(target=scrape) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    server.shutdown()
    server.server_close()
    assert not errors
    assert peak.bytes < 200 << 20, peak.bytes


# 3 -- a rotated trace is one recording, every part of it there ------------------------------
def test_a_missing_middle_part_is_its_own_error_not_a_violation(rotated, tmp_path, cli):
    gap = tmp_path / "gap"
    shutil.copytree(rotated, gap)
    (gap / "part-000002.parquet").unlink()
    db = tmp_path / "k.db"
    _bad(cli("replay", str(gap), "-b", "builtin:swa", "--db", str(db)), "part-000002.parquet", "is missing")
    assert not db.exists()
    # the parts from the one after the hole on still replay, from its snapshot
    later = tmp_path / "later"
    later.mkdir()
    for p in sorted(gap.glob("part-*.parquet"))[2:]:
        shutil.copy(p, later / p.name)
    assert cli("replay", str(later), "-b", "builtin:swa", "--db", str(db)).returncode == 0


def test_ci_reports_a_missing_part_as_an_error(rotated, tmp_path, cli):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copytree(rotated, corpus / "rec")
    (corpus / "rec" / "part-000001.parquet").unlink()
    res = cli("ci", str(corpus), "--build", "builtin:swa", "--json", "--db", str(tmp_path / "k.db"))
    doc = json.loads(res.stdout)
    outcomes = [c["outcome"] for c in doc["results"]]
    assert outcomes == ["error"] and "is missing" in json.dumps(doc), doc


def test_parts_of_two_recordings_do_not_replay_as_one(rotated, tmp_path, cli):
    other = tmp_path / "other"
    pool = SWAPool(512, 256, 4, need_sort=True)
    rec = record(pool, other, writer="thread", rows_per_batch=64, rotate_rows=300)
    run_model(pool, CFG, SCENARIOS["disagg-mtp"])
    rec.close()
    mixed = tmp_path / "mixed"
    shutil.copytree(rotated, mixed)
    shutil.copy(other / "part-000001.parquet", mixed / "part-000001.parquet")
    _bad(cli("replay", str(mixed), "-b", "builtin:swa", "--db", str(tmp_path / "k.db")), "more than one recording")
    # a part renamed to another's place says where it belongs
    moved = tmp_path / "moved"
    shutil.copytree(rotated, moved)
    (moved / "part-000003.parquet").unlink()
    os.replace(moved / "part-000002.parquet", moved / "part-000003.parquet")
    (moved / "part-000001.parquet").rename(moved / "part-000002.parquet")
    with pytest.raises(TraceFormatError, match="says it is part"):
        TraceReader(moved)


def test_a_part_that_needs_the_ones_before_it_cannot_start_a_trace(tmp_path):
    import pyarrow.parquet as pq

    src = sorted(Path(CORPUS).glob("*.parquet"))[0]
    t = pq.read_table(src)
    md = dict(t.schema.metadata)
    md[b"kvreplay.extra"] = json.dumps({"part": {"index": 4, "first_call": 900, "standalone": False}}).encode()
    d = tmp_path / "chained"
    d.mkdir()
    meta = json.loads(md.get(b"kvreplay.initial_state", b"null") or b"null")
    assert meta is None
    pq.write_table(t.replace_schema_metadata(md), d / "part-000004.parquet")
    with pytest.raises(TraceFormatError, match="needs the parts before it"):
        TraceReader(d)


def test_twenty_thousand_parts_are_refused_before_any_is_opened(tmp_path, cli):
    d = tmp_path / "many"
    d.mkdir()
    first = PAGE0.read_bytes()
    (d / "part-000000.parquet").write_bytes(first)
    for i in range(1, 20_000):
        os.link(d / "part-000000.parquet", d / f"part-{i:06d}.parquet")
    t0 = time.monotonic()
    _bad(cli("inspect", str(d)), "more than 2,048 parts")
    assert time.monotonic() - t0 < 10


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_scanning_a_corpus_asks_each_directory_once(tmp_path, monkeypatch):
    from kvreplay.trace import location

    d = tmp_path / "corpus" / "rec"
    d.mkdir(parents=True)
    for i in range(3000):
        (d / f"part-{i:06d}.parquet").write_bytes(b"")
    asked = []
    real = location.is_rotated_trace
    monkeypatch.setattr(location, "is_rotated_trace", lambda p: asked.append(p) or real(p))
    (found,) = location.corpus_traces(tmp_path / "corpus")
    assert found.name == "rec" and len(asked) == 1



def test_parts_recorded_before_parts_named_their_place_still_read_in_order(rotated, tmp_path):
    """A rotated trace from a kvreplay that wrote no part metadata reads as its names say
    (a reader that wanted the metadata refused every such trace after its first part)."""
    import pyarrow.parquet as pq

    old = tmp_path / "old"
    old.mkdir()
    for part in sorted(rotated.glob("part-*.parquet")):
        t = pq.read_table(part)
        md = dict(t.schema.metadata)
        extra = json.loads(md[b"kvreplay.extra"])
        extra.pop("part")
        md[b"kvreplay.extra"] = json.dumps(extra).encode()
        pq.write_table(t.replace_schema_metadata(md), old / part.name)
    assert len(TraceReader(old).parts) == len(list(rotated.glob("part-*.parquet")))
    # a legacy part among parts that name their recording is still a mix
    mixed = tmp_path / "mixed"
    shutil.copytree(rotated, mixed)
    shutil.copy(old / "part-000001.parquet", mixed / "part-000001.parquet")
    with pytest.raises(TraceFormatError, match="more than one recording"):
        TraceReader(mixed)
