"""Replay with every check against bare build calls, on the same decoded calls, in
one run: prints the ratio and calls/s (target: strict ratio <= 1.3, decoding >= 5x the checked calls/s).

    python bench/replay_overhead.py [TRACE] [--build builtin:swa] [--repeat 3]
    python bench/replay_overhead.py --vllm          # a production-size vLLM trace on builtin:vllm

Times are CPU times (time.process_time), the CLI's as it reports them (cpu_s).

Bare: the recorded top-level calls issued to a fresh pool, nothing else.
Checked: the same calls through the replayer in strict mode (results, counters and
nested calls compared, every invariant checked, O(pool) checks every 1000 calls
and at the end) and in remap mode. Runs are interleaved and repeated; the median
of each is reported, so a noisy neighbour hits both sides alike. Decoding the
Parquet file is done once, before timing, and reported separately.

torch runs with one intra-op thread on both sides: pool tensors are far too small
for intra-op parallelism, and the idle OpenMP worker only spins on the second core
(see recorder_overhead.py)."""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvreplay.builds.resolve import load_build
from kvreplay.pool_api import SLOT_FAMILIES
from kvreplay.replay.dispatch import make_replayer
from kvreplay.trace.format import CHECKPOINT_METHOD
from kvreplay.trace.reader import TraceReader

ROOT = Path(__file__).resolve().parents[1]
# CPU time of this process, not wall time: on these shared machines a neighbour's
# burst stretches one run's wall time by a third and the next one's not at all,
# while the CPU time a replay needs stays put. (kvreplay replay --json reports its
# own as cpu_s.)
clock = time.process_time
DEFAULT = ROOT / "traces" / "disagg-mtp-2000.parquet"


def bare(trace: Path, build: str, calls: list) -> float:
    meta = TraceReader(trace).meta  # the build alone, as the trace constructs it: no replayer attached
    pool = load_build(build, meta.family, meta.ctor_args, "cpu", meta.pool_class)
    calls = [tc for tc in calls if tc.call.method != CHECKPOINT_METHOD]  # markers, not pool calls
    # a vLLM trace's top-level block-pool rows go to the block pool's wire
    targets = [pool.wire_blocks if tc.call.target == "blocks" else pool for tc in calls]
    t0 = clock()
    for tc, target in zip(calls, targets, strict=True):
        getattr(target, tc.call.method)(**tc.call.args)
    return clock() - t0


def checked(trace: Path, build: str, calls: list, mode: str, check: bool = True) -> tuple[float, str]:
    r = make_replayer(trace, build, mode=mode, check=check)
    t0 = clock()
    report = r.run(calls=calls)
    return clock() - t0, report.status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--build", default=None, help="default: builtin:swa, builtin:vllm for a vLLM trace")
    ap.add_argument("--vllm", action="store_true", help="synthesize a production-size vLLM trace (synth "
                    "vllm-prefix, 3,000 Mooncake requests) and replay it on builtin:vllm")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cli", action="store_true", help="also time `kvreplay replay TRACE --no-store` against "
                    "the bench's decoding + checked strict replay (target <= 1.1x, plus start-up)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    trace = a.trace
    if a.vllm:
        trace = Path(tempfile.mkdtemp()) / "vllm.parquet"
        subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "synth", "vllm-prefix", "--requests", "3000",
                        "--workload", str(ROOT / "workloads" / "mooncake" / "synthetic_trace.jsonl"),
                        "--length-scale", "0.03", "--output-scale", "0.5", "--block-tokens", "32",
                        "--full-size", "262144", "--max-running", "128", "--speedup", "1000000",
                        "-o", str(trace)], check=True)
    elif not trace.exists():
        trace = Path(tempfile.mkdtemp()) / "t.parquet"
        subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "synth", "disagg-mtp", "--requests", "2000",
                        "-o", str(trace)], check=True)
    # Both sides collect garbage at the pace a replay sets for itself (few_collections).
    gc.set_threshold(20_000, *gc.get_threshold()[1:])
    reader = TraceReader(trace)
    family = reader.meta.family
    a.build = a.build or ("builtin:swa" if family in SLOT_FAMILIES else f"builtin:{family}")
    modes = ("strict", "remap") if family in SLOT_FAMILIES else ("strict",)  # block ids have no remap yet
    for _tc in reader.top_calls():  # warm-up: the first pass also pays one-time set-up (page cache, imports)
        pass
    calls = list(reader.top_calls())
    gc.freeze()  # the decoded calls live through every run; keep GC from rescanning them
    times: dict[str, list[float]] = {"decode": [], "bare": [], "strict": [], "remap": [], "strict-unchecked": [],
                                     "cli": [], "cli-wall": []}
    status = {}
    for _ in range(a.repeat):
        t0 = clock()
        for _tc in reader.top_calls(nested_args=False):  # as a replay decodes: streamed, nothing kept
            pass
        times["decode"].append(clock() - t0)
        times["bare"].append(bare(trace, a.build, calls))
        for mode in modes:
            t, status[mode] = checked(trace, a.build, calls, mode)
            times[mode].append(t)
        times["strict-unchecked"].append(checked(trace, a.build, calls, "strict", check=False)[0])
        if a.cli:
            replay_s, wall = cli_run(trace, a.build)
            times["cli"].append(replay_s)
            times["cli-wall"].append(wall)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    n = len(calls)
    decode_s = med["decode"]
    print(f"trace {trace.name}: {n} top-level calls, decoded in {decode_s:.2f} s ({n / decode_s:,.0f} calls/s)")
    print(f"bare build calls        {med['bare']:.3f} s  {n / med['bare']:>9,.0f} calls/s")
    for mode in modes:
        # The ratio of each interleaved pair, then their median: a slow spell of this
        # shared machine slows both sides of one pair, not one side of the median.
        ratio = statistics.median(m / b for m, b in zip(times[mode], times["bare"], strict=True))
        print(f"replay {mode:6s} + checks  {med[mode]:.3f} s  {n / med[mode]:>9,.0f} calls/s  "
              f"ratio {ratio:.2f}  ({status[mode]})")
    speed = statistics.median(s / d for s, d in zip(times["strict"], times["decode"], strict=True))
    print(f"decoding / checked strict replay, calls/s: {speed:.1f}x (target >= 5)")
    u = med["strict-unchecked"]
    print(f"(breakdown: strict comparison alone {u / med['bare']:.2f}x bare; "
          f"the invariant checker {med['strict'] / u:.2f}x on top of it)")
    print(f"median of {a.repeat} interleaved runs, torch intra-op threads: {torch.get_num_threads()}; "
          "target ratio <= 1.3")
    if a.cli:
        ratio = statistics.median(c / (d + s) for c, d, s in zip(times["cli"], times["decode"], times["strict"],
                                                                  strict=True))
        print(f"kvreplay replay (CLI): replay {med['cli']:.2f} s CPU (whole command {med['cli-wall']:.2f} s wall, "
              f"with start-up, imports and trace checks); bench decode + checked {decode_s + med['strict']:.2f} s: "
              f"ratio {ratio:.2f}; target <= 1.1")


def cli_run(trace: Path, build: str) -> tuple[float, float]:
    """The command a user runs, with kvreplay's own thread and GC settings (no
    OMP_NUM_THREADS from us): (its replay's CPU time as it reports it, its whole wall time)."""
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "KVREPLAY_TORCH_THREADS")}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "replay", str(trace), "--build", build,
                          "--no-store", "--json"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode not in (0, 1):
        raise SystemExit(f"kvreplay replay failed: {out.stderr.strip()}")
    return json.loads(out.stdout)["cpu_s"], wall


if __name__ == "__main__":
    main()
