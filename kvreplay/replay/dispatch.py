"""``replay(trace, build)``: in this process, or in a worker for a ``git:`` or release build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.replay.replayers import make_replayer
from kvreplay.replay.report import ReplayReport
from kvreplay.replay.worker import replay_in_worker


def replay(trace: str | Path, build: str | BuildSpec, **options: Any) -> ReplayReport:
    """Replay ``trace`` against ``build`` (a spec, or one already parsed, which is
    handed down as it is); see Replayer for the options. ``git:`` and release builds
    run in a worker process; ``timeout_s`` bounds them."""
    progress = options.pop("progress", None)
    spec = build if isinstance(build, BuildSpec) else BuildSpec.parse(build)
    if not spec.in_process:
        return replay_in_worker(trace, spec.text, **options)[0]
    options.pop("timeout_s", None)
    return make_replayer(trace, spec, **options).run(progress=progress)
