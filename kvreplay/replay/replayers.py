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


class _AnyFamily(type):
    # every family's replayer is a ReplayLoop: isinstance(r, Replayer) asks that
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, ReplayLoop)


class Replayer(metaclass=_AnyFamily):
    """One replay of one trace against one build, by the replayer the trace's family names
    (sglang's allocators, vLLM's manager, the hybrid state pools, or a family of one's own):
    ``Replayer(trace, build, mode="remap").run()`` gives its ReplayReport.

    mode: strict (results, counters and sub-allocator calls as recorded) or remap (the
    build hands out its own slots or blocks); device: auto, cpu or cuda[:N]; check: run
    the invariant checker (its O(pool) checks every ``full_check_every`` calls); keep:
    violations kept whole per rule; stop_at_first: end at the first finding; after_gap:
    a trace with gaps replays from after its last one (sglang's families)."""

    def __new__(cls, trace: str | Path, build: str | BuildSpec, *, mode: str = "strict", device: str = "auto",
                full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True, keep: int = 20,
                after_gap: bool = False, reader: TraceReader | None = None) -> ReplayLoop:  # type: ignore[misc]
        return make_replayer(trace, build, reader=reader, mode=mode, device=device,
                             full_check_every=full_check_every, stop_at_first=stop_at_first, check=check, keep=keep,
                             after_gap=after_gap)
