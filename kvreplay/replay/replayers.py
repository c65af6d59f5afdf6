"""Which replayer a trace gets: the one its family's record names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.families.record import load
from kvreplay.families.registry import family
from kvreplay.trace.reader import TraceReader


def make_replayer(trace: str | Path, build: str | BuildSpec, *, reader: TraceReader | None = None,
                  **options: Any) -> Any:
    """The replayer for the trace's family (its ``run`` gives a ReplayReport)."""
    reader = reader or TraceReader(trace)
    cls = load(family(reader.meta.family).replayer)
    return cls(trace, build, reader=reader, **options)
