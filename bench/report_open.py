"""The report of a run the size of the demo's bug run (37,830 calls, 2,619
violations): how much it weighs and how long headless Chromium takes to open and
draw it, in one run (targets: < 5 MB, < 2 s).

    python bench/report_open.py [--requests 2000] [--repeat 5]

It synthesizes the demo's trace, replays it on builtin:swa@stale-tail (stored in a
scratch database), writes the report, and opens it REPEAT times in one browser:
the time is from navigation to the chart's being drawn (the page marks it), as
the page itself measures it (performance.now()), and the wall time Playwright
saw. Needs Chromium and Playwright (pip install -e '.[browser]')."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    from servers import browser

    from kvreplay.jobs.stored_replay import replay_and_store
    from kvreplay.report.reports import BUDGET_BYTES, stored_run_report, write_report
    from kvreplay.store.db import open_store
    from kvreplay.workload.synth import SynthConfig, synthesize

    tmp = Path(tempfile.mkdtemp(prefix="kvreplay-bench-report-"))
    trace = tmp / "disagg-mtp.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=trace, requests=a.requests))
    run = replay_and_store(trace, "builtin:swa@stale-tail", db=str(tmp / "k.db"))
    st = open_store(str(tmp / "k.db"))
    t0 = time.perf_counter()
    page = stored_run_report(st, run.run_id)
    build_s = time.perf_counter() - t0
    st.close()
    out = write_report(page, tmp / "report.html")
    size = out.stat().st_size
    page_ms, wall_s = [], []
    with browser() as b:
        for _ in range(a.repeat):
            p = b.new_page(viewport={"width": 1300, "height": 900})
            t0 = time.perf_counter()
            p.goto(out.as_uri())
            p.wait_for_selector("#chart[data-drawn='1']", timeout=60_000)
            wall_s.append(time.perf_counter() - t0)
            page_ms.append(float(p.get_attribute("#chart", "data-ms")))
            p.close()
    r = run.report
    print(f"run: {r.calls_replayed} calls, {sum(r.violation_counts.values())} violations "
          f"({len(r.violation_counts)} rules); report written in {build_s:.2f} s")
    print(f"report size: {size / 1e6:.2f} MB ({size / BUDGET_BYTES:.2f} of the 5 MB budget)")
    print(f"open to chart drawn, as the page measures it: median {statistics.median(page_ms) / 1000:.2f} s, "
          f"max {max(page_ms) / 1000:.2f} s over {a.repeat} opens (target < 2 s)")
    print(f"same, wall time seen by Playwright: median {statistics.median(wall_s):.2f} s, max {max(wall_s):.2f} s")


if __name__ == "__main__":
    main()
