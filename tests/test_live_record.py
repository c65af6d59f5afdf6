"""``kvreplay record``: every Python process of a command records the allocators it builds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvreplay.replay.dispatch import replay
from kvreplay.trace.reader import TraceReader

TARGET = "kvreplay.families.sglang.swa:SWAPool"
DRIVE = """
import torch
from kvreplay.families.sglang.swa import SWAPool

def t(*v):
    return torch.tensor(v, dtype=torch.int64)

def work(n):
    pool = SWAPool(256, 64, 4, need_sort=False)
    for _ in range(n):
        pool.free(pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4))
"""


def _run(tmp_path, body: str, *extra: str) -> subprocess.CompletedProcess:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(DRIVE) + textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(tmp_path / "out"),
                           "--class", TARGET, *extra, "--", sys.executable, str(prog)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_process_records_its_allocator_and_the_exit_code_passes_through(tmp_path):
    res = _run(tmp_path, """
        import multiprocessing as mp, sys
        if __name__ == "__main__":
            child = mp.get_context("spawn").Process(target=work, args=(5,))
            child.start(); child.join()
            work(3)
            sys.exit(3)
    """, "--json")
    assert res.returncode == 3, res.stderr
    traces = json.loads(res.stdout)["traces"]
    assert len(traces) == 2
    pids = {TraceReader(p).meta.pid for p in traces}
    assert len(pids) == 2
    calls = sorted(replay(p, "builtin:swa", device="cpu").calls_replayed for p in traces)
    assert calls == [6, 10]
    for p in traces:
        assert replay(p, "builtin:swa", device="cpu").status == "clean"


def test_sigterm_to_kvreplay_record_reaches_the_program_and_its_traces_are_finished(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(DRIVE) + textwrap.dedent("""
        import time
        work(40)
        print("ready", flush=True)
        time.sleep(120)
    """))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(out), "--class", TARGET,
                             "--", sys.executable, str(prog)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert code == 128 + signal.SIGTERM
    (trace,) = out.glob("kvreplay-*.parquet")
    r = replay(trace, "builtin:swa", device="cpu")
    assert r.calls_replayed == 80 and r.status == "clean"


def test_print_env_shows_how_to_record_servers_launched_another_way(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(tmp_path), "--print-env",
                          "--json"], capture_output=True, text=True, timeout=60)
    env = json.loads(res.stdout)
    assert env["KVREPLAY_RECORD_DIR"] == str(tmp_path.resolve())
    assert env["PYTHONPATH"].split(":")[0].endswith("kvreplay/recorder/_site")


def test_no_command_or_a_missing_one_is_a_one_line_error(tmp_path):
    for cmd in ([], ["--", "no-such-program-kvreplay"]):
        res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(tmp_path), *cmd],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2
        assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1


@pytest.mark.slow
def test_record_flight_writes_only_the_last_calls_when_the_server_fails(tmp_path):
    res = _run(tmp_path, """
        import sys
        pool = SWAPool(256, 64, 4, need_sort=False)
        for _ in range(400):
            pool.free(pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4))
        try:
            pool.free_segment(t(1, 2), start_pos=1)  # not page-aligned: the pool raises
        except AssertionError:
            sys.exit(7)
    """, "--flight", "100", "--json")
    assert res.returncode == 7, res.stderr
    traces = json.loads(res.stdout)["traces"]
    assert len(traces) == 1 and "kvreplay-flight-" in traces[0]
    dump = TraceReader(traces[0])
    calls = list(dump.calls(top_level_only=True))
    assert 100 <= len(calls) < 400 and calls[-1].exc_type == "AssertionError"
    assert dump.meta.initial_state is not None
    r = replay(traces[0], "builtin:swa", device="cpu")
    assert r.divergences == [] and r.calls_replayed == len(calls)


@pytest.mark.slow
def test_record_counters_every_reaches_each_recorded_process(tmp_path):
    import pyarrow.parquet as pq

    res = _run(tmp_path, """
        work(8)
    """, "--counters-every", "4", "--json")
    assert res.returncode == 0, res.stderr
    (trace,) = json.loads(res.stdout)["traces"]
    rows = pq.read_table(trace, columns=["depth", "available"]).to_pylist()
    top = [r for r in rows if r["depth"] == 0]
    assert len(top) == 16 and [r["available"] is not None for r in top] == [False, False, False, True] * 4
    assert replay(trace, "builtin:swa", device="cpu").status == "clean"


TREE_KILL = """
import os, signal, sys, time, multiprocessing as mp

def descendants(pid):
    # What sglang's kill_process_tree does with psutil: follow parent links in /proc,
    # whatever session or process group a descendant is in.
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out

def scheduler(n, ready):
    work(n)
    ready.set()
    time.sleep(120)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=scheduler, args=(N, ready))
    child.start()
    assert ready.wait(120)
    time.sleep(1.5)  # calls finished more than a second before the kill are the promise
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_server_that_sigkills_its_whole_process_tree_still_leaves_every_call(tmp_path):
    # sglang's shutdown (Ctrl-C or SIGTERM) SIGKILLs the scheduler and every descendant
    # of the launcher: the trace writer must not be one of them.
    res = _run(tmp_path, TREE_KILL.replace("N, ready", "25, ready"), "--json")
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    (trace,) = json.loads(res.stdout)["traces"]
    r = replay(trace, "builtin:swa", device="cpu")
    assert (r.calls_replayed, r.status) == (50, "clean")


@pytest.mark.slow
def test_a_pool_built_with_the_kv_cache_dtype_is_recorded_and_replays(tmp_path):
    # sglang passes its allocators the KV cache's dtype (bfloat16 on GPU servers,
    # float8 when quantised); the trace contract takes what servers pass.
    res = _run(tmp_path, """
        import torch
        for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
            pool = SWAPool(256, 64, 4, dtype=dt, need_sort=False)
            pool.free(pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4))
    """, "--json")
    assert res.returncode == 0, res.stderr
    traces = json.loads(res.stdout)["traces"]
    dtypes = sorted(TraceReader(p).meta.ctor_args["dtype"] for p in traces)
    assert dtypes == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"]
    for p in traces:
        assert replay(p, "builtin:swa", device="cpu").status == "clean"


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_record_leaves_the_programs_environment_as_it_was(tmp_path):
    # kvreplay pins its own torch to one thread; the server it records keeps its own
    # choice (a recorded server with fewer threads is not the server measured bare).
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    prog = tmp_path / "prog.py"
    prog.write_text("import os; print(os.environ.get('OMP_NUM_THREADS', 'unset'))")
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(tmp_path / "out"), "--",
                          sys.executable, str(prog)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.splitlines()[0] == "unset", res.stdout + res.stderr


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_what_the_command_leaves_running_is_ended_with_the_recording(tmp_path):
    """Children that outlive the command (a server's workers left behind) do not outlive
    kvreplay record: it ends its command's process group once the command has ended."""
    res = _run(tmp_path, """
        import subprocess, sys
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(5)]
        print(" ".join(str(k.pid) for k in kids), flush=True)
        work(3)
    """, "--json")
    assert res.returncode == 0, res.stderr
    kids = [int(p) for p in res.stdout.split("\n")[0].split()]
    time.sleep(0.5)
    alive = [p for p in kids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    assert not alive, alive
    assert len(json.loads(res.stdout[res.stdout.index("{"):])["traces"]) == 1


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_command_that_dies_at_once_still_has_its_trace_reported(tmp_path):
    """os._exit soon after its calls (the recorder has handed them over): no atexit, the
    writer finishes the file after the command is gone, and record waits for it before
    it says what it wrote."""
    res = _run(tmp_path, """
        import os, time
        work(4)
        time.sleep(0.5)
        os._exit(0)
    """, "--json")
    assert res.returncode == 0, res.stderr
    (trace,) = json.loads(res.stdout)["traces"]
    assert replay(trace, "builtin:swa", device="cpu").calls_replayed == 8
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [os.path.basename(trace)]


def test_an_out_that_takes_no_files_is_refused_before_the_command_starts(tmp_path):
    marker = tmp_path / "started"
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", "/proc/self", "--",
                          sys.executable, "-c", f"open({str(marker)!r}, 'w')"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "cannot write there" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not marker.exists()
