"""Segment-parallel replay against serial, on one trace, in one run: prints the
speed-up of `kvreplay replay --jobs N` and whether its result is the serial one
(target: >= 1.7x with --jobs 2 on a 2-core machine, for a trace of >= 200,000 calls).

    python bench/replay_jobs.py [TRACE] [--build builtin:swa] [--jobs 2]

Without TRACE it synthesizes the production-size one (Mooncake workload, 3,200
requests, a 400,000-token full pool, 40,000 SWA tokens, pages of 16, a window of
128, 32 running; a checkpoint every 10,000 calls: about 208,000 calls). Both runs
are the real command (`--no-store --json`), serial first, then parallel; the wall
times include start-up, the trace checks and the merge."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "workloads" / "mooncake" / "synthetic_trace.jsonl"
CACHE = Path.home() / ".cache" / "kvreplay" / "bench" / "prod-3200-cp10000.parquet"
SYNTH = ["synth", "disagg-mtp", "--workload", str(WORKLOAD), "--requests", "3200", "--full-size", "400000",
         "--swa-size", "40000", "--page-size", "16", "--window", "128", "--max-running", "32",
         "--checkpoint-every", "10000"]


def kvreplay(*args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", *args], capture_output=True, text=True)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path)
    ap.add_argument("--build", default="builtin:swa")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    trace = a.trace
    if trace is None:
        trace = CACHE
        if not trace.exists():
            trace.parent.mkdir(parents=True, exist_ok=True)
            print(f"synthesizing the production-size trace into {trace} (about a minute) ...", flush=True)
            _, out = kvreplay(*SYNTH, "-o", str(trace))
            if out.returncode != 0:
                raise SystemExit(out.stderr.strip())
    runs = {}
    for jobs in (1, a.jobs):
        wall, out = kvreplay("replay", str(trace), "--build", a.build, "--no-store", "--json", "--jobs", str(jobs))
        if out.returncode not in (0, 1):
            raise SystemExit(f"kvreplay replay --jobs {jobs} failed: {out.stderr.strip()}")
        runs[jobs] = wall, json.loads(out.stdout)
    (s_wall, serial), (p_wall, parallel) = runs[1], runs[a.jobs]
    timing = ("wall_s", "calls_per_s", "cpu_s")
    same = {k: v for k, v in serial.items() if k not in timing} == \
        {k: v for k, v in parallel.items() if k not in timing}
    n = serial["calls_replayed"]
    print(f"trace {trace.name}: {n:,} calls, build {a.build}, status {serial['status']}")
    print(f"serial      {s_wall:7.2f} s wall (replay {serial['wall_s']:.2f} s, {serial['calls_per_s']:,.0f} calls/s)")
    print(f"--jobs {a.jobs:<4} {p_wall:7.2f} s wall (replay {parallel['wall_s']:.2f} s, "
          f"{parallel['calls_per_s']:,.0f} calls/s)")
    print(f"speed-up {s_wall / p_wall:.2f}x wall ({serial['wall_s'] / parallel['wall_s']:.2f}x replay); "
          f"result identical to serial: {same}; target >= 1.7x")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
