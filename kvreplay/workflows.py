"""Jobs that join the replayer and the store; the CLI commands call these."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvreplay import __version__
from kvreplay.recorder.reader import TraceReader
from kvreplay.replayer.engine import Replayer, ReplayReport
from kvreplay.replayer.workload.synth import SynthConfig, SynthResult, synthesize
from kvreplay.store.db import Store, open_store
from kvreplay.store.runs import TraceInfo, file_hash, get_run, record_run, run_to_dict


def trace_info(reader: TraceReader, calls: int | None = None) -> TraceInfo:
    return TraceInfo(path=str(reader.path.resolve()), content_hash=file_hash(reader.path),
                     pool_class=reader.meta.pool_class, family=reader.meta.family, meta=asdict(reader.meta),
                     rows=reader.num_rows, calls=calls)


def build_version(replayer: Replayer) -> str:
    """What the build resolved to: kvreplay's version for builtins, else its package's."""
    top = type(replayer.pool).__module__.split(".")[0]
    if top == "kvreplay":
        return f"kvreplay {__version__}"
    ver = getattr(sys.modules.get(top), "__version__", "")
    return f"{top} {ver}".strip()


@dataclass
class StoredReplay:
    report: ReplayReport
    run_id: int | None


def replay_and_store(trace: str | Path, build: str, *, db: str | None = None, store: bool = True,
                     progress: Callable[[int, int], None] | None = None, **options: Any) -> StoredReplay:
    """Replay and, unless ``store`` is False, write the run to the database.

    The database is opened first, so a bad ``--db`` fails before any work; the run
    is written in one transaction after the replay, so a failed replay leaves nothing."""
    st: Store | None = open_store(db) if store else None
    try:
        if build.startswith("git:"):
            return _replay_git_and_store(st, trace, build, **options)
        options.pop("timeout_s", None)
        replayer = Replayer(trace, build, **options)
        report = replayer.run(progress=progress)
        info = trace_info(replayer.reader, calls=None if report.stopped_early else report.calls_replayed)
        run_id = record_run(st, report, info, build_version=build_version(replayer)) if st is not None else None
        return StoredReplay(report, run_id)
    finally:
        if st is not None:
            st.close()


def _replay_git_and_store(st: Store | None, trace: str | Path, build: str, **options: Any) -> StoredReplay:
    from kvreplay.replayer.git_build import replay_in_worker

    reader = TraceReader(trace)  # a bad trace fails here, in this process, with a clear message
    d, commit = replay_in_worker(trace, build, **options)
    report = ReplayReport.from_dict(d)
    info = trace_info(reader, calls=None if report.stopped_early or report.calls_replayed == 0
                      else report.calls_replayed)
    run_id = record_run(st, report, info, build_version=f"git {commit}") if st is not None else None
    return StoredReplay(report, run_id)


@dataclass
class DemoResult:
    trace: SynthResult
    clean: StoredReplay
    buggy: StoredReplay
    stored: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.clean.report.status == "clean" and self.buggy.report.first_violation is not None


def demo(*, db: str | None = None, out_dir: str | Path | None = None, requests: int = 2000,
         progress: Callable[[str], None] | None = None) -> DemoResult:
    """The main job end to end on the embedded defaults: synth a disagg-mtp trace,
    replay it on the correct SWA pool and on the 0.5.12 one, read the result back."""
    open_store(db).close()  # fail fast on a bad database
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="kvreplay-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _msg: None)
    say(f"synthesizing a disagg-mtp trace of {requests} requests")
    synth = synthesize(SynthConfig(scenario="disagg-mtp", out=out / "disagg-mtp.parquet", requests=requests),
                       command=f"kvreplay synth disagg-mtp --requests {requests} -o {out / 'disagg-mtp.parquet'}")
    say("replaying on builtin:swa (sglang 0.5.23 behaviour)")
    clean = replay_and_store(synth.path, "builtin:swa", db=db)
    say("replaying on builtin:swa@stale-tail (sglang 0.5.12, the seed bug)")
    buggy = replay_and_store(synth.path, "builtin:swa@stale-tail", db=db)
    st = open_store(db)
    try:
        stored = run_to_dict(get_run(st, buggy.run_id), details=True) if buggy.run_id else {}
    finally:
        st.close()
    return DemoResult(synth, clean, buggy, stored)
