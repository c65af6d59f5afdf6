"""Which replayer a trace gets: the one its family's record names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.contract.record import load
from kvreplay.contract.registry import family
from kvreplay.replay.loop import ReplayLoop
from kvreplay.trace.reader import TraceReader


def replayer_class(reader: TraceReader) -> type[ReplayLoop]:
    """The replayer class the trace's family names."""
    return load(family(reader.meta.family).replayer)


def make_replayer(trace: str | Path, build: str | BuildSpec, *, reader: TraceReader | None = None,
                  **options: Any) -> ReplayLoop:
    """The replayer for the trace's family (its ``run`` gives a ReplayReport)."""
    reader = reader or TraceReader(trace)
    return replayer_class(reader)(trace, build, reader=reader, **options)
