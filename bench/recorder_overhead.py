"""Recorder overhead on the workload model and bytes per recorded index, in one run.

    python bench/recorder_overhead.py [--scenario disagg-mtp] [--requests 2000] [--repeat 3]

Plain: the decode-server model drives a fresh builtin pool. Recorded: the same,
with the pool wrapped by the recorder and the trace written (close() included, so
the background writer's work is counted). Runs alternate and repeat; the median
of each is reported. Targets: overhead ratio <= 1.10 and <= 3 bytes per index
(issue 2); <= 1.03 and <= 2 later (issue 7)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvreplay.recorder.recording import record
from kvreplay.recorder.summary import summarize
from kvreplay.replayer.workload.synth import SCENARIOS, SynthConfig, make_pool, run_model


def one(cfg: SynthConfig, recorded: bool, out: Path) -> float:
    sc = SCENARIOS[cfg.scenario]
    pool, _ = make_pool(cfg, sc)
    t0 = time.perf_counter()
    rec = record(pool, out) if recorded else None
    run_model(pool, cfg, sc)
    if rec is not None:
        rec.close()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="disagg-mtp", choices=list(SCENARIOS))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    out = tmp / "t.parquet"
    cfg = SynthConfig(scenario=a.scenario, out=out, requests=a.requests)
    plain, recorded = [], []
    for _ in range(a.repeat):
        plain.append(one(cfg, False, out))
        recorded.append(one(cfg, True, out))
    p, r = statistics.median(plain), statistics.median(recorded)
    s = summarize(out)
    print(f"{a.scenario}, {a.requests} requests: {s.rows} rows ({s.top_level_calls} top-level)")
    print(f"workload model alone     {p:.3f} s")
    print(f"with recording           {r:.3f} s   overhead ratio {r / p:.3f}  (target <= 1.10)")
    print(f"trace {s.file_bytes:,} bytes for {s.recorded_indices:,} recorded indices: "
          f"{s.bytes_per_index:.2f} bytes/index  (target <= 3)")
    print(f"median of {a.repeat} alternating runs")


if __name__ == "__main__":
    main()
