"""``replay(trace, build)``: in this process, or in a worker for a ``git:`` build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.replay.replayer import Replayer
from kvreplay.replay.report import ReplayReport
from kvreplay.replay.worker import replay_in_worker


def replay(trace: str | Path, build: str, **options: Any) -> ReplayReport:
    """Replay ``trace`` against ``build``; see Replayer for the options. ``git:``
    builds run in a worker process; ``timeout_s`` bounds them."""
    progress = options.pop("progress", None)
    if not BuildSpec.parse(build).in_process:
        return replay_in_worker(trace, build, **options)[0]
    options.pop("timeout_s", None)
    return Replayer(trace, build, **options).run(progress=progress)
