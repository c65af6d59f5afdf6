"""What recording costs a real server: the same sglang server on CPU, the same requests,
with and without ``kvreplay record``, in one run.

    ~/.cache/kvreplay/venvs/sglang-0.5.23/bin/python bench/live_record.py --requests 300 [--page-size 16] [--swa 128]

Per run: the scheduler process's CPU seconds (user + system, read from /proc before the
server stops; they do not move with the machine's load the way wall time does), the
client's wall time for the requests, and the trace's size. Prints the ratios recorded /
bare. The writer's own CPU time (a separate process, off the scheduler's core) is
reported apart."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from tiny_model import make  # noqa: E402

from kvreplay.workload.drive import DriveConfig, drive  # noqa: E402
from kvreplay.workload.requests import load_requests  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _named(name: bytes) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if name in Path(f"/proc/{d}/cmdline").read_bytes():
                    out.append(int(d))
            except OSError:
                pass
    return out


def run(model: Path, out: Path, record: bool, n: int, page_size: int) -> dict[str, float]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--skip-tokenizer-init",
              "--device", "cpu", "--model-impl", "transformers", "--page-size", str(page_size), "--port", str(port),
              "--disable-cuda-graph", "--mem-fraction-static", "0.05", "--log-level", "warning"]
    cmd = ([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(out), "--"] if record else []) + server
    log = open(out.parent / f"server-{'rec' if record else 'bare'}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(900):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"server exited while starting (see {log.name})") from None
                time.sleep(1)
        (sched,) = _named(b"sglang::scheduler") or [0]
        writers = _named(b"kvreplay.recorder.writer_child")
        c0, w0 = _cpu_s(sched), sum(_cpu_s(w) for w in writers)
        reqs = load_requests(ROOT / "workloads/mooncake/synthetic_trace.jsonl", count=n, seed=0, block_tokens=16,
                             length_scale=0.03, output_scale=1.0)
        res = drive(DriveConfig(url=f"http://127.0.0.1:{port}", concurrency=16), reqs)
        c1, w1 = _cpu_s(sched), sum(_cpu_s(w) for w in writers)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=180)
    size = sum(p.stat().st_size for p in out.glob("*.parquet"))
    return {"scheduler_cpu_s": c1 - c0, "writer_cpu_s": w1 - w0, "wall_s": res.elapsed_s, "ok": res.ok,
            "trace_mb": size / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--swa", type=int, default=0, help="a hybrid sliding-window model with this window")
    ap.add_argument("--keep", type=Path, help="copy the recorded trace here (e.g. for kvreplay profile)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        model = make(base / "model", a.swa)
        bare = run(model, base / "bare", False, a.requests, a.page_size)
        rec = run(model, base / "rec", True, a.requests, a.page_size)
        if a.keep:
            import shutil

            for p in (base / "rec").glob("*.parquet"):
                shutil.copy(p, a.keep)
    for name, r in (("bare", bare), ("recorded", rec)):
        print(f"{name:9s} scheduler {r['scheduler_cpu_s']:6.1f} CPU s, writer {r['writer_cpu_s']:5.1f} CPU s, "
              f"{r['wall_s']:6.1f} s wall for {r['ok']:.0f} requests, trace {r['trace_mb']:.1f} MB")
    print(f"ratio recorded/bare: scheduler CPU {rec['scheduler_cpu_s'] / bare['scheduler_cpu_s']:.3f}, "
          f"wall {rec['wall_s'] / bare['wall_s']:.3f}")


if __name__ == "__main__":
    main()
