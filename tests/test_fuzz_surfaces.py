"""Fuzzing the surfaces beyond the trace reader: workload files (``drive -w``), a server's
answers (a hostile HTTP server ``drive`` talks to), build specs, and ``serve``'s URLs.
vLLM traces are fuzzed with the others in test_fuzz.py.

Whatever the input: exit 0, 1, 2 or 125; one line on stderr for bad input; no
traceback; nothing stored; an answer within the case's deadline; no page answers 500.
Each campaign runs under a memory cap (its peak may grow 1 GiB at most). The fast tier
runs 20 cases of each, the slow tier (.ci/run) 500 of each (2,000 in all).
``KVREPLAY_FUZZ_SEED`` picks another campaign."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import run_in_process
from servers import free_port
from test_fuzz import OK_EXITS, deadline

SEED = int(os.environ.get("KVREPLAY_FUZZ_SEED", "20261204"))
FAST, SLOW = 20, 500
TIERS = [pytest.param(FAST, id="fast"), pytest.param(SLOW, id="slow", marks=pytest.mark.slow)]
CORPUS = Path(__file__).resolve().parents[1] / "traces"
SMALL_TRACE = CORPUS / "sglang-0.5.23-swa-page0.parquet"

# Values a hostile record puts where a number belongs.
_ODD = [0, -1, -(10 ** 12), 10 ** 12, 2 ** 63, 10 ** 400, 1.5, float("nan"), float("inf"), "12", "", "x" * 300,
        None, True, [], [1, 2], {"a": 1}, "\u202e\u0000", 2 ** 24, 2 ** 24 + 1]


def _number(rng: random.Random) -> object:
    return rng.choice(_ODD) if rng.random() < 0.4 else rng.randint(1, 4000)


def _json_value(rng: random.Random) -> str:
    v = _number(rng)
    try:
        return json.dumps(v)
    except ValueError:
        return "1e400"


def _workload(rng: random.Random, path: Path) -> None:
    """A Mooncake JSONL or an Azure CSV, most records sane, some damaged in one of many ways."""
    lines: list[bytes] = []
    mooncake = rng.random() < 0.6
    if not mooncake:
        lines.append(rng.choice([b"TIMESTAMP,ContextTokens,GeneratedTokens", b"TIMESTAMP,Other", b"TIMESTAMP"]))
    for k in range(rng.randint(0, 8)):
        if mooncake:
            fields = {"timestamp": _json_value(rng), "input_length": _json_value(rng),
                      "output_length": _json_value(rng),
                      "hash_ids": "[" + ",".join(_json_value(rng) for _ in range(rng.randint(0, 5))) + "]"}
            for key in rng.sample(list(fields), rng.randint(0, 1)):
                del fields[key]
            line = ("{" + ",".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()
        else:
            stamp = rng.choice(["2023-11-16 18:15:46.6805900", "not a time", "", "9999-99-99"])
            line = f"{stamp},{_number(rng)},{_number(rng)}".encode()
        damage = rng.random()
        if damage < 0.08:
            line = line[: rng.randint(0, len(line))]
        elif damage < 0.14:
            line = line.replace(b"1", b"\xff\xfe", 1)
        elif damage < 0.18:
            line = b"[" * rng.randint(1000, 50_000) + b"]" * rng.randint(0, 50_000)
        elif damage < 0.21:
            line = b"x" * rng.randint(1 << 20, 3 << 20)
        lines.append(line)
    path.write_bytes(b"\n".join(lines) + rng.choice([b"\n", b""]))


GROWTH_CAP = 1 << 30  # what a campaign may add to the process's peak resident memory


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.fixture(autouse=True)
def memory_cap():
    """Each campaign under a memory cap: its peak resident memory (the kernel's high-water
    mark, reset at the start) may grow at most GROWTH_CAP over what the process held,
    and an address-space limit stops a bomb that would take the machine first."""
    import resource

    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    except OSError:
        pytest.skip("this kernel cannot reset a process's peak memory")
    base = _status_kib("VmRSS") * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _status_kib("VmSize") * 1024 + 4 * GROWTH_CAP  # virtual: thread stacks and arenas count too
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    grew = _status_kib("VmHWM") * 1024 - base
    assert grew < GROWTH_CAP, f"the campaign's peak resident memory grew {grew / 2**20:.0f} MB"


def _check(res, what: str, wrote: Path | None = None) -> None:
    assert res.returncode in OK_EXITS, (what, res.returncode, res.stderr[-500:])
    assert "Traceback" not in res.stderr + res.stdout, (what, res.stderr[-800:])
    if res.returncode == 2:
        assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, (what, res.stderr[-500:])
        if wrote is not None:
            assert not wrote.exists(), (what, "bad input wrote a database")


@pytest.mark.parametrize("cases", TIERS)
def test_hostile_workload_files(cases, tmp_path, capsys):
    for i in range(cases):
        rng = random.Random(SEED * 7 + i)
        path = tmp_path / f"w{i % 4}.{rng.choice(['jsonl', 'csv'])}"
        _workload(rng, path)
        with deadline(30, f"workload case {i}"):
            res = run_in_process(capsys, "drive", "http://127.0.0.1:9", "-w", str(path), "-n", "5")
        _check(res, f"workload case {i}")
        assert res.returncode == 2, (i, res.stdout[-300:])  # a bad file, or else the unreachable server


class _Answers(BaseHTTPRequestHandler):
    """Answers /generate from a seeded palette of wrong (and some right) answers."""

    rng = random.Random(0)
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.lock:
            r = self.rng.random()
            status = self.rng.choice([200, 200, 200, 201, 204, 400, 404, 500, 503])
            body = self.rng.choice([
                b'{"meta_info": {"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 0}}',
                b'{"meta_info": {"prompt_tokens": -5, "completion_tokens": "x"}}', b"[1, 2, 3]", b'"text"',
                b"null", b'{"meta_info": []}', b"{", b"\xff\xfe\x00", b'{"meta_info": {"prompt_tokens": 1e400}}',
                b"[" * 5000, json.dumps({"meta_info": {"completion_tokens": 2 ** 70}}).encode(), b""])
            lie = self.rng.random() < 0.1
            pause = self.rng.choice([0.0, 0.0, 0.0, 0.3, 1.5]) if r < 0.2 else 0.0
        time.sleep(pause)
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body) + (1000 if lie else 0)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("cases", TIERS)
def test_hostile_server_answers(cases, capsys):
    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), _Answers)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        for i in range(cases):
            _Answers.rng = random.Random(SEED * 11 + i)
            with deadline(30, f"answer case {i}"):
                res = run_in_process(capsys, "drive", url, "-n", "3", "-c", "3", "--timeout", "1", "--json")
            _check(res, f"answer case {i}")
            assert res.returncode in (0, 1), (i, res.stderr[-300:])
            out = json.loads(res.stdout)
            assert out["ok"] + out["errors"] == 3, (i, out)
    finally:
        srv.shutdown()


_SPEC_HEADS = ["builtin:", "builtin:swa@", "git:", "git:/tmp@", "sglang==", "vllm==", "sglang", "vllm", "", "py:",
               "=="]
_SPEC_PIECES = ["swa", "paged", "stale-tail", "..", "@", ":", "/", "0.5.", "1", "post", "HEAD", "\u00e9", " ", "%",
                "$(x)", "\n", "a" * 50, "../..", "vllm", "=="]


def _spec(rng: random.Random) -> str:
    head = rng.choice(_SPEC_HEADS)
    body = "".join(rng.choice(_SPEC_PIECES) for _ in range(rng.randint(0, 6)))
    if head == "py:":  # a py: build imports what it names, by design: only names that exist nowhere
        body = f"kvfuzz_no_module_{rng.randrange(10 ** 6)}:{body[:20] or 'X'}"
    if rng.random() < 0.03:
        body += "z" * rng.randint(4000, 20_000)
    return head + body


@pytest.mark.parametrize("cases", TIERS)
def test_hostile_build_specs(cases, tmp_path, capsys, monkeypatch):
    # Release indexes as kvreplay caches them: no spec the fuzzer makes names a listed version,
    # so nothing is ever downloaded.
    cache = tmp_path / "cache"
    (cache / "releases").mkdir(parents=True)
    for engine in ("sglang", "vllm"):
        (cache / "releases" / f"{engine}-index.json").write_text(json.dumps(["0.0.1"]))
    monkeypatch.setenv("KVREPLAY_CACHE", str(cache))
    for i in range(cases):
        spec = _spec(random.Random(SEED * 13 + i))
        db = tmp_path / f"k{i}.db"  # a database of its own: bad input must leave none
        with deadline(60, f"spec case {i}: {spec[:80]!r}"):
            res = run_in_process(capsys, "replay", str(SMALL_TRACE), "--build", spec, "--db", str(db))
        _check(res, f"spec case {i}: {spec[:80]!r}", db)
        assert len(res.stderr) < 2000, (spec[:80], res.stderr[:300])
        db.unlink(missing_ok=True)


def _url(rng: random.Random) -> str:
    pieces = ["1", "0", "-1", str(2 ** 64), "abc", "%00", "%ff", "..", "\u00e9", "a" * rng.randint(1, 70_000), "",
              "deadbeef", "?", "&", "=", "[", "]"]
    route = rng.choice(["/runs/", "/traces/", "/compare?a=", "/?trace=", "/?since=", "/?status=", "/assets/", "/",
                        "/api/runs", "/nope/"])
    return route + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 4)))


@pytest.mark.parametrize("cases", TIERS)
def test_hostile_dashboard_urls(cases, tmp_path):
    from kvreplay.jobs.dashboard import create_app
    from kvreplay.jobs.stored_replay import replay_and_store
    from kvreplay.store.db import open_store

    db = str(tmp_path / "k.db")
    replay_and_store(str(SMALL_TRACE), "builtin:swa", db=db)
    client = create_app(open_store(db)).test_client()
    for i in range(cases):
        url = _url(random.Random(SEED * 17 + i))
        with deadline(30, f"url case {i}"):
            status = client.get(url).status_code
        assert status in (200, 204, 400, 404, 405), (url[:100], status)
