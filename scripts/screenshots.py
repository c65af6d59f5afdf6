"""Make the README's pictures again (docs/img/), from scratch, in headless Chromium:

    python scripts/screenshots.py [--out docs/img]

- demo-report.png: the first screen of the report of the demo's trace on
  builtin:swa@stale-tail (the seed bug): its verdict and first findings, opened;
- seed-bug-0.5.12.png (with --sglang-python): the first screen of the report of the
  corpus trace disagg-mtp-2000 on the real sglang 0.5.12 release. The
  release needs sglang's runtime dependencies: give the Python of an environment that
  has them and kvreplay (the integration tier's venv does: ~/.cache/kvreplay/venvs/sglang-0.5.23);
- matrix.png: the demo's trace on the SWA pool and its bug variants;
- dashboard-compare.png: the clean and the buggy run compared in kvreplay serve.

Needs Chromium and Playwright (pip install -e '.[browser]')."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

VARIANTS = ["builtin:swa", "builtin:swa@stale-tail", "builtin:swa@unfiltered-page0",
            "builtin:swa@page-partial-clear", "builtin:swa@deferred-lookup"]


def kvreplay(*args: str) -> None:
    """Run a command; 1 (something found) is what these runs are for."""
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", *args], stdout=subprocess.DEVNULL)
    if res.returncode not in (0, 1):
        raise SystemExit(f"kvreplay {args[0]} failed with exit {res.returncode}")


def run_of(db: str, build: str) -> int:
    import json

    out = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "runs", "--build", build, "--db", db, "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["run_id"]


def shoot(b, url: str, out: Path, first_screen: bool = False) -> None:
    """A page as a reader meets it: a run's report by its first screen (what it opens
    on), other pages whole."""
    page = b.new_page(viewport={"width": 1300, "height": 900})
    page.goto(url)
    page.wait_for_selector("#chart[data-drawn='1']", timeout=60_000)
    page.screenshot(path=str(out), full_page=not first_screen)
    page.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--sglang-python", help="Python of an environment with sglang's dependencies and kvreplay")
    a = ap.parse_args()
    from servers import browser, free_port

    tmp = Path(tempfile.mkdtemp(prefix="kvreplay-shots-"))
    db = str(tmp / "k.db")
    trace = tmp / "disagg-mtp.parquet"
    kvreplay("synth", "disagg-mtp", "--requests", "2000", "-o", str(trace))
    kvreplay("matrix", str(trace), "--builds", ",".join(VARIANTS), "--db", db, "--report", str(tmp / "matrix.html"))
    seed = run_of(db, "builtin:swa@stale-tail")
    kvreplay("report", str(seed), "-o", str(tmp / "seed.html"), "--db", db)
    if a.sglang_python:
        res = subprocess.run([a.sglang_python, "-m", "kvreplay.cli.app", "replay",
                              str(ROOT / "traces" / "disagg-mtp-2000.parquet"), "--build", "sglang==0.5.12",
                              "--mode", "remap", "--device", "cpu", "--db", db, "--report", str(tmp / "release.html")],
                             cwd=ROOT, stdout=subprocess.DEVNULL)
        if res.returncode != 1:
            raise SystemExit(f"the sglang 0.5.12 replay ended with exit {res.returncode}, not 1 (the seed bug)")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "serve", "--db", db, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        a.out.mkdir(parents=True, exist_ok=True)
        with browser() as b:
            shoot(b, (tmp / "seed.html").as_uri(), a.out / "demo-report.png", first_screen=True)
            if a.sglang_python:
                shoot(b, (tmp / "release.html").as_uri(), a.out / "seed-bug-0.5.12.png", first_screen=True)
            shoot(b, (tmp / "matrix.html").as_uri(), a.out / "matrix.png")
            clean = run_of(db, "builtin:swa")
            shoot(b, f"http://127.0.0.1:{port}/compare?a={clean}&b={seed}", a.out / "dashboard-compare.png")
    finally:
        server.terminate()
    print(f"wrote the pictures into {a.out}")


if __name__ == "__main__":
    main()
