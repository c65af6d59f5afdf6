"""Replay with every check against bare build calls, on the same decoded calls, in
one run: prints the ratio and calls/s (target: strict ratio <= 1.3, decoding >= 5x the checked calls/s).

    python bench/replay_overhead.py [TRACE] [--build builtin:swa] [--repeat 3]
    python bench/replay_overhead.py --vllm          # a production-size vLLM trace on builtin:vllm
    python bench/replay_overhead.py --vllm --instructions   # the same, counted by callgrind

Times are CPU times (time.process_time), the CLI's as it reports them (cpu_s).

Bare: the recorded top-level calls issued to a fresh pool, nothing else.
Checked: the same calls through the replayer in strict mode (results, counters and
nested calls compared, every invariant checked, O(pool) checks every 1000 calls
and at the end) and in remap mode. One untimed round first (the first pass of each
side pays for touching fresh memory, which the second does not), then the rounds
are interleaved, each side starting from a collected heap. Reported: the median of
the per-round ratios (a slow spell of this shared machine slows both sides of one
round), their spread, and the ratio of each side's fastest run (noise only ever adds
CPU time, so the minimum is the run least disturbed). Decoding the Parquet file is
done once, before timing, and reported separately.

--instructions counts each side's executed instructions instead (valgrind's callgrind,
instrumenting only the replay itself, each side in its own process, two at a time): the
count does not move with the machine's load, so one run settles a ratio that CPU times
on a shared machine only bracket. It is about 60 times slower than the timed bench.

torch runs with one intra-op thread on both sides: pool tensors are far too small
for intra-op parallelism, and the idle OpenMP worker only spins on the second core
(see recorder_overhead.py)."""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvreplay.builds.resolve import load_build
from kvreplay.contract.registry import family as family_record
from kvreplay.replay.replayers import make_replayer
from kvreplay.trace.format import CHECKPOINT_METHOD
from kvreplay.trace.reader import TraceReader

ROOT = Path(__file__).resolve().parents[1]
# CPU time of this process, not wall time: on these shared machines a neighbour's
# burst stretches one run's wall time by a third and the next one's not at all,
# while the CPU time a replay needs stays put. (kvreplay replay --json reports its
# own as cpu_s.)
clock = time.process_time
DEFAULT = ROOT / "traces" / "disagg-mtp-2000.parquet"


def prepare_bare(trace: Path, build: str, calls: list) -> Callable[[], None]:
    """The recorded top-level calls issued to a fresh pool, nothing else (built now, run later)."""
    meta = TraceReader(trace).meta  # the build alone, as the trace constructs it: no replayer attached
    pool = load_build(build, meta.family, meta.ctor_args, "cpu", meta.pool_class)
    calls = [tc for tc in calls if tc.call.method != CHECKPOINT_METHOD]  # markers, not pool calls
    # a vLLM trace's top-level block-pool rows go to the block pool's wire
    targets = [pool.wire_blocks if tc.call.target == "blocks" else pool for tc in calls]

    def run() -> None:
        for tc, target in zip(calls, targets, strict=True):
            getattr(target, tc.call.method)(**tc.call.args)
    return run


def prepare_checked(trace: Path, build: str, calls: list, mode: str, check: bool = True) -> Callable[[], str]:
    """The same calls through the replayer (built now, run later); the run returns its status."""
    r = make_replayer(trace, build, mode=mode, check=check)
    return lambda: r.run(calls=calls).status


def bare(trace: Path, build: str, calls: list) -> float:
    run = prepare_bare(trace, build, calls)
    t0 = clock()
    run()
    return clock() - t0


def checked(trace: Path, build: str, calls: list, mode: str, check: bool = True) -> tuple[float, str]:
    run = prepare_checked(trace, build, calls, mode, check)
    t0 = clock()
    status = run()
    return clock() - t0, status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--build", default=None, help="default: builtin:swa, builtin:vllm for a vLLM trace")
    ap.add_argument("--vllm", action="store_true", help="synthesize a production-size vLLM trace (synth "
                    "vllm-prefix, 3,000 Mooncake requests) and replay it on builtin:vllm")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cli", action="store_true", help="also time `kvreplay replay TRACE --no-store` against "
                    "the bench's decoding + checked strict replay (target <= 1.1x, plus start-up)")
    ap.add_argument("--instructions", action="store_true", help="count instructions with valgrind's callgrind "
                    "instead of timing (exact under any load; about 60x slower)")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # a callgrind child: the one side it runs
    a = ap.parse_args()
    torch.set_num_threads(1)
    trace = a.trace
    if a.side:
        return callgrind_side(trace, a.build, a.side)
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
    slots = family_record(family).slots
    a.build = a.build or ("builtin:swa" if slots else family_record(family).default_build)
    modes = ("strict", "remap") if slots else ("strict",)  # block ids have no remap yet
    if a.instructions:
        return count_instructions(trace, a.build, n=reader.count_calls())
    for _tc in reader.top_calls():  # warm-up: the first pass also pays one-time set-up (page cache, imports)
        pass
    calls = list(reader.top_calls())
    gc.freeze()  # the decoded calls live through every run; keep GC from rescanning them
    times: dict[str, list[float]] = {"decode": [], "bare": [], "strict": [], "remap": [], "strict-unchecked": [],
                                     "cli": [], "cli-wall": []}
    status = {}
    for rnd in range(a.repeat + 1):
        timed = rnd > 0
        t0 = clock()
        for _tc in reader.top_calls(nested_args=False):  # as a replay decodes: streamed, nothing kept
            pass
        decode_t = clock() - t0
        round_times = {"decode": decode_t}
        gc.collect()
        round_times["bare"] = bare(trace, a.build, calls)
        for mode in modes:
            gc.collect()
            round_times[mode], status[mode] = checked(trace, a.build, calls, mode)
        gc.collect()
        round_times["strict-unchecked"] = checked(trace, a.build, calls, "strict", check=False)[0]
        if timed:
            for k, v in round_times.items():
                times[k].append(v)
        if a.cli and timed:
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
        ratios = [m / b for m, b in zip(times[mode], times["bare"], strict=True)]
        print(f"replay {mode:6s} + checks  {med[mode]:.3f} s  {n / med[mode]:>9,.0f} calls/s  "
              f"ratio {statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f}, "
              f"fastest runs {min(times[mode]) / min(times['bare']):.2f})  ({status[mode]})")
    speed = statistics.median(s / d for s, d in zip(times["strict"], times["decode"], strict=True))
    print(f"decoding / checked strict replay, calls/s: {speed:.1f}x (target >= 5)")
    u = med["strict-unchecked"]
    print(f"(breakdown: strict comparison alone {u / med['bare']:.2f}x bare; "
          f"the invariant checker {med['strict'] / u:.2f}x on top of it)")
    print(f"median of {a.repeat} interleaved rounds after one untimed, torch intra-op threads: "
          f"{torch.get_num_threads()}; target ratio <= 1.3")
    if a.cli:
        ratio = statistics.median(c / (d + s) for c, d, s in zip(times["cli"], times["decode"], times["strict"],
                                                                  strict=True))
        print(f"kvreplay replay (CLI): replay {med['cli']:.2f} s CPU (whole command {med['cli-wall']:.2f} s wall, "
              f"with start-up, imports and trace checks); bench decode + checked {decode_s + med['strict']:.2f} s: "
              f"ratio {ratio:.2f}; target <= 1.1")


SIDES = ("bare", "strict", "strict-unchecked")


def count_instructions(trace: Path, build: str, n: int) -> None:
    """Each side in its own callgrind process (two at a time); prints the counts and ratios."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (and its callgrind_control) on PATH")
    out = Path(tempfile.mkdtemp(prefix="kvreplay-callgrind-"))
    python = sys.executable
    procs = {}
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    for side in SIDES:
        while sum(p.poll() is None for p in procs.values()) >= 2:
            time.sleep(1)
        procs[side] = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/{side}.%p",
             python, __file__, str(trace), "--build", build, "--side", side],
            stdout=subprocess.DEVNULL, stderr=open(out / f"{side}.log", "w"))
    for side, p in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"the {side} side failed under callgrind: see {out / f'{side}.log'}")
        dumps = {}
        for f in out.glob(f"{side}.*.*"):  # one file per dump: the empty region, then the side's
            text = f.read_text(errors="replace")
            desc, total = re.search(r"^desc: Trigger: dump (\S+)", text, re.M), re.search(r"^totals: (\d+)", text, re.M)
            if desc and total:
                dumps[desc.group(1)] = int(total.group(1))
        counts[side] = dumps[side] - dumps["empty"]  # the toggling's own instructions, measured alone
    shutil.rmtree(out)  # the counts are read; a failed side's files stay for its log
    print(f"trace {trace.name}: {n} top-level calls on {build}, instructions counted by callgrind "
          f"({time.perf_counter() - t0:.0f} s)")
    for side in SIDES:
        print(f"{side:17s} {counts[side]:>16,} instructions  {counts[side] / n:>8,.0f} per call  "
              f"ratio {counts[side] / counts['bare']:.3f}")
    print(f"(breakdown: strict comparison alone {counts['strict-unchecked'] / counts['bare']:.3f}x bare; "
          f"the invariant checker {counts['strict'] / counts['strict-unchecked']:.3f}x on top of it); "
          "target strict ratio <= 1.3")


def callgrind_side(trace: Path, build: str, side: str) -> None:
    """Inside callgrind, instrumentation off: decode as the timed bench does, then count one
    empty region (what switching costs) and one run of ``side``, each dumped under its name."""
    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)

    gc.set_threshold(20_000, *gc.get_threshold()[1:])
    reader = TraceReader(trace)
    calls = list(reader.top_calls())
    gc.freeze()
    def prepare() -> Callable[[], object]:
        if side == "bare":
            return prepare_bare(trace, build, calls)
        return prepare_checked(trace, build, calls, "strict", check=side == "strict")

    prepare()()  # the first pass touches fresh memory and fills caches, as in the timed bench
    for name, fn in (("empty", lambda: None), (side, prepare())):
        gc.collect()
        control("--zero")
        control("--instr=on")
        fn()
        control("--instr=off")
        control(f"--dump={name}")


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
