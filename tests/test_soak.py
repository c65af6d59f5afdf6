"""The soak: a real sglang server recorded (and watched) for half an hour of steady
traffic, with the rotation and retention ``kvreplay record`` uses by default, scaled
down so that a half hour makes dozens of parts.

It shows what running a recorder for hours needs: the trace writer's memory stays
flat, parts are closed and the oldest retired, the disk a trace takes stays bounded,
the watch keeps up and carries its state from part to part, and every part left on
disk replays alone, strict-clean, on the sglang that recorded it.

Run by scripts/sglang-tier.sh soak (marker ``soak``) in the sglang venv, beside the
rest of CI. ``KVREPLAY_SOAK_S`` sets the traffic's length (1800 s); parts are cut
every thirtieth of it, and the last five are kept."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from servers import free_port
from test_live_server import MOONCAKE, Server, _tiny

from kvreplay.replay.dispatch import replay
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.drive import DriveConfig, drive
from kvreplay.workload.requests import load_requests

pytestmark = [pytest.mark.sglang, pytest.mark.soak]
SOAK_S = float(os.environ.get("KVREPLAY_SOAK_S", "1800"))
KEEP = 5


def _sample(out: Path) -> dict | None:
    found = list(out.glob(".kvreplay-metrics-*.json"))
    if len(found) != 1:
        return None
    try:
        doc = json.loads(found[0].read_text())
    except (OSError, ValueError):
        return None
    trace = out / doc["trace"]
    doc["disk"] = sum(p.stat().st_size for p in trace.glob("part-*")) if trace.is_dir() else 0
    doc["t"] = time.monotonic()
    return doc


def test_a_server_recorded_for_half_an_hour_keeps_memory_and_disk_flat_and_every_part_replays(tmp_path):
    part_s = SOAK_S / 30
    port = free_port()
    model = _tiny(tmp_path / "llama")
    out = tmp_path / "out"
    server = Server(model, out, 16, "--sleep-on-idle", record_args=(
        "--watch", "--metrics-port", str(port), "--part-s", f"{part_s:g}", "--keep-parts", str(KEEP),
        "--minimize-s", "0"))
    samples: list[dict] = []
    served = {"ok": 0, "errors": 0}
    stop = threading.Event()

    def traffic() -> None:
        # Steady and light, as a fleet's quiet hours are (and so that the soak can run beside
        # CI's other steps): four Mooncake requests, then four seconds of nothing, for SOAK_S s.
        # The trace's requests in order (its shared prefixes meet the radix cache as they
        # would), from the start again when they run out.
        reqs = load_requests(MOONCAKE, count=3000, seed=0, block_tokens=16, length_scale=0.03, output_scale=0.2)
        at = 0
        while not stop.is_set():
            res = drive(DriveConfig(url=server.url, concurrency=2, max_output=16), reqs[at:at + 4])
            served["ok"] += res.ok
            served["errors"] += res.errors
            at = (at + 4) % (len(reqs) - 4)
            stop.wait(4.0)

    driver = threading.Thread(target=traffic, daemon=True)
    try:
        t0 = time.monotonic()
        driver.start()
        while time.monotonic() - t0 < SOAK_S:
            time.sleep(min(10.0, SOAK_S / 60))
            got = _sample(out)
            if got is not None:
                samples.append(got)
        stop.set()
        driver.join(timeout=300)
        code = server.stop(signal.SIGTERM)
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert code in (0, 143, -15), server.tail()
    assert served["ok"] > SOAK_S / 10 and served["errors"] == 0, served
    assert len(samples) > 20, "the watch's counters were not there to sample"
    report = _report(samples, part_s)
    print(report)

    # Parts closed and retired all along (a part ends at the first batch after it is due:
    # light traffic stretches each by up to its pauses); the disk a trace takes stays bounded.
    last = samples[-1]
    assert last["parts_retired"] >= 15, report
    assert max(s["parts"] for s in samples) <= KEEP, report
    late = [s for s in samples if s["t"] - samples[0]["t"] > SOAK_S / 4]
    assert max(s["disk"] for s in late) <= 1.5 * max(s["disk"] for s in samples if s not in late) + (4 << 20), report
    # The writer's memory is flat: after the first quarter it grows by under 20 MB, and by under 10%.
    first = max(s["writer_rss_bytes"] for s in samples if s not in late)
    grew = max(s["writer_rss_bytes"] for s in late) - first
    assert grew < min(20 << 20, first // 10), report
    # The watch kept up, checked every call, and found nothing; nothing was dropped.
    assert last["unchecked"] == 0 and last["dropped"] == 0 and last["violations"] == {}, report
    assert max(s["lag_s"] for s in late) < 30, report

    # Every part left replays alone, strict-clean, on the installed sglang; the directory as one trace.
    (trace,) = sorted(out.glob("kvreplay-*.parquet"))
    reader = TraceReader(trace)
    assert len(reader.parts) <= KEEP + 1 and reader.parts[0].name != "part-000000.parquet"
    total = 0
    for part in reader.parts:
        r = replay(part, "sglang", device="cpu")
        assert r.status == "clean", (part.name, r.first_divergence, r.first_violation)
        total += r.calls_replayed
    whole = replay(trace, "sglang", device="cpu")
    assert whole.status == "clean" and whole.calls_replayed == total == reader.count_calls()


def _report(samples: list[dict], part_s: float) -> str:
    t0 = samples[0]["t"]
    lines = [f"soak: {SOAK_S:.0f} s of traffic, a part every {part_s:.0f} s, the last {KEEP} kept",
             "    t_s   calls      rows  parts retired   disk_MB  writer_MB  lag_s"]
    step = max(1, len(samples) // 15)
    for s in samples[::step] + [samples[-1]]:
        lines.append(f"{s['t'] - t0:7.0f} {s['calls']:7d} {s['rows']:9d} {s['parts']:6d} {s['parts_retired']:7d} "
                     f"{s['disk'] / 2**20:9.2f} {s['writer_rss_bytes'] / 2**20:10.1f} {s['lag_s']:6.2f}")
    return "\n".join(lines)
