"""The reports and the dashboard in a real browser: headless Chromium (Debian's
package) driven by Playwright. Each page must load with no console error and draw
its chart; clicking a finding shows its context; the dashboard's filter narrows the
list and a walk goes runs -> run -> compare. Screenshots go to
$KVREPLAY_SCREENSHOTS (.ci/run keeps them) or the test's directory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from servers import browser, browser_available, free_port, screenshot_dir

from kvreplay.jobs.stored_replay import replay_and_store
from kvreplay.workload.synth import SynthConfig, synthesize

pytestmark = pytest.mark.browser


@pytest.fixture(autouse=True)
def _needs_a_browser():
    """Skip (or, under .ci/run, fail) before any replay when there is no browser."""
    browser_available()


def _open(b, url: str, errors: list[str]):
    page = b.new_page(viewport={"width": 1300, "height": 900})
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.goto(url)
    return page


def check_run_report(b, path: Path, shots: Path, name: str) -> dict:
    """Open a run's report file: chart drawn, one star per rule, the first violation's
    context shown on click, no console error. Returns what the page showed."""
    errors: list[str] = []
    page = _open(b, path.as_uri(), errors)
    page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
    data = json.loads(page.inner_text("#kvreplay-data"))
    run = data["runs"][0]
    assert page.locator("#chart .scatterlayer .trace").count() > 0  # lines and marks are drawn
    firsts = page.locator("button.first")
    assert firsts.count() == len(run["firsts"])
    shown = {}
    for i in range(firsts.count()):
        btn = firsts.nth(i)
        key, call = btn.get_attribute("data-key"), btn.get_attribute("data-call")
        btn.click()
        page.wait_for_selector(f"#detail[data-call='{call}']")
        detail = page.inner_text("#detail")
        assert f"{key} at call #{call}" in detail and "The calls around it" in detail
        shown[key] = int(call)
        if i == 0:
            assert page.locator("#detail tr.here").count() == 1  # the call itself, among its neighbours
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    assert errors == []
    return shown


def test_a_small_run_report_in_chromium(swa_trace_80, tmp_path):
    out = tmp_path / "r.html"
    db = str(tmp_path / "k.db")
    res = replay_and_store(swa_trace_80, "builtin:swa@stale-tail", db=db)
    from kvreplay.report.reports import stored_run_report, write_report
    from kvreplay.store.db import open_store

    st = open_store(db)
    write_report(stored_run_report(st, res.run_id), out)
    st.close()
    with browser() as b:
        shown = check_run_report(b, out, screenshot_dir(tmp_path), "small-run-report")
    firsts = {f"{v.invariant}/{v.rule}": v.call for v in res.report.violations}
    assert shown == {k: min(v.call for v in res.report.violations if f"{v.invariant}/{v.rule}" == k)
                     for k in firsts}


@pytest.mark.slow
def test_demo_writes_the_bug_runs_report_and_it_opens(tmp_path):
    """The Done-when: kvreplay demo writes the report and prints its path; in Chromium
    it shows the occupancy chart and the first violation of each rule."""
    db = tmp_path / "demo.db"
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "demo", "--out", str(tmp_path), "--db", str(db)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    report = tmp_path / "report.html"
    assert str(report) in res.stdout
    with browser() as b:
        shown = check_run_report(b, report, screenshot_dir(tmp_path), "demo-report")
    assert "swa-mapping/tail-prealloc-nontail-mapped" in shown


@contextmanager
def _served(db: str) -> Iterator[str]:
    """``kvreplay serve`` over ``db`` on a free port, for the block: yields its address."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "serve", "--db", db, "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(150):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=1)
                break
            except OSError:
                if p.poll() is not None:
                    raise AssertionError(f"kvreplay serve ended: {p.stderr.read()}") from None
                time.sleep(0.2)
        else:
            raise AssertionError("kvreplay serve did not answer")
        yield f"http://127.0.0.1:{port}"
    finally:
        p.terminate()
        p.wait(timeout=10)


@pytest.mark.slow
def test_dashboard_walk_runs_run_compare(swa_trace_80, tmp_path):
    db = str(tmp_path / "k.db")
    clean = replay_and_store(swa_trace_80, "builtin:swa", db=db)
    buggy = replay_and_store(swa_trace_80, "builtin:swa@stale-tail", db=db)
    shots = screenshot_dir(tmp_path)
    with _served(db) as url, browser() as b:
            errors: list[str] = []
            page = _open(b, f"{url}/", errors)
            assert page.locator("tr.run").count() == 2
            page.screenshot(path=str(shots / "dashboard-runs.png"), full_page=True)
            # the filter narrows the list
            page.select_option("select[name=status]", "violation")
            page.click("#filters button[type=submit]")
            page.wait_for_url("**status=violation**")
            assert page.locator("tr.run").count() == 1
            assert page.locator("tr.run").first.get_attribute("data-run") == str(buggy.run_id)
            # runs -> run
            page.click(f"tr.run[data-run='{buggy.run_id}'] a.run-link")
            page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
            page.click("button.first")
            page.wait_for_selector("#detail[data-call]")
            page.screenshot(path=str(shots / "dashboard-run.png"), full_page=True)
            # run -> the trace's history across builds
            page.click("header nav a:has-text('trace history')")
            page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
            assert page.locator("tr.run").count() == 2
            page.screenshot(path=str(shots / "dashboard-history.png"), full_page=True)
            assert_toolbar_covers_nothing(page)
            # back to every run, pick A and B -> compare
            page.goto(f"{url}/")
            page.check(f"tr.run[data-run='{clean.run_id}'] input[name=a]")
            page.check(f"tr.run[data-run='{buggy.run_id}'] input[name=b]")
            page.click("#compare button[type=submit]")
            page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
            data = json.loads(page.inner_text("#kvreplay-data"))
            assert [r["run_id"] for r in data["runs"]] == [clean.run_id, buggy.run_id]
            page.screenshot(path=str(shots / "dashboard-compare.png"), full_page=True)
            assert_toolbar_covers_nothing(page)
            assert errors == []


def _overlaps(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
        a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


def assert_toolbar_covers_nothing(page) -> None:
    """With the pointer on the chart (the toolbar shows), the toolbar's box meets no
    legend entry and no axis label: it once sat on both on the compare and history pages."""
    page.hover("#chart .plot-container")
    bar = page.locator("#chart .modebar").first
    bar.wait_for(state="visible", timeout=10_000)  # a toolbar that never shows is a failure, not a pass
    box = bar.bounding_box()
    labels = [r for t in page.locator("#chart .legend .traces text, #chart .xtick text, #chart .ytick text, "
                                      "#chart .g-xtitle text, #chart .g-ytitle text").all()
              if (r := t.bounding_box())]
    assert box is not None and labels, "nothing to measure: no toolbar box or no label drawn"
    covered = [r for r in labels if _overlaps(box, r)]
    assert not covered, covered


def _drawn_without_errors(b, url: str, shots: Path, name: str):
    errors: list[str] = []
    page = _open(b, url, errors)
    page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    assert errors == []
    return page


@pytest.mark.slow
def test_matrix_bisect_and_assertion_pages(cli, swa_trace_80, tmp_path):
    db = str(tmp_path / "k.db")
    shots = screenshot_dir(tmp_path)
    matrix, bisect, cap = tmp_path / "matrix.html", tmp_path / "bisect.html", tmp_path / "cap.html"
    assert cli("matrix", str(swa_trace_80), "--builds", "builtin:swa,builtin:swa@stale-tail", "--db", db,
               "--report", str(matrix)).returncode == 1
    assert cli("bisect", str(swa_trace_80), "--builds", "builtin:swa,builtin:swa@page-partial-clear,"
               "builtin:swa@stale-tail", "--db", db, "--report", str(bisect)).returncode == 0
    page0 = Path(__file__).resolve().parents[1] / "traces" / "sglang-0.5.23-swa-page0.parquet"
    assert cli("replay", str(page0), "--build", "builtin:swa@unfiltered-page0", "--no-store",
               "--report", str(cap)).returncode == 1
    with browser() as b:
        page = _drawn_without_errors(b, matrix.as_uri(), shots, "matrix")
        assert page.locator("#chart .heatmaplayer").count() == 1
        page.click("table.runs a >> nth=1")  # the stale-tail run's own page
        page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
        assert "builtin:swa@stale-tail" in page.inner_text("h1")
        page = _drawn_without_errors(b, bisect.as_uri(), shots, "bisect")
        assert page.locator("tr.verdict-bad").count() >= 1 and page.locator("tr.verdict-good").count() >= 1
        page = _drawn_without_errors(b, cap.as_uri(), shots, "capacity-assertion")
        assert "an available count exceeds its size (call 223)" in page.inner_text("#chart")


def test_a_dense_rule_is_a_strip_that_a_click_reads_back(swa_trace_80, tmp_path):
    """A rule that fires thousands of times is drawn as a strip of bins (SVG marks by
    the ten thousand take seconds); a click on it opens the first finding of the bin."""
    from kvreplay.families.sglang.replayer import Replayer
    from kvreplay.report.reports import run_report, write_report

    r = Replayer(swa_trace_80, "builtin:swa@stale-tail").run()
    key = next(iter(r.violation_counts))
    timeline = dict(r.timeline)
    timeline["marks"] = {"violation": {key: list(range(1, r.calls_replayed + 1))}, "divergence": {}}
    out = write_report(run_report(r.to_dict(), timeline), tmp_path / "dense.html")
    with browser() as b:
        errors: list[str] = []
        page = _open(b, out.as_uri(), errors)
        page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
        page.evaluate("Plotly.relayout('chart', {'xaxis.autorange': true})")  # every call, not the first findings
        page.locator("#chart").scroll_into_view_if_needed()
        assert page.locator("#chart .heatmaplayer image").count() == 1
        box = page.locator("#chart .heatmaplayer image").bounding_box()
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_selector("#detail[data-call]")
        call = int(page.get_attribute("#detail", "data-call"))
        assert abs(call - r.calls_replayed / 2) < r.calls_replayed / 20 and key in page.inner_text("#detail h3")
        page.screenshot(path=str(screenshot_dir(tmp_path) / "dense-strip.png"), full_page=True)
        assert errors == []


def test_hostile_names_stay_text_in_the_charts(cli, tmp_path):
    # Plotly renders its text fields as a subset of HTML: a trace name or a build spec
    # from data must not become a link or a style on the page.
    db = str(tmp_path / "k.db")
    shots = screenshot_dir(tmp_path)
    hostile = tmp_path / 'h<a href="http:evil.example" target=_blank>EVIL<b style="color:red">x.parquet'
    page0 = (Path(__file__).resolve().parents[1] / "traces" / "sglang-0.5.23-swa-page0.parquet").read_bytes()
    hostile.write_bytes(page0)
    (tmp_path / "plain.parquet").write_bytes(page0)  # two traces: rows are named by trace and build
    matrix = tmp_path / "matrix.html"
    assert cli("matrix", str(hostile), str(tmp_path / "plain.parquet"), "--builds",
               "builtin:swa,builtin:swa@unfiltered-page0", "--db", db, "--report", str(matrix)).returncode == 1
    with browser() as b:
        page = _drawn_without_errors(b, matrix.as_uri(), shots, "hostile-matrix")
        # Plotly turns <a> into an SVG link (xlink:href) and a style into a styled tspan
        assert page.locator("#chart a").count() == 0 and page.locator('[href*="evil"]').count() == 0
        assert page.locator('#chart tspan[style*="red"]').count() == 0
        assert "EVIL" in page.inner_text("#chart")  # shown, as text


def test_a_hostile_build_spec_stays_text_on_the_history_page(swa_trace_80, tmp_path):
    # A build spec comes from whoever wrote the store (a shared PostgreSQL, say): the
    # trace-history chart draws it as a category label, where Plotly renders markup.
    import sqlite3

    db = str(tmp_path / "k.db")
    run = replay_and_store(swa_trace_80, "builtin:swa", db=db)
    replay_and_store(swa_trace_80, "builtin:swa@stale-tail", db=db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE builds SET spec = ? WHERE spec = ?",
                    ('b<a href="http:evil.example">EVIL</a><b style="color:red">x', "builtin:swa"))
    shots = screenshot_dir(tmp_path)
    with _served(db) as url, browser() as b:
            errors: list[str] = []
            page = _open(b, f"{url}/runs/{run.run_id}", errors)
            page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
            page.click("header nav a:has-text('trace history')")
            page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
            page.screenshot(path=str(shots / "hostile-history.png"), full_page=True)
            assert "EVIL" in page.inner_text("#chart")
            assert page.locator("#chart a").count() == 0 and page.locator('[href*="evil"]').count() == 0
            assert page.locator('#chart tspan[style*="red"]').count() == 0
            assert errors == []


@pytest.mark.slow
def test_a_run_report_opens_on_its_answer(tmp_path):
    """The first screen holds the verdict and the first finding of the earliest rule,
    opened with the calls that made and revealed it; every rule's first finding is
    opened below; findings that crowd the start of a long axis are told apart by a
    zoom; identifiers do not wrap."""
    trace = tmp_path / "t.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=trace, requests=2000))  # the tour's: #49 and #519 of 37,830
    res = replay_and_store(trace, "builtin:swa@stale-tail", db=str(tmp_path / "k.db"), store=False)
    from kvreplay.report.reports import run_report, write_report

    out = write_report(run_report(res.report.to_dict(), res.report.timeline), tmp_path / "r.html")
    rules = {f"{v.invariant}/{v.rule}" for v in res.report.violations}
    first = res.report.first_violation
    errors: list[str] = []
    with browser() as b:
        page = _open(b, out.as_uri(), errors)
        page.wait_for_selector("#chart[data-drawn='1']", timeout=30_000)
        page.screenshot(path=str(screenshot_dir(tmp_path) / "first-screen.png"))
        height = page.viewport_size["height"]
        verdict = page.locator("#verdict")
        assert verdict.bounding_box()["y"] < height and f"#{first.call}" in verdict.inner_text()
        opened = page.locator("details.finding[open]")
        assert opened.count() == len(rules)
        top = opened.nth(0)
        assert top.get_attribute("data-call") == str(first.call)
        assert top.locator("summary").bounding_box()["y"] < height  # on the first screen
        made = top.locator("tr.here")
        assert made.count() == 1 and made.bounding_box()["y"] < height and "made the state" in made.inner_text()
        methods = top.locator("table.context td.ident:nth-child(2)").all_inner_texts()
        assert methods and not any(m.split()[0].endswith("available_size") for m in methods)
        # the first findings sit near the start of a long axis: the chart opens zoomed on them
        assert int(page.get_attribute("#chart", "data-zoom")) < res.report.calls_replayed
        for cell in page.locator("table.firsts td").all()[:12]:
            assert cell.evaluate("e => getComputedStyle(e).whiteSpace") == "nowrap"
    assert errors == []
