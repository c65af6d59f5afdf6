"""Rotation: a long recording as a directory of parts, each replayable on its own,
and a bound on how many of them stay on disk.

Where a part ends is decided on the recorded program's side, because only there,
between two of its calls (and outside a free group), is the pool's state that of
the calls written so far: the recording takes the pool's snapshot there and sends
a ``PartStart`` after the part's last batch. The writer closes the part, opens the
next with the snapshot as its starting state (``initial_state``, as an attached
recording has), and retires the oldest parts past the retention bound. A part
therefore replays alone, and the directory, whatever its oldest kept part, replays
as one trace from that part's snapshot.

A family whose pools kvreplay cannot snapshot (vLLM's manager) still rotates, but
its later parts need the ones before them: they are never retired."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Rotation:
    """Cut a recording every ``rows`` rows or ``seconds`` seconds (0: never by that
    measure); keep the last ``keep_parts`` parts and at most ``keep_bytes`` bytes of
    closed parts (0: no bound). Neither cut set: one file, no parts."""

    rows: int = 0
    seconds: float = 0.0
    keep_parts: int = 0
    keep_bytes: int = 0

    @property
    def on(self) -> bool:
        return self.rows > 0 or self.seconds > 0

    def to_env(self) -> str:
        """KVREPLAY_PARTS's value; the recorded processes read it back with
        switch_values.parts, which refuses anything else."""
        return f"{self.rows},{self.seconds:g},{self.keep_parts},{self.keep_bytes}"


@dataclass(frozen=True)
class PartStart:
    """From the recording to its writer: a new part starts here, from this pool state
    (snapshot JSON; "" where the family has no snapshot: the part is chained to the
    ones before it). ``pending_state`` encodes it on the writer's side of the queue."""

    state: str = ""
    pending_state: Callable[[], str] | None = None

    def settled(self) -> PartStart:
        if self.pending_state is None:
            return self
        try:
            state = self.pending_state()
        except Exception:  # no snapshot: the part is chained, still a part
            state = ""
        return replace(self, state=state, pending_state=None)


class PartClock:
    """On the recorded side: is a part due? Rows counted per delivered batch, the clock
    read once per batch, never per call."""

    def __init__(self, rotation: Rotation) -> None:
        self.rotation = rotation
        self.rows = 0
        self.t0 = time.monotonic()

    def add(self, rows: int) -> None:
        self.rows += rows

    def due(self) -> bool:
        r = self.rotation
        if r.rows and self.rows >= r.rows:
            return True
        return bool(r.seconds) and self.rows > 0 and time.monotonic() - self.t0 >= r.seconds

    def restart(self) -> None:
        self.rows, self.t0 = 0, time.monotonic()


@dataclass
class ClosedPart:
    path: Path
    size: int
    standalone: bool  # starts from a snapshot or from a fresh pool: needs no part before it


def retire(closed: list[ClosedPart], open_standalone: bool, rotation: Rotation) -> list[ClosedPart]:
    """The oldest closed parts to delete so that the rest fit the retention bound.
    A part goes only if the one after it (closed, or the open one) stands alone, so
    what stays always replays from its first part."""
    out: list[ClosedPart] = []
    kept = list(closed)
    while kept and _over(kept, rotation):
        after_standalone = kept[1].standalone if len(kept) > 1 else open_standalone
        if not after_standalone:
            break
        out.append(kept.pop(0))
    return out


def _over(kept: list[ClosedPart], rotation: Rotation) -> bool:
    if rotation.keep_parts and len(kept) > rotation.keep_parts:
        return True
    return bool(rotation.keep_bytes) and len(kept) > 1 and sum(p.size for p in kept) > rotation.keep_bytes
