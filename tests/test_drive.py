"""``kvreplay drive`` against a server that is still starting: ``--wait`` asks again
until it answers, and says so while it waits. The HTTP server here speaks only the
two routes drive uses (sglang's /health and /generate); the live tier drives real
sglang servers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import PythonPeak
from conftest import run_in_process as run
from servers import free_port


class _Generate(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n_out = body["sampling_params"]["max_new_tokens"]
        out = json.dumps({"output_ids": [5] * n_out, "meta_info": {
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": n_out, "cached_tokens": 0}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_wait_sends_once_a_late_server_answers(capsys):
    port = free_port()
    servers: list[ThreadingHTTPServer] = []

    def start_later():
        time.sleep(2.5)
        srv = ThreadingHTTPServer(("127.0.0.1", port), _Generate)
        servers.append(srv)
        srv.serve_forever()

    threading.Thread(target=start_later, daemon=True).start()
    try:
        r = run(capsys, "drive", f"http://127.0.0.1:{port}", "--wait", "120", "-n", "5", "-c", "2", "--json")
    finally:
        for srv in servers:
            srv.shutdown()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] == 5
    assert f"waiting for http://127.0.0.1:{port} to answer" in r.stderr


def test_without_wait_a_server_not_up_is_one_line_that_names_the_option(capsys):
    port = free_port()
    r = run(capsys, "drive", f"http://127.0.0.1:{port}", "-n", "1")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "unreachable" in line and "--wait" in line


def test_wait_gives_up_after_its_time_with_one_line(capsys):
    port = free_port()
    t0 = time.monotonic()
    r = run(capsys, "drive", f"http://127.0.0.1:{port}", "--wait", "2", "-n", "1")
    assert time.monotonic() - t0 >= 2
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("kvreplay: error: server")
    assert "after waiting 2 s" in r.stderr


def test_a_negative_wait_is_bad_input(capsys):
    r = run(capsys, "drive", "http://127.0.0.1:1", "--wait", "-1", "-n", "1")
    assert r.returncode == 2 and "--wait" in r.stderr


# A server that answers /generate wrongly, each in one of the ways a hostile or broken one
# does; drive must count each request as failed, in bounded time and memory.
class _Hostile(_Generate):
    kind = "list"

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.kind == "silent":  # accepts, never answers
            time.sleep(30)
            return
        self.send_response(200)
        if self.kind == "list":
            out = b"[1, 2, 3]"
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        elif self.kind == "drip":  # a byte a second: no per-read timeout ever passes
            self.end_headers()
            try:
                for _ in range(30):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass
        elif self.kind == "huge":  # a 1 GiB body, sent as fast as it is read
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            block = b" " * (1 << 20)
            try:
                for _ in range(1024):
                    self.wfile.write(block)
            except OSError:
                pass


def _hostile_server(kind: str) -> tuple[ThreadingHTTPServer, str]:
    handler = type(f"_Hostile_{kind}", (_Hostile,), {"kind": kind})
    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.slow
def test_answers_that_are_not_answers_are_failures_in_bounded_time_and_memory(capsys):
    peaks = {}
    for kind, said in (("list", "bad answer"), ("silent", "timeout"), ("drip", "timeout"),
                       ("huge", "bad answer: an answer over 16 MB")):
        srv, url = _hostile_server(kind)
        try:
            t0 = time.monotonic()
            with PythonPeak() as peak:
                r = run(capsys, "drive", url, "-n", "2", "-c", "2", "--timeout", "3", "--json")
            took = time.monotonic() - t0
        finally:
            srv.shutdown()
        peaks[kind] = peak.bytes
        assert r.returncode == 1, (kind, r.stderr)
        res = json.loads(r.stdout)
        assert res["ok"] == 0 and res["errors"] == 2, (kind, res)
        assert any(said.lower() in k.lower() for k in res["error_kinds"]), (kind, res["error_kinds"])
        assert took < 15, (kind, took)
    # Two answers cut at 16 MB each, and the buffers that read them: far below the 1 GiB
    # body the server offers, so no answer was held whole.
    assert max(peaks.values()) < 96 << 20, peaks


def test_options_that_are_not_numbers_of_seconds_are_bad_input(capsys):
    for flag, value in (("--wait", "nan"), ("--wait", "inf"), ("--timeout", "0"), ("--timeout", "nan"),
                        ("--time-scale", "nan")):
        r = run(capsys, "drive", "http://127.0.0.1:1", flag, value, "-n", "1")
        assert r.returncode == 2 and flag in r.stderr, (flag, value, r.stderr)


def test_a_hostile_workload_file_is_one_line_before_anything_is_sent(capsys, tmp_path):
    good = {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1, 2]}
    cases = {
        "utf8.jsonl": b'{"timestamp": 0, "input_length": 1\xff\xfe, "output_length": 1}\n',
        "utf8.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,\xff\xfe,3\n",
        "deep.jsonl": ("[" * 100_000 + "]" * 100_000 + "\n").encode(),
        "inf.jsonl": json.dumps({**good, "input_length": 1e400}).replace("Infinity", "1e400").encode(),
        "huge.jsonl": json.dumps({**good, "output_length": 10 ** 12}).encode(),
        "negative.jsonl": json.dumps({**good, "input_length": -5}).encode(),
        "nan.jsonl": json.dumps({**good, "timestamp": float("nan")}).encode(),
        "hash.jsonl": json.dumps(good).replace("[1, 2]", "[1e400]").encode(),
        "negative.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-4,3\n",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    sparse = tmp_path / "sparse.jsonl"  # 2 GiB of one line: read a MiB at a time, refused at the first
    with open(sparse, "wb") as f:
        f.write(b'{"timestamp": 0, "x": "')
        f.truncate(2 << 30)
    for path in [*(tmp_path / n for n in cases), sparse]:
        t0 = time.monotonic()
        r = run(capsys, "drive", "http://127.0.0.1:1", "-w", str(path), "-n", "5")
        assert r.returncode == 2, (path.name, r.stderr)
        line = r.stderr.strip()
        assert line.startswith("kvreplay: error:") and "\n" not in line and path.name in line, (path.name, line)
        assert "Traceback" not in r.stderr and time.monotonic() - t0 < 10, path.name


class _DecodeOnly(_Generate):
    """A disaggregated decode server: sglang's crashes on a request that names no
    prefill side; this one answers 400, and notes what it was sent."""

    rooms: list[object] = []

    def do_POST(self):  # noqa: N802
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        if body.get("bootstrap_host") is None:
            self.send_response(400)
            self.end_headers()
            return
        type(self).rooms.append((body["bootstrap_host"], body.get("bootstrap_room")))
        n_out = body["sampling_params"]["max_new_tokens"]
        out = json.dumps({"meta_info": {"prompt_tokens": len(body["input_ids"]), "completion_tokens": n_out,
                                        "cached_tokens": 0}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_disagg_decode_names_a_prefill_side_and_a_room_per_request(capsys):
    port = free_port()
    srv = ThreadingHTTPServer(("127.0.0.1", port), _DecodeOnly)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        plain = run(capsys, "drive", f"http://127.0.0.1:{port}", "-n", "3", "--json")
        _DecodeOnly.rooms.clear()
        r = run(capsys, "drive", f"http://127.0.0.1:{port}", "-n", "12", "-c", "4", "--disagg-decode", "--json")
    finally:
        srv.shutdown()
    assert plain.returncode == 1 and json.loads(plain.stdout)["errors"] == 3  # without it: refused
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] == 12
    hosts, rooms = zip(*_DecodeOnly.rooms, strict=True)
    assert set(hosts) == {"2.2.2.2"}  # sglang's fake-transfer host
    assert len(set(rooms)) == 12 and all(type(x) is int for x in rooms)


def test_disagg_decode_on_an_api_without_one_is_bad_input(capsys):
    r = run(capsys, "drive", "http://127.0.0.1:1", "--api", "openai", "--disagg-decode", "-n", "1")
    assert r.returncode == 2 and "--disagg-decode" in r.stderr and "--api sglang" in r.stderr, r.stderr
