"""``kvreplay demo``: the main job end to end on the embedded defaults."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreplay.jobs.stored_replay import StoredReplay, replay_and_store
from kvreplay.report.reports import stored_run_report, write_report
from kvreplay.scratch import outer_tmp
from kvreplay.store.db import open_store, safe_url
from kvreplay.store.runs import get_run, run_to_dict
from kvreplay.workload.synth import SynthConfig, SynthResult, synthesize


@dataclass
class DemoResult:
    trace: SynthResult
    clean: StoredReplay
    buggy: StoredReplay
    stored: dict[str, Any]
    report: Path | None = None  # the bug run's HTML report
    database: str = ""  # where the runs were stored, as a --db value shows it

    @property
    def ok(self) -> bool:
        return self.clean.report.status == "clean" and self.buggy.report.first_violation is not None


def demo(*, db: str | None = None, out_dir: str | Path | None = None, requests: int = 2000,
         progress: Callable[[str], None] | None = None) -> DemoResult:
    """Synth a disagg-mtp trace, replay it on the correct SWA pool and on the 0.5.12
    one (the seed bug), and read the bug run back from the store."""
    open_store(db).close()  # fail fast on a bad database
    # What the demo writes outlives the command: not in its scratch directory.
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="kvreplay-demo-", dir=outer_tmp()))
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
        where = st.url.removeprefix("sqlite:///") if st.url.startswith("sqlite:///") else safe_url(st.url)
        stored = run_to_dict(get_run(st, buggy.run_id), details=True) if buggy.run_id else {}
        report = write_report(stored_run_report(st, buggy.run_id), out / "report.html") if buggy.run_id else None
    finally:
        st.close()
    if report is not None:
        say(f"wrote the bug run's report: {report}")
    return DemoResult(synth, clean, buggy, stored, report, where)
