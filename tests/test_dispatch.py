"""One answer to "where and how does this replay run" (replay/dispatch.py), one run loop
(replay/loop.py) under every family's replayer."""

from __future__ import annotations

import ast
from dataclasses import asdict
from pathlib import Path

import pytest

from kvreplay.families.sglang.replayer import Replayer
from kvreplay.families.vllm.replayer import BlockReplayer
from kvreplay.jobs.stored_replay import replay_and_store
from kvreplay.replay import dispatch
from kvreplay.replay.loop import ReplayLoop
from kvreplay.replay.segments import replay_segments

ROOT = Path(__file__).resolve().parents[1]
PAGE0 = ROOT / "traces" / "sglang-0.5.23-swa-page0.parquet"
VLLM = ROOT / "traces" / "vllm-11565-pin-before-room-check.parquet"
# Where a replay runs: chosen in replay/dispatch.py alone, from these.
RUNTIMES = {"replay_in_worker", "replay_many_in_worker", "replay_segments", "worker_unit"}


def test_no_job_chooses_where_a_replay_runs_but_dispatch():
    offenders = []
    for path in sorted((ROOT / "kvreplay").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kvreplay/replay/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{rel}: imports {n}" for n in names if n in RUNTIMES]
    assert offenders == []


def test_every_replayer_runs_the_shared_loop():
    for cls in (Replayer, BlockReplayer):
        assert issubclass(cls, ReplayLoop) and "run" not in vars(cls) and "_diverge" not in vars(cls)


def _same(a, b) -> None:
    da, db = asdict(a), asdict(b)
    for d in (da, db):
        for k in ("wall_s", "calls_per_s", "cpu_s", "trace", "timeline"):
            d.pop(k, None)
        # (a build's own assertion message: under pytest it carries object addresses)
        for div in [*d["divergences"], *([d["first_divergence"]] if d["first_divergence"] else [])]:
            div["message"] = div["message"].splitlines()[0]
    assert da == db


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
@pytest.mark.parametrize("trace, build", [(PAGE0, "builtin:swa@unfiltered-page0"), (VLLM, "builtin:vllm")])
def test_the_library_the_stored_replay_and_dispatch_give_one_report(trace, build):
    from kvreplay import __version__

    ran = dispatch.run(trace, build, device="cpu")
    assert ran.version == f"kvreplay {__version__}"  # what a stored run says a builtin resolved to
    _same(ran.report, dispatch.replay(trace, build, device="cpu"))
    _same(ran.report, replay_and_store(trace, build, store=False, device="cpu").report)
    # jobs: a family whose replayer cannot start at a checkpoint replays whole, as serially
    _same(ran.report, dispatch.run(trace, build, device="cpu", jobs=2).report)


def test_a_family_without_segments_is_never_split():
    assert replay_segments(str(VLLM), "builtin:vllm", jobs=2) is None
