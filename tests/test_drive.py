"""``kvreplay drive`` against a server that is still starting: ``--wait`` asks again
until it answers, and says so while it waits. The HTTP server here speaks only the
two routes drive uses (sglang's /health and /generate); the live tier drives real
sglang servers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
