"""Recorder overhead and host synchronisations per call on CUDA tensors (issue 7).

    python bench/gpu_recorder.py [--requests 2000] [--repeat 5]

For a machine with an NVIDIA GPU (the ``device`` tool, when a session has one). The
workload model drives a builtin SWA pool whose tensors live on ``cuda``; runs with
and without recording alternate, and the medians are compared. Host syncs are
counted with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising call
warns once per call site occurrence, so the difference between the recorded and the
plain run, divided by the calls recorded, is the recorder's syncs per call (target
0). The model itself synchronises too (it reads lengths back), which is why only the
difference is the recorder's.

Exits 3 without a CUDA device, so a CPU-only run says plainly that it measured nothing."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from kvreplay.recorder.recording import record
from kvreplay.workload.synth import SCENARIOS, SynthConfig, make_pool, run_model


def one(cfg: SynthConfig, recorded: bool, out: Path) -> tuple[float, int, int]:
    """(seconds, host syncs seen, calls recorded) for one run."""
    sc = SCENARIOS[cfg.scenario]
    pool, _ = make_pool(cfg, sc)
    gc.collect()
    # Starting a recording compares the pool with a fresh one (attach mid-life), which
    # reads it back once: a start-up cost, kept out of the per-call figures.
    rec = record(pool, out) if recorded else None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        run_model(pool, cfg, sc)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        torch.cuda.set_sync_debug_mode(0)
    calls = rec.calls_recorded if rec is not None else 0
    if rec is not None:
        rec.close()
    syncs = sum("synchroniz" in str(w.message) for w in seen)
    return elapsed, syncs, calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (run this on a GPU machine)", file=sys.stderr)
        return 3
    out = Path(tempfile.mkdtemp()) / "gpu.parquet"
    cfg = SynthConfig(scenario="disagg-mtp", out=out, requests=a.requests, device="cuda")
    run = {False: [], True: []}
    for _ in range(a.repeat):
        for recorded in (False, True):
            run[recorded].append(one(cfg, recorded, out))
    plain = statistics.median(t for t, _, _ in run[False])
    rec = statistics.median(t for t, _, _ in run[True])
    extra_syncs = statistics.median(s for _, s, _ in run[True]) - statistics.median(s for _, s, _ in run[False])
    calls = run[True][0][2]
    print(f"{torch.cuda.get_device_name()}: disagg-mtp, {a.requests} requests, {calls} rows recorded")
    print(f"workload model alone {plain:.3f} s, recorded {rec:.3f} s: overhead ratio {rec / plain:.3f} "
          "(target <= 1.03)")
    print(f"host syncs added by the recorder: {extra_syncs:.0f}, {extra_syncs / max(calls, 1):.3f} per call "
          "(target 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
