"""Recorder overhead on the workload model and bytes per recorded index, in one run, and
the recording path's own cost per call against a bare method call.

    python bench/recorder_overhead.py [--scenario disagg-mtp] [--requests 1000] [--repeat 9]
    python bench/recorder_overhead.py --path-only     # the per-call table alone (a minute)
    VLLM_VENV/bin/python bench/recorder_overhead.py --path-only --engine vllm   # the same for vLLM's manager

**The recording path, per call.** What a live server pays is the time its scheduler's
thread spends inside the recorder: that is measured here where it is exact, in
nanoseconds per call, by timing a tight loop of the same call bare and recorded (the
fastest of several rounds of 200,000 calls each), beside the floor, a bare Python method
call. Three calls matter: a counter read that folds (a live scheduler's ~99%), a read
that is news (a row), and a state-changing call with index tensors (the model's
alloc/free mix, from the runs below). Their cost times the call rate of a live server
(the corpus' recording of a live sglang 0.5.23 hybrid-SWA server: its calls of each kind
per second of its span) gives the recorder's share of a scheduler that spends one CPU
second per second, as sglang's CPU scheduler does polling. Target: <= 3%.

Plain: the decode-server model drives a fresh builtin pool. Recorded: the same, with
the pool wrapped by the recorder. Runs alternate, a plain run between every two
recorded ones, and repeat. The set-ups: the default (native capture, writer process);
the fallbacks (Python capture; writer thread); the flight recorder keeping the last
100,000 calls in memory (nothing written, as between dumps); and, to show where the
default's overhead goes, the default with fewer or no counter reads and with the
wrappers installed but capturing nothing. Targets: overhead <= 1.10 and <= 3 bytes
per index (issue 2); <= 1.03, <= 1.05 for the flight recorder and <= 2 bytes per
index (issue 7).

What is timed is the program while it is being recorded: ``record()`` runs before the
clock starts and ``close()`` after it stops, because a server pays those once, not per
call. Their cost is printed on its own line (start: patching the pool and starting the
writer; close: sending the rest and waiting for the file).

**vLLM** (``--engine vllm``, in a venv with vLLM): a live vLLM server's recorder is the
live wire (which turns each manager call's Request into plain values) and the capture
behind it. The corpus' live vLLM recording's manager calls are made again on two real
managers built alike, one bare, one under the wire and the recorder, alternating call by
call; the difference of the two sums is the recording path, per call and as a share of a
scheduler at that recording's call rate. The last round's recording is replayed strict
on the installed vLLM, so what was timed is a recording that works.

The machines this runs on are shared virtual machines whose speed drifts by several
percent between one second and the next. Two estimates are printed: the ratio of the
fastest recorded run to the fastest plain run (as ``timeit`` advises, the fastest run
is the one least disturbed), and the median over rounds of each recorded run against
the mean of the plain runs either side of it. When they disagree, the machine was
noisy; run again with more ``--repeat``.

torch runs with one intra-op thread in every run, recorded or not. The pool's
tensors are a few hundred elements, too small for intra-op parallelism to help
(the model alone is ~10% faster with one thread here), and on a two-core machine
the idle OpenMP worker spins on the second core, so anything else that wants that
core (the writer process) stalls the model at every parallel region: that would
measure this machine's oversubscription, not the recorder."""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvreplay.families.vllm.vocabulary import VLLM_MANAGER_NAMES
from kvreplay.recorder import tensor_shim
from kvreplay.recorder.capture import TENSOR_SHIM, _capture, native_available
from kvreplay.recorder.flight import flight_recorder
from kvreplay.recorder.recording import record
from kvreplay.trace.summary import summarize
from kvreplay.workload.synth import SCENARIOS, SynthConfig, make_pool, run_model


@dataclass(frozen=True)
class Setup:
    engine: str  # capture engine: native or python
    writer: str  # a trace writer (process, thread), or "flight" for the flight recorder
    shim: bool = True  # torch's C shim for tensor reads (native engine)
    paused: bool = False  # wrappers installed but capturing nothing: what the wrappers alone cost
    options: dict[str, Any] = field(default_factory=dict)  # more record() arguments


# (label, set-up); an indented label is a variant of the line above it.
SETUPS: list[tuple[str, Setup]] = [
    ("native capture, writer process", Setup("native", "process")),
    ("  same, tensors read via Python", Setup("native", "process", shim=False)),  # what the shim saves
    ("  same, counters every 16th call", Setup("native", "process", options={"counters_every": 16})),
    ("  same, no counter reads", Setup("native", "process", options={"counters_every": 0})),
    # The floor of this design: the wrappers installed, capturing nothing.
    ("  same, wrappers only (paused)", Setup("native", "process", paused=True)),
    ("native capture, writer thread", Setup("native", "thread")),
    ("python capture, writer process", Setup("python", "process")),
    ("flight recorder, N = 100,000", Setup("native", "flight")),
    ("  same, no counter reads", Setup("native", "flight", options={"counters_every": 0})),
]
FLIGHT_CALLS = 100_000


def one(cfg: SynthConfig, setup: Setup | None, out: Path) -> tuple[float, float, float]:
    """(seconds the model ran, seconds to start recording, seconds to close) for one run."""
    sc = SCENARIOS[cfg.scenario]
    pool, _ = make_pool(cfg, sc)
    # Start every run, recorded or not, with the previous run's garbage collected: a
    # full collection landing inside one run costs ~4% and would decide the ratio.
    gc.collect()
    if setup is not None and not setup.shim:
        tensor_shim.uninstall(_capture)
    t0 = time.perf_counter()
    rec: Any = None
    if setup is not None and setup.writer == "flight":
        rec = flight_recorder(pool, out.parent / "dumps", calls=FLIGHT_CALLS, backend=setup.engine, signal=None,
                              **setup.options)
    elif setup is not None:
        rec = record(pool, out, backend=setup.engine, writer=setup.writer, **setup.options)
    if setup is not None and setup.paused:
        rec._engine.active = False  # a bench-only switch: a paused recording would leave a hole in the trace
    t1 = time.perf_counter()
    run_model(pool, cfg, sc)
    t2 = time.perf_counter()
    if rec is not None:
        rec.close()
    if setup is not None and not setup.shim:
        tensor_shim.install(_capture)
    return t2 - t1, t1 - t0, time.perf_counter() - t2


LIVE_TRACE = Path(__file__).resolve().parents[1] / "traces" / "live-sglang-0.5.23-swa-mooncake300.parquet"


def _loop_ns(fn: Any, n: int, rounds: int = 7) -> float:
    """ns per call of fn(), the fastest of ``rounds`` loops of n calls."""
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


class _Floor:
    def read(self) -> int:
        return 1


def recording_path(model_change_ns: float | None = None, n: int = 200_000) -> None:
    """Print ns per call of the recording path against the floor, and its share of a
    live scheduler at the live trace's call rate."""
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.trace.reader import TraceReader

    floor = _loop_ns(_Floor().read, n)
    tmp = Path(tempfile.mkdtemp())
    pool = SWAPool(4096, 2048, 16, need_sort=True)
    bare = _loop_ns(pool.full_available_size, n)
    out: dict[str, float] = {}
    for label, fold in (("folded", True), ("row", False)):
        pool = SWAPool(4096, 2048, 16, need_sort=True)
        rec = record(pool, tmp / f"{label}.parquet", fold_reads=fold)
        pool.alloc_extend  # noqa: B018 - bound before the loop, as a scheduler's attribute lookups are
        pool.free_group_begin()
        pool.free_group_end()  # a state change, so the counters are known
        out[label] = _loop_ns(pool.full_available_size, n)
        rec.close()
    print(f"\nthe recording path, ns per call (fastest of 7 loops of {n:,} calls; a bare method call is the floor)")
    print(f"  a bare Python method call (floor)      {floor:7.1f} ns")
    print(f"  full_available_size, bare              {bare:7.1f} ns")
    print(f"  the same read recorded, folded         {out['folded']:7.1f} ns   recorder {out['folded'] - bare:6.1f} ns "
          f"({(out['folded'] - bare) / floor:.1f}x the floor)")
    print(f"  the same read recorded, as a row       {out['row']:7.1f} ns   recorder {out['row'] - bare:6.1f} ns")
    if model_change_ns is not None:
        print(f"  a state-changing call of the model     recorder {model_change_ns:6.1f} ns (from the runs above)")
    if not LIVE_TRACE.exists():
        return
    r = TraceReader(LIVE_TRACE)
    reads = changes = 0
    t_lo, t_hi = None, None
    for c in r.calls(top_level_only=True):
        reads += c.method.endswith("available_size")
        changes += not c.method.endswith("available_size")
        t_lo = c.t_start_ns if t_lo is None else t_lo
        t_hi = c.t_end_ns
    span = (t_hi - t_lo) / 1e9
    change_ns = model_change_ns if model_change_ns is not None else out["row"] - bare
    share = (reads / span * (out["folded"] - bare) + changes / span * change_ns) / 1e9
    print(f"live call rate ({LIVE_TRACE.name}, {span:.0f} s): {reads / span:,.0f} counter reads/s, "
          f"{changes / span:,.0f} other calls/s")
    print(f"recorder's share of a scheduler at 1 CPU s/s: {share * 100:.2f}%  (target <= 3%; every read folded, "
          f"{'model-measured' if model_change_ns is not None else 'row-read'} cost for the other calls)")


LIVE_VLLM_TRACE = Path(__file__).resolve().parents[1] / "traces" / "live-vllm-0.32.0-prefix-mooncake300.parquet"


def vllm_recording_path(rounds: int = 5) -> None:
    """The same for vLLM's KV-cache manager (run with vLLM installed): the corpus' live
    vLLM recording's calls, each made on two real managers built alike, one bare and one
    under the live wire and the recorder as ``kvreplay record`` puts them on a server.
    Every call is timed on both, alternately, so drift hits both alike; the recording
    path per call is the difference of the sums (fastest round each), its share of a
    scheduler is that cost times the recording's call rate."""
    from kvreplay.families.vllm.wire import InstalledManager, attach
    from kvreplay.trace.reader import TraceReader

    reader = TraceReader(LIVE_VLLM_TRACE)
    top = list(reader.calls(top_level_only=True))
    calls = [(c.method, c.args) for c in top]
    span = (top[-1].t_end_ns - top[0].t_start_ns) / 1e9
    ctor = reader.meta.ctor_args
    tmp = Path(tempfile.mkdtemp())
    per_method: dict[str, list[float]] = {}
    bare_best = rec_best = float("inf")
    for k in range(rounds):
        bare_wire, rec_side = InstalledManager(**ctor), InstalledManager(**ctor)
        live = attach(rec_side.manager)  # the server's manager, behind the live wire...
        rec = record(live, tmp / f"vllm-{k}.parquet", snapshot=False)  # ...recorded
        clock = time.perf_counter_ns
        bare_ns = rec_ns = 0
        diff: dict[str, float] = {}
        gc.collect()
        for name, wire in calls:
            real = VLLM_MANAGER_NAMES.get(name, name)
            a_args, b_args = bare_wire._arguments(name, wire), rec_side._arguments(name, wire)
            bare_fn, rec_fn = bare_wire._originals[name], getattr(rec_side.manager, real)
            t0 = clock()
            bare_fn(**a_args)
            t1 = clock()
            rec_fn(**b_args)
            t2 = clock()
            bare_ns += t1 - t0
            rec_ns += t2 - t1
            diff[name] = diff.get(name, 0.0) + (t2 - t1) - (t1 - t0)
            if name == "free_request":
                for w in (bare_wire, rec_side):
                    w._book.forget(wire.get("request_id"))
        rec.close()
        bare_best, rec_best = min(bare_best, bare_ns), min(rec_best, rec_ns)
        for name, d in diff.items():
            per_method.setdefault(name, []).append(d)
    n = len(calls)
    counts = {name: sum(1 for m, _ in calls if m == name) for name in per_method}
    path_ns = (rec_best - bare_best) / n
    print(f"\nvLLM's recording path ({LIVE_VLLM_TRACE.name}: {n:,} manager calls over {span:.0f} s; "
          f"fastest of {rounds} rounds)")
    print(f"  a manager call, bare                   {bare_best / n:8.1f} ns on average")
    print(f"  the same recorded (live wire + recorder) {rec_best / n:6.1f} ns   recorder {path_ns:7.1f} ns "
          f"({path_ns / _loop_ns(_Floor().read, 200_000):.0f}x the floor)")
    for name, ds in sorted(per_method.items(), key=lambda kv: -counts[kv[0]]):
        print(f"    {name:22s} {counts[name]:7,} calls   recorder {statistics.median(ds) / counts[name]:8.1f} ns "
              f"per call (median of rounds)")
    share = n / span * path_ns / 1e9
    print(f"recorder's share of a vLLM scheduler at 1 CPU s/s, at this recording's {n / span:,.0f} calls/s: "
          f"{share * 100:.2f}%  (target <= 3%)")
    # what was measured is a recording that works: it replays strict-clean on this vLLM
    from kvreplay.replay.dispatch import replay

    again = replay(tmp / f"vllm-{rounds - 1}.parquet", "vllm", mode="strict", device="cpu")
    print(f"the last round's recording: {again.calls_replayed:,} calls, replayed strict on this vLLM: {again.status}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="disagg-mtp", choices=list(SCENARIOS))
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--path-only", action="store_true", help="only the recording path's cost per call")
    ap.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                    help="--path-only for vLLM's manager instead (needs vLLM installed)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.path_only:
        if a.engine == "vllm":
            vllm_recording_path()
        else:
            recording_path()
        return
    tmp = Path(tempfile.mkdtemp())
    out = tmp / "t.parquet"
    cfg = SynthConfig(scenario=a.scenario, out=out, requests=a.requests)
    setups = [(label, v) for label, v in SETUPS
              if v.engine == "python" or native_available() and (TENSOR_SHIM or v.shim)]
    plain: list[float] = []
    runs: list[list[tuple[float, float, float]]] = [[] for _ in setups]
    pairs: list[list[float]] = [[] for _ in setups]
    one(cfg, None, out)  # warm-up: first-call costs (imports, allocator pools) belong to no set-up
    for _ in range(a.repeat):
        # plain, set-up 1, plain, set-up 2, ..., plain: every recorded run between two plain ones
        before = one(cfg, None, out)[0]
        plain.append(before)
        for k, (_, setup) in enumerate(setups):
            got = one(cfg, setup, tmp / f"setup{k}.parquet")
            after = one(cfg, None, out)[0]
            plain.append(after)
            runs[k].append(got)
            pairs[k].append(got[0] / ((before + after) / 2))
            before = after
    p = min(plain)
    s = summarize(tmp / "setup0.parquet")  # the default set-up's trace
    print(f"{a.scenario}, {a.requests} requests: {s.rows} rows ({s.calls} calls)")
    print(f"workload model alone (fastest)    {p:.3f} s")
    print(f"{'':34s}{'fastest':>9s}  {'ratio':>6s}  {'median pair ratio':>17s}  {'start':>7s}  {'close':>7s}")
    for k, (label, _) in enumerate(setups):
        r = min(w for w, _, _ in runs[k])
        start = statistics.median(s for _, s, _ in runs[k])
        close = statistics.median(c for _, _, c in runs[k])
        print(f"{label:34s}{r:8.3f}s  {r / p:6.3f}  {statistics.median(pairs[k]):17.3f}  "
              f"{start * 1e3:5.1f}ms  {close * 1e3:5.1f}ms")
    print("targets: the default (first line) <= 1.03 (issue 7; <= 1.10 in issue 2); "
          f"the flight recorder keeping {FLIGHT_CALLS:,} calls <= 1.05")
    print(f"trace {s.file_bytes:,} bytes for {s.recorded_indices:,} recorded indices: "
          f"{s.bytes_per_index:.2f} bytes/index  (target <= 2)")
    print(f"{a.repeat} rounds, torch intra-op threads: {torch.get_num_threads()}, "
          f"tensors read through torch's C shim: {'yes' if TENSOR_SHIM else 'no (Python reads)'}")
    first = min(w for w, _, _ in runs[0])
    recording_path((first - p) * 1e9 / max(s.calls, 1))


if __name__ == "__main__":
    main()
