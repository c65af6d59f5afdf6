"""Fuzzing what a recording's directory holds: the findings and counter files that
``kvreplay record --watch`` reads back (written by a neighbour as much as by its
writers), the ``/metrics`` endpoint over them, and the parts of a rotated trace.

Whatever the directory holds: only what this run's writers sealed is read back, every
read is bounded in time and memory, ``/metrics`` never answers 5xx nor prints a
traceback; a damaged rotated trace replays clean (what is left is still one recording)
or is bad input (exit 2, one line, nothing stored), never a violation. Each campaign
runs under the memory cap of test_fuzz_surfaces.py. The fast tier runs 20 cases of
each, the slow tier (.ci/run) 1,000 directory cases, 500 scrapes and 500 damaged
rotated traces. ``KVREPLAY_FUZZ_SEED`` picks another campaign."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import run_in_process
from test_fuzz import OK_EXITS, deadline
from test_fuzz_surfaces import memory_cap  # noqa: F401 - the campaigns' memory cap, used as a fixture

from kvreplay.families.sglang.swa import SWAPool
from kvreplay.recorder import live
from kvreplay.recorder.recording import record
from kvreplay.recorder.seal import new_key, seal
from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model

SEED = int(os.environ.get("KVREPLAY_FUZZ_SEED", "20261206"))
FAST = 20
TIERS = [pytest.param(FAST, id="fast")]


def _tiers(slow: int) -> list:
    return [pytest.param(FAST, id="fast"), pytest.param(slow, id="slow", marks=pytest.mark.slow)]


_ODD = [0, -1, 2 ** 63, 10 ** 30, 1.5, "12", "", "x" * 300, None, True, [], {"a": 1}, "\x1b[2J\u202e\x07",
        "\x1b]8;;http://evil\x1b\\", "../../etc/passwd"]


def _value(rng: random.Random) -> object:
    return rng.choice(_ODD) if rng.random() < 0.5 else rng.randint(0, 10 ** 6)


def _doc(rng: random.Random, name: str) -> dict:
    doc = {"trace": rng.choice([name, _value(rng)]), "kind": rng.choice(["violation", "divergence", "watch-stopped",
                                                                          _value(rng)]),
           "rule": rng.choice(["ownership/double-free", _value(rng)]), "call": _value(rng), "calls": _value(rng),
           "rows": _value(rng), "violations": rng.choice([{}, {"r/x": _value(rng)}, _value(rng)]),
           "build": rng.choice(["builtin:swa", "py:evilmod:Pool", _value(rng)])}
    for k in rng.sample(list(doc), rng.randint(0, 3)):
        del doc[k]
    return doc


def _line(rng: random.Random, key: str) -> bytes:
    r = rng.random()
    doc = _doc(rng, "kvreplay-1.parquet")
    if r < 0.3:
        return json.dumps(seal(doc, key)).encode()  # this run's
    if r < 0.5:
        return json.dumps(seal(doc, new_key())).encode()  # another run's key
    if r < 0.6:
        return json.dumps({**seal(doc, key), "rule": "forged"}).encode()  # changed after sealing
    if r < 0.7:
        return json.dumps(doc).encode()
    if r < 0.75:
        return b"[" * rng.randint(10, 300_000)
    if r < 0.8:
        return b"9" * rng.randint(300, 5000)
    if r < 0.85:
        return b"x" * rng.randint(1 << 16, 1 << 21)
    if r < 0.9:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    return json.dumps(seal(doc, key)).encode().replace(b"1", b"1e400", 1)


def _plant(rng: random.Random, path: Path, data: bytes) -> None:
    """What a neighbour puts where a writer's file goes."""
    r = rng.random()
    if r < 0.08:
        os.mkfifo(path)
    elif r < 0.14:
        os.symlink(rng.choice(["/dev/zero", "/dev/urandom", "/etc/passwd", "/nonexistent", "."]), path)
    elif r < 0.18:
        path.mkdir()
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("cases", _tiers(1000))
def test_hostile_recording_directories(cases, tmp_path):
    """The findings file and the counter files, as record --watch reads them back."""
    for i in range(cases):
        rng = random.Random(SEED * 19 + i)
        key = new_key()
        d = tmp_path / f"d{i}"
        d.mkdir()
        lines = [_line(rng, key) for _ in range(rng.randint(0, 12))]
        findings = d / "kvreplay-watch.jsonl"
        got: list[dict] = []
        follower = live._Follower(findings, got.append, key, every_s=0.01)
        _plant(rng, findings, b"\n".join(lines) + rng.choice([b"\n", b""]))
        lines = (findings.read_bytes() if findings.is_file() and not findings.is_symlink() else b"").split(b"\n")
        for k in range(rng.randint(0, 6)):
            _plant(rng, d / f".kvreplay-metrics-{k}.json", _line(rng, key))
        with deadline(20, f"directory case {i}"):
            follower.stop()
            text = live.metrics_text(d, key)
        if findings.is_file() and not findings.is_symlink():
            complete = lines[:-1]  # the last is partial, or empty after the last newline
            expected = [_opened(x, key) for x in complete if _opened(x, key) is not None]
            assert got == expected, i
        else:
            assert got == [], i
        assert all(c.isprintable() or c == "\n" for c in text), (i, text[:300])
        assert "forged" not in text
        shutil.rmtree(d, ignore_errors=True)


def _opened(line: bytes, key: str) -> dict | None:
    from kvreplay.recorder.seal import opened, parse

    return opened(parse(line), key) if line.strip() else None


_REQUESTS = [b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /metrics?x=1 HTTP/1.0\r\n\r\n",
             b"GET / HTTP/1.1\r\n\r\n", b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nabcde",
             b"GET /metrics HTTP/1.1\r\n", b"\x00\xff\r\n\r\n", b"GET " + b"/" * 70_000 + b" HTTP/1.1\r\n\r\n",
             b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n", b"", b"BREW /metrics HTCPCP/1.0\r\n\r\n",
             b"GET /../../etc/passwd HTTP/1.1\r\n\r\n"]


@pytest.mark.parametrize("cases", _tiers(500))
def test_hostile_scrapes(cases, tmp_path, capfd):
    """/metrics over a directory a neighbour also writes to, asked in odd ways."""
    key = new_key()
    rng = random.Random(SEED * 23)
    for k in range(12):
        _plant(rng, tmp_path / f".kvreplay-metrics-{k}.json", _line(rng, key))
    server = live._serve_metrics(tmp_path, 0, key)
    port = server.server_address[1]
    try:
        for i in range(cases):
            rng = random.Random(SEED * 29 + i)
            request = rng.choice(_REQUESTS)
            with deadline(30, f"scrape case {i}"):
                s = socket.create_connection(("127.0.0.1", port), timeout=15)
                try:
                    s.sendall(request[: rng.randint(0, len(request))] if rng.random() < 0.2 else request)
                    if rng.random() < 0.3:
                        continue  # hang up at once
                    s.shutdown(socket.SHUT_WR)
                    answer = b""
                    while chunk := s.recv(65536):
                        answer += chunk
                except OSError:
                    continue
                finally:
                    s.close()
            status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b"000"
            assert not status.startswith(b"5"), (i, request[:60], answer[:200])
    finally:
        server.shutdown()
        server.server_close()
    time.sleep(0.2)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err[-800:]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> tuple[Path, Path]:
    """Two rotated recordings of the same pool and workload (a clean one on builtin:swa)."""
    out = []
    for name in ("a", "b"):
        path = tmp_path_factory.mktemp("rec") / name
        pool = SWAPool(512, 256, 4, need_sort=True)
        rec = record(pool, path, writer="thread", rows_per_batch=64, rotate_rows=200)
        run_model(pool, SynthConfig(scenario="disagg-mtp", out="unused.parquet", requests=30, full_size=512,
                                    swa_size=256), SCENARIOS["disagg-mtp"])
        rec.close()
        out.append(path)
    return out[0], out[1]


def _damage(rng: random.Random, d: Path, other: Path) -> None:
    parts = sorted(d.glob("part-*.parquet"))
    n = len(parts)
    for _ in range(rng.randint(1, 2)):
        r = rng.random()
        k = rng.randrange(n)
        p = d / f"part-{k:06d}.parquet"
        if r < 0.2:
            p.unlink(missing_ok=True)
        elif r < 0.3 and (other / f"part-{k:06d}.parquet").exists():
            p.unlink(missing_ok=True)
            shutil.copy(other / f"part-{k:06d}.parquet", p)
        elif r < 0.4 and p.exists():
            os.replace(p, d / f"part-{rng.randrange(n + 3):06d}.parquet")
        elif r < 0.5 and p.is_file() and not p.is_symlink():
            p.write_bytes(p.read_bytes()[: rng.randint(0, p.stat().st_size)])
        elif r < 0.55:
            p.unlink(missing_ok=True)
            os.mkfifo(p)
        elif r < 0.6:
            p.unlink(missing_ok=True)
            os.symlink(rng.choice(["/dev/zero", str(other / f"part-{k:06d}.parquet"), "/nonexistent"]), p)
        elif r < 0.65:
            (d / rng.choice(["part-x.parquet", "part-1.parquet", "part-0000000000001.parquet"])).write_bytes(b"")
        elif r < 0.75 and p.is_file() and not p.is_symlink():
            try:
                t = pq.read_table(p)
            except Exception:  # noqa: BLE001 - damaged by the step before: this step does nothing
                continue
            md = dict(t.schema.metadata)
            extra = json.loads(md.get(b"kvreplay.extra", b"{}"))
            info = extra.get("part", {})
            key = rng.choice(["index", "recording", "standalone", "first_call"])
            info[key] = _value(rng)
            extra["part"] = info
            md[b"kvreplay.extra"] = json.dumps(extra).encode()
            pq.write_table(t.replace_schema_metadata(md), p)
        elif r < 0.85:
            for q in sorted(d.glob("part-*.parquet"))[: rng.randint(1, n)]:
                q.unlink()  # the oldest parts retired: what is left still replays
        else:
            for q in sorted(d.glob("part-*.parquet"))[-rng.randint(1, n):]:
                q.unlink()  # the newest lost with a crash


@pytest.mark.parametrize("cases", _tiers(500))
def test_hostile_rotated_traces(cases, recordings, tmp_path, capsys):
    a, b = recordings
    for i in range(cases):
        rng = random.Random(SEED * 31 + i)
        d = tmp_path / f"t{i}"
        shutil.copytree(a, d)
        _damage(rng, d, b)
        db = tmp_path / f"k{i}.db"
        command = "replay" if rng.random() < 0.3 else rng.choice(["inspect", "profile"])
        argv = [command, str(d)] + (["-b", "builtin:swa", "--db", str(db)] if command == "replay" else [])
        with deadline(60, f"rotated case {i}"):
            res = run_in_process(capsys, *argv)
        what = f"rotated case {i}: {sorted(p.name for p in d.iterdir())}"
        assert res.returncode in OK_EXITS and res.returncode != 1, (what, res.returncode, res.stderr[-500:])
        assert "Traceback" not in res.stderr + res.stdout, (what, res.stderr[-800:])
        if res.returncode == 2:
            assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, (what, res.stderr)
            assert not db.exists(), (what, "bad input stored a run")
        shutil.rmtree(d, ignore_errors=True)
        db.unlink(missing_ok=True)
