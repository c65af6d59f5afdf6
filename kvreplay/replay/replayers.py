"""Which replayer a trace gets: sglang's allocator API or a wire family's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.replay.blocks import BlockReplayer
from kvreplay.replay.replayer import Replayer
from kvreplay.trace.reader import TraceReader

# The replayer of each pool family whose calls are not sglang's allocator API.
_REPLAYERS: dict[str, type] = {"vllm": BlockReplayer}


def make_replayer(trace: str | Path, build: str | BuildSpec, *, reader: TraceReader | None = None,
                  **options: Any) -> Any:
    """The replayer for the trace's family (its ``run`` gives a ReplayReport)."""
    reader = reader or TraceReader(trace)
    cls = _REPLAYERS.get(reader.meta.family, Replayer)
    return cls(trace, build, reader=reader, **options)
