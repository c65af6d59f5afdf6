"""Where and how a replay runs: the one answer every job goes through.

- an in-process build (``builtin:``, ``py:``, the installed engine): here, by the
  replayer its trace's family names; with ``jobs`` > 1 or ``ray``, the trace's segments
  (between its checkpoints) on parallel workers or Ray, merged into the serial report;
- a worker build (``git:``, ``ENGINE==VERSION``): in a worker process of its own with
  the build's code first on ``sys.path`` (replay/worker.py), here or, with ``ray``, on a
  Ray node; ``timeout_s`` bounds it;
- several traces on one worker build (a matrix's column): one worker replays them in
  turn, so a release's server is imported once.

``replay`` (the library's front door), ``stored_replay.replay_and_store`` (replay,
bisect, ci, the demo), ``minimize`` and ``matrix`` all call ``run`` or ``run_many``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.fanout import run_units
from kvreplay.replay.report import ReplayReport
from kvreplay.replay.worker import replay_in_worker, replay_many_in_worker
from kvreplay.trace.reader import TraceReader


@dataclass
class Ran:
    """A replay's report and what the build resolved to (``BuildSpec.resolved``)."""

    report: ReplayReport
    version: str


def run(trace: str | Path, build: str | BuildSpec, *, jobs: int = 1, ray: str | None = None,
        progress: Callable[[int, int], None] | None = None, reader: TraceReader | None = None,
        **options: Any) -> Ran:
    """Replay ``trace`` on ``build`` where the build must run (see the module's text);
    ``options`` are the replayer's (mode, device, keep, ...) and ``timeout_s`` a worker's;
    ``checked``: ``reader``'s rows were checked already (a worker reads the trace anew)."""
    spec = build if isinstance(build, BuildSpec) else BuildSpec.parse(build)
    checked = options.pop("checked", False)
    if not spec.in_process:
        if ray is not None:  # the worker (and its build's environment) on a Ray node
            report, code_id = run_units(worker_unit, [(str(trace), spec.text, options)], ray=ray)[0]
        else:
            report, code_id = replay_in_worker(trace, spec.text, **options)
        return Ran(report, spec.resolved(code_id=code_id))
    options.pop("timeout_s", None)
    if jobs > 1 or ray is not None:
        from kvreplay.replay.segments import replay_segments  # imports torch

        parallel = replay_segments(str(trace), spec.text, jobs=jobs, ray=ray, progress=progress, reader=reader,
                                   **options)
        if parallel is not None:
            return Ran(*parallel)
    from kvreplay.replay.replayers import make_replayer  # imports torch: only in-process builds need it

    replayer = make_replayer(trace, spec, reader=reader, checked=checked, **options)
    report = replayer.run(progress=progress)
    return Ran(report, spec.resolved(pool=replayer.pool))


def run_many(traces: list[str | Path], build: str | BuildSpec,
             on_report: Callable[[ReplayReport, str], None], **options: Any) -> None:
    """Replay each trace on a worker build in one worker (a fresh one after a crash or a
    timeout), handing ``on_report`` each report and the build's code id as it comes."""
    spec = build if isinstance(build, BuildSpec) else BuildSpec.parse(build)
    replay_many_in_worker(traces, spec.text, on_report=on_report, **options)


def worker_unit(unit: tuple[str, str, dict[str, Any]]) -> tuple[ReplayReport, str]:
    """A worker build's replay as a unit of work (a Ray task): (report, code id)."""
    trace, build, options = unit
    return replay_in_worker(trace, build, **options)


def replay(trace: str | Path, build: str | BuildSpec, *, mode: str = "strict", device: str = "auto",
           full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True, keep: int = 20,
           after_gap: bool = False, jobs: int = 1, ray: str | None = None, timeout_s: float | None = None,
           progress: Callable[[int, int], None] | None = None) -> ReplayReport:
    """Replay ``trace`` (of any family) against ``build`` (a spec, or one already
    parsed, which is handed down as it is); the replay's options are Replayer's
    (replay/replayers.py). ``git:`` and release builds run in a worker process, which
    ``timeout_s`` bounds (None: the worker's own default); ``jobs`` > 1 or ``ray`` split
    a trace with checkpoints into segments on parallel workers."""
    bound = {} if timeout_s is None else {"timeout_s": timeout_s}  # None: the worker's own default
    return run(trace, build, mode=mode, device=device, full_check_every=full_check_every,
               stop_at_first=stop_at_first, check=check, keep=keep, after_gap=after_gap, jobs=jobs, ray=ray,
               progress=progress, **bound).report
