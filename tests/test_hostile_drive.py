"""``kvreplay drive`` against hostile workload files and servers (issue 60, class 8):
a timestamp that cannot be read or ordered is one line and exit 2 naming its line;
every body read from a server is bounded in size and time; a server that stops
answering stops drive (--stall), and a run has a deadline (--deadline). Each case
ends in seconds, with one line on stderr, no traceback, and little memory."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import run_in_process as run

RELEASE = threading.Event()  # handlers that hold a request hold it until the test ends


@pytest.fixture(autouse=True)
def _release_handlers():
    RELEASE.clear()
    yield
    RELEASE.set()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@contextmanager
def _peak_growth(cap: int = 512 << 20) -> Iterator[None]:
    """The block may add at most ``cap`` bytes to the process's peak resident memory."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts from now
    except OSError:
        pytest.skip("this kernel cannot reset a process's peak memory")
    base = _status_kib("VmRSS") << 10
    yield
    grew = (_status_kib("VmHWM") << 10) - base
    assert grew < cap, f"peak memory grew {grew >> 20} MB"


class _Server(BaseHTTPRequestHandler):
    """Answers as ``kind`` says; the rest of the time as sglang does."""

    kind = "ok"
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def _lazy_gib(self) -> None:
        """1 GiB, a MiB at a time, only as fast as it is read."""
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 30))
        self.end_headers()
        block = b" " * (1 << 20)
        try:
            for _ in range(1024):
                self.wfile.write(block)
        except OSError:
            pass

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.kind == "health-gib":
            return self._lazy_gib()
        if self.kind == "health-drip":  # a byte every 0.2 s, for ever
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            try:
                while not RELEASE.wait(0.2):
                    self.wfile.write(b" ")
                    self.wfile.flush()
            except OSError:
                pass
            return
        if self.kind == "redirect":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1:1/huge")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.kind == "garbage":
            self.wfile.write(b"\x1b[2JHELLO THERE\r\n\r\n")
            return
        if self.path == "/v1/models":
            return self._lazy_gib() if self.kind == "models-gib" else self._send(200, b'{"data": [{"id": "m"}]}')
        self._send(200 if self.path == "/health" else 404, b"")

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.kind == "silent":  # takes every request, answers none
            RELEASE.wait(60)
            return
        if self.kind == "slow":
            time.sleep(0.4)
        if self.kind == "dense":  # 16 MB that json would make 450 MB of dicts
            return self._send(200, b"[" + b"{}," * ((16 << 20) // 3 - 2) + b"{}]")
        n_out = body["sampling_params"]["max_new_tokens"]
        self._send(200, json.dumps({"meta_info": {"prompt_tokens": len(body["input_ids"]),
                                                  "completion_tokens": n_out, "cached_tokens": 0}}).encode())

    def log_message(self, *args):
        pass


@contextmanager
def _server(kind: str) -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), type(f"_Server_{kind}", (_Server,), {"kind": kind}))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        RELEASE.set()
        srv.shutdown()
        srv.server_close()


def _one_line(res, code: int, *words: str) -> str:
    assert res.returncode == code, (res.returncode, res.stderr[-600:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-800:]
    lines = [line for line in res.stderr.splitlines() if not line.startswith("drive ")]  # progress lines
    assert len(lines) == 1, res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_azure_timestamps_that_mix_zones_or_cannot_be_read_are_one_line_naming_the_line(tmp_path, capsys):
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    cases = {
        "mixed.csv": "2023-11-16 18:15:46.6805900,10,3\n2023-11-16 18:15:47.6805900+00:00,10,3\n",
        "mixed-z.csv": "2023-11-16T18:15:46Z,10,3\n2023-11-16T18:15:47,10,3\n",
        "month.csv": "2023-11-16 18:15:46,10,3\n2023-13-16 18:15:47,10,3\n",
        "zone.csv": "2023-11-16 18:15:46,10,3\n2023-11-16 18:15:47+99:00,10,3\n",
        "words.csv": "2023-11-16 18:15:46,10,3\nyesterday,10,3\n",
        "long.csv": "2023-11-16 18:15:46,10,3\n" + "2023-11-16 18:15:47" + "0" * 5000 + ",10,3\n",
    }
    for name, rows in cases.items():
        (tmp_path / name).write_text(head + rows)
        t0 = time.monotonic()
        res = run(capsys, "drive", "http://127.0.0.1:9", "-w", str(tmp_path / name), "-n", "5")
        line = _one_line(res, 2, f"{name}:3:", "TIMESTAMP" if "mixed" not in name else "mix zones")
        assert line.startswith("kvreplay: error:") and time.monotonic() - t0 < 5, line
    # zones that agree, offsets that differ: one clock, read as such
    (tmp_path / "zones.csv").write_text(head + "2023-11-16T18:15:46.6805900Z,10,3\n2023-11-16T20:15:47+02:00,10,3\n")
    from kvreplay.workload.requests import load_requests

    reqs = load_requests(tmp_path / "zones.csv", count=5, seed=0, block_tokens=16)
    assert [round(r.arrival_ms) for r in reqs] == [0, 319]


def test_a_gib_health_answer_is_refused_after_a_bounded_read(capsys):
    for kind, api in (("health-gib", "sglang"), ("models-gib", "openai")):
        with _server(kind) as url, _peak_growth(256 << 20):
            t0 = time.monotonic()
            res = run(capsys, "drive", url, "--api", api, "-n", "2")
            took = time.monotonic() - t0
        _one_line(res, 2, "answered /", "over", "KB" if api == "sglang" else "1 MB")
        assert took < 5, (kind, took)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_health_answer_that_drips_for_ever_ends_in_the_probe_time(capsys, monkeypatch):
    from kvreplay.workload import drive

    monkeypatch.setattr(drive, "PROBE_TIMEOUT_S", 1.5)
    with _server("health-drip") as url:
        t0 = time.monotonic()
        res = run(capsys, "drive", url, "-n", "2")
        took = time.monotonic() - t0
    _one_line(res, 2, "unreachable", "no whole answer")
    assert took < 6, took


def test_a_server_that_never_answers_anything_is_unreachable_in_the_probe_time(capsys, monkeypatch):
    from kvreplay.workload import drive

    monkeypatch.setattr(drive, "PROBE_TIMEOUT_S", 1.0)
    with socket.socket() as sock:  # takes connections (the kernel does), reads nothing, says nothing
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        t0 = time.monotonic()
        res = run(capsys, "drive", f"http://127.0.0.1:{sock.getsockname()[1]}", "-n", "50")
        took = time.monotonic() - t0
    _one_line(res, 2, "unreachable")
    assert took < 5, took


def test_a_server_that_stops_answering_stops_drive_at_the_stall_limit(capsys):
    with _server("silent") as url:
        t0 = time.monotonic()
        res = run(capsys, "drive", url, "-n", "40", "-c", "4", "--stall", "1.5", "--json")
        took = time.monotonic() - t0
    line = _one_line(res, 1, "drive stopped early", "answered nothing in 1.5 s (--stall 1.5)", "4 request(s) in flight",
                     "36 not sent")
    assert line.startswith("kvreplay: drive stopped early:")
    out = json.loads(res.stdout)
    assert out["ok"] == 0 and out["errors"] == 40 and "--stall" in out["stopped"], out
    assert 1.5 <= took < 5, took


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_the_deadline_ends_a_run_that_still_makes_progress(capsys):
    with _server("slow") as url:
        t0 = time.monotonic()
        res = run(capsys, "drive", url, "-n", "100", "-c", "1", "--deadline", "1.5", "--json")
        took = time.monotonic() - t0
    _one_line(res, 1, "the deadline passed (--deadline 1.5)")
    out = json.loads(res.stdout)
    assert 1 <= out["ok"] < 10 and out["ok"] + out["errors"] == 100, out
    assert took < 5, took


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_time_between_arrivals_is_not_a_stall(tmp_path, capsys):
    trace = tmp_path / "w.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 20, "output_length": 2}) + "\n"
                             for t in (0, 1200, 2400)))
    with _server("ok") as url:
        res = run(capsys, "drive", url, "-w", str(trace), "-n", "3", "--time-scale", "1", "--stall", "0.5", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] == 3 and out["stopped"] == "" and out["elapsed_s"] >= 2.4, out


def test_answers_that_parse_into_far_more_than_their_bytes_are_refused_unparsed(capsys):
    with _server("dense") as url, _peak_growth(512 << 20):
        res = run(capsys, "drive", url, "-n", "8", "-c", "8", "--json")
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    assert out["errors"] == 8 and all(k.startswith("bad answer") for k in out["error_kinds"]), out


def test_redirects_and_answers_that_are_not_http_are_one_line(capsys):
    for kind, words in (("redirect", ("HTTP 302",)), ("garbage", ("no HTTP answer",))):
        with _server(kind) as url:
            res = run(capsys, "drive", url, "-n", "2")
        line = _one_line(res, 2, *words)
        assert "\x1b" not in line, line


def test_limits_that_are_not_numbers_of_seconds_or_threads_are_bad_input(capsys):
    for flag, value in (("--stall", "0"), ("--stall", "nan"), ("--stall", "-1"), ("--deadline", "inf"),
                        ("--deadline", "0"), ("--concurrency", "100000"), ("--concurrency", "0")):
        res = run(capsys, "drive", "http://127.0.0.1:1", flag, value, "-n", "1")
        _one_line(res, 2, flag)
