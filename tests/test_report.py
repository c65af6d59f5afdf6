"""HTML reports and the dashboard, without a browser: what the pages carry, that
data never becomes markup, that bad paths write nothing, and that the dashboard
only reads. tests/test_browser.py opens them in Chromium."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from kvreplay.families.sglang.replayer import Replayer
from kvreplay.jobs.stored_replay import replay_and_store
from kvreplay.report.gather import open_trace, recorded_occupancy
from kvreplay.report.reports import BUDGET_BYTES, run_report
from kvreplay.store.db import open_store


def page_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="kvreplay-data">(.*?)</script>', html, re.S)
    assert m, "the page carries its data"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def store_with_runs(tmp_path_factory, swa_trace_80):
    db = str(tmp_path_factory.mktemp("rep") / "k.db")
    clean = replay_and_store(swa_trace_80, "builtin:swa", db=db)
    buggy = replay_and_store(swa_trace_80, "builtin:swa@stale-tail", db=db)
    return db, clean, buggy


def test_a_run_report_places_every_violation_and_the_first_of_each_rule(store_with_runs):
    from kvreplay.report.reports import stored_run_report

    db, _clean, buggy = store_with_runs
    st = open_store(db)
    html = stored_run_report(st, buggy.run_id)
    st.close()
    data = page_data(html)
    run = data["runs"][0]
    r = buggy.report
    # every violation is placed (not only the kept ones), at its source call
    placed = {k: len(v) for k, v in run["marks"]["violation"].items()}
    assert placed == r.violation_counts
    assert sum(placed.values()) > sum(1 for _ in r.violations)  # more than the kept ones
    for key, i in run["firsts"].items():
        f = run["findings"][i]
        assert key == f"{f['group']}:{f['key']}"
        assert f["call"] == min(run["marks"][f["group"]][f["key"]])
    # the calls around the first violation come from the trace
    first = r.first_violation
    ctx, around = data["contexts"], data["around"]
    assert ctx[str(first.call)]["method"] == first.method
    shown = around[str(first.call)]
    assert first.call in shown and shown == sorted(shown)
    # three state-changing calls on each side; counter reads are never the neighbours shown
    before = [n for n in shown if n < first.call]
    after = [n for n in shown if n > first.call]
    assert len(before) == min(3, first.call - 1) and len(after) == 3
    from kvreplay.families.sglang.vocabulary import COUNTER_METHODS

    assert not any(ctx[str(n)]["method"] in COUNTER_METHODS for n in before + after)
    # occupancy: replayed per sub-pool, in buckets
    occ = run["occupancy"]
    assert set(occ["hi"]) == {"full", "swa"}
    assert all(lo is None or lo <= hi for lo, hi in zip(occ["lo"]["full"], occ["hi"]["full"], strict=True))
    assert len(html.encode()) < BUDGET_BYTES
    assert "cdn" not in html.lower().split("<script", 1)[0]  # nothing fetched from elsewhere


def test_recorded_occupancy_equals_the_replayed_one_on_the_recording_build(swa_trace_80):
    r = Replayer(swa_trace_80, "builtin:swa").run()
    rec = recorded_occupancy(open_trace(str(swa_trace_80)), r.timeline["stride"])
    n = len(r.timeline["hi"]["full"])
    for sub in ("full", "swa"):
        assert rec["hi"][sub][:n] == r.timeline["hi"][sub]
        assert rec["lo"][sub][:n] == r.timeline["lo"][sub]
    assert max(v for v in r.timeline["hi"]["full"] if v is not None) > 0


def test_values_from_data_never_become_markup(swa_trace_80):
    r = Replayer(swa_trace_80, "builtin:swa@stale-tail").run()
    d = r.to_dict()
    evil = "</script><script>alert(1)</script><img src=x onerror=alert(2)>"
    d["build"] = evil
    d["violations"][0]["message"] = evil
    d["trace"] = "/nowhere/" + evil
    html = run_report(d, r.timeline)
    assert "<script>alert(1)" not in html and "<img src=x" not in html
    data = page_data(html)
    assert data["runs"][0]["build"] == evil  # carried as data, shown as text by the page's script
    assert any("cannot be read here" in n for n in data["notes"])  # the trace is gone: said, not fatal


def test_report_command_writes_a_file_and_refuses_bad_input(cli, store_with_runs, tmp_path):
    db, clean, buggy = store_with_runs
    out = tmp_path / "r.html"
    res = cli("report", str(buggy.run_id), "-o", str(out), "--db", db, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["bytes"] == out.stat().st_size and out.read_text().startswith("<!doctype html>")
    res = cli("report", str(clean.run_id), "--against", str(buggy.run_id), "-o", str(tmp_path / "c.html"),
              "--db", db)
    assert res.returncode == 0 and len(page_data((tmp_path / "c.html").read_text())["runs"]) == 2
    for argv, why in ((["999", "-o", str(tmp_path / "x.html")], "no run 999"),
                      ([str(buggy.run_id), "-o", str(tmp_path / "no" / "x.html")], "does not exist"),
                      ([str(buggy.run_id), "-o", str(tmp_path)], "is a directory")):
        res = cli("report", *argv, "--db", db)
        assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.html").exists() and not (tmp_path / "no").exists()


def test_replay_and_diff_write_reports(cli, swa_trace_80, tmp_path):
    out = tmp_path / "replay.html"
    res = cli("replay", str(swa_trace_80), "--build", "builtin:swa@stale-tail", "--no-store", "--report", str(out))
    assert res.returncode == 1
    assert page_data(out.read_text())["runs"][0]["status"] == "violation"
    res = cli("replay", str(swa_trace_80), "--build", "builtin:swa", "--no-store", "--report",
              str(tmp_path / "missing" / "r.html"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    out = tmp_path / "diff.html"
    res = cli("diff", str(swa_trace_80), "--base", "builtin:swa", "--candidate", "builtin:swa@stale-tail",
              "--report", str(out))
    data = page_data(out.read_text())
    assert [e["build"] for e in data["runs"]] == ["builtin:swa", "builtin:swa@stale-tail"]
    assert all(e["occupancy"] for e in data["runs"])


def test_dashboard_reads_and_never_writes(store_with_runs):
    from kvreplay.jobs.dashboard import create_app

    db, clean, buggy = store_with_runs
    st = open_store(db)
    client = create_app(st).test_client()
    page = client.get("/").get_data(as_text=True)
    assert f'data-run="{clean.run_id}"' in page and f'data-run="{buggy.run_id}"' in page
    narrowed = client.get("/?status=violation").get_data(as_text=True)
    assert f'data-run="{buggy.run_id}"' in narrowed and f'data-run="{clean.run_id}"' not in narrowed
    assert 'data-run=' not in client.get("/?since=2999-01-01").get_data(as_text=True)
    assert "must be a date" in client.get("/?since=yesterday").get_data(as_text=True)
    assert client.get(f"/runs/{buggy.run_id}").status_code == 200
    assert client.get(f"/compare?a={clean.run_id}&b={buggy.run_id}").status_code == 200
    assert client.get("/compare?a=1").status_code == 400
    assert client.get("/runs/99999").status_code == 404
    trace_hash = dict(page_data(client.get(f"/runs/{buggy.run_id}").get_data(as_text=True))["runs"][0]["meta"])[
        "trace hash"]  # a trace's history, by hash
    hist = client.get(f"/traces/{trace_hash}").get_data(as_text=True)
    assert "History of" in hist and f'data-run="{clean.run_id}"' in hist and f'data-run="{buggy.run_id}"' in hist
    assert client.get("/assets/report.js").status_code == 200
    assert client.get("/assets/..%2Fgather.py").status_code == 404
    for method in ("post", "put", "delete", "patch"):
        for url in ("/", f"/runs/{buggy.run_id}", "/compare", "/api/runs"):
            assert getattr(client, method)(url).status_code == 405
    assert {r["run_id"] for r in client.get("/api/runs").get_json()} >= {clean.run_id, buggy.run_id}
    st.close()


@pytest.mark.parametrize("damage", ["gone", "pages"])
def test_a_report_whose_trace_is_gone_or_damaged_still_draws_the_run(swa_trace_80, tmp_path, damage):
    import shutil

    trace = tmp_path / "t.parquet"
    shutil.copy(swa_trace_80, trace)
    r = Replayer(trace, "builtin:swa@stale-tail").run()
    if damage == "gone":
        trace.unlink()
    else:  # the footer reads, the data pages do not
        raw = bytearray(trace.read_bytes())
        raw[100:len(raw) // 2] = b"\xff" * (len(raw) // 2 - 100)
        trace.write_bytes(bytes(raw))
    data = page_data(run_report(r.to_dict(), r.timeline))
    assert data["recorded"] is None and data["contexts"] == {} and data["around"] == {}
    assert data["notes"] and data["runs"][0]["occupancy"] and data["runs"][0]["marks"]["violation"]


def test_ci_report_has_a_page_per_run_linked_from_the_summary(cli, swa_trace_80, tmp_path):
    import shutil

    corpus = tmp_path / "corpus" / "host=a"
    corpus.mkdir(parents=True)
    shutil.copy(swa_trace_80, corpus / "t.parquet")
    out, summary = tmp_path / "out" / "ci.html", tmp_path / "ci.md"
    out.parent.mkdir()
    res = cli("ci", str(tmp_path / "corpus"), "--build", "builtin:swa", "--db", str(tmp_path / "k.db"),
              "--report", str(out), "--summary", str(summary))
    assert res.returncode == 0, res.stderr
    data = page_data(out.read_text())
    assert data["kind"] == "ci" and len(data["ci"]) == 1 and data["ci"][0]["ok"]
    href = next(iter(data["links"].values()))
    assert (out.parent / href).is_file()
    # the run pages share one copy of the scripts: small pages, one library
    assert (out.parent / href).stat().st_size < 500_000
    assert (out.parent / "ci-runs" / "assets" / "plotly-cartesian.min.js").stat().st_size > 1_000_000
    assert 'src="assets/report.js"' in (out.parent / href).read_text()
    link = re.search(r"\[run \d+\]\(([^)]+)\)", summary.read_text()).group(1)
    assert (summary.parent / link).resolve() == (out.parent / href).resolve()


def test_a_paged_pool_and_a_run_stored_without_a_timeline(tmp_path):
    from sqlalchemy import update

    from kvreplay.report.reports import stored_run_report
    from kvreplay.store.models import Run
    from kvreplay.workload.synth import SynthConfig, synthesize

    trace = tmp_path / "p.parquet"
    synthesize(SynthConfig(scenario="decode", out=trace, requests=40, build="builtin:paged"))
    db = str(tmp_path / "k.db")
    res = replay_and_store(trace, "builtin:paged", db=db)
    st = open_store(db)
    data = page_data(stored_run_report(st, res.run_id))
    assert set(data["runs"][0]["occupancy"]["hi"]) == {"pool"} and set(data["recorded"]["hi"]) == {"pool"}
    with st.session() as s, s.begin():  # as a kvreplay before timelines stored it
        s.execute(update(Run).where(Run.id == res.run_id).values(timeline=None))
    data = page_data(stored_run_report(st, res.run_id))
    st.close()
    assert data["runs"][0]["occupancy"] is None and any("kept no timeline" in n for n in data["notes"])


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_dashboard_answers_only_its_own_host_names_and_a_busy_port_is_bad_input(store_with_runs, tmp_path):
    import socket
    import subprocess
    import sys

    from kvreplay.jobs.dashboard import create_app

    db = store_with_runs[0]
    st = open_store(db)
    client = create_app(st, hosts=frozenset({"127.0.0.1:8765", "localhost:8765"})).test_client()
    assert client.get("/", headers={"Host": "127.0.0.1:8765"}).status_code == 200
    assert client.get("/", headers={"Host": "evil.example:8765"}).status_code == 400  # DNS rebinding
    st.close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "serve", "--db", db, "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "cannot listen" in res.stderr and "Traceback" not in res.stderr
    assert "dashboard on" not in res.stderr  # it says it serves only once it listens
    assert len(res.stderr.strip().splitlines()) == 1
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "serve", "--db", str(tmp_path / "none.db")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no database" in res.stderr and not (tmp_path / "none.db").exists()


def test_dashboard_answers_bad_parameters_with_400_or_404_never_500(store_with_runs):
    from kvreplay.jobs.dashboard import create_app

    db, clean, _ = store_with_runs
    client = create_app(open_store(db)).test_client()
    big = str(1 << 63)
    for url, code in ((f"/runs/{big}", 404), (f"/compare?a={big}&b={clean.run_id}", 404),
                      ("/compare?a=" + "9" * 5000 + "&b=1", 400), ("/?until=9999-12-31", 200),
                      ("/?trace=" + "x" * 60_000, 400), ("/?build=" + "%" * 5000, 400), ("/traces/" + "a" * 3000, 404),
                      ("/?since=0000-01-01", 400), ("/runs/0", 404), ("/traces/" + "a" * 50_000, 404),
                      ("/traces/" + "z" * 10, 404), ("/runs/" + "9" * 30, 404)):
        got = client.get(url).status_code
        assert got == code, (url[:60], got)


def test_show_and_report_of_a_run_id_beyond_the_store_range_are_one_line(store_with_runs, cli, tmp_path):
    db, _, _ = store_with_runs
    out = tmp_path / "r.html"
    for argv in (("show",), ("report", "-o", str(out))):
        res = cli(*argv, str(1 << 63), "--db", db)
        assert res.returncode == 2 and "no run" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not out.exists()


def test_segments_read_as_segments_in_a_report():
    import torch

    from kvreplay.report.gather import summarise

    got = summarise([(torch.tensor([8, 9, 10, 11]), 16), (torch.tensor([40, 41]), 32)])
    assert got == ["from 16: [8 9 10 11] (4; 8..11)", "from 32: [40 41] (2; 40..41)"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_serve_stops_on_ctrl_c_with_130_and_on_sigterm_cleanly(store_with_runs, sig, code):
    from servers import free_port

    db, _, _ = store_with_runs
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "serve", "--db", db, "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == code, err
    assert "stopped" in err and "error" not in err and "Traceback" not in err
