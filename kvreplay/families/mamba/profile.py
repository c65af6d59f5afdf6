"""What a hybrid request pool call adds to a trace's profile (``kvreplay profile``):
the requests, by number, and the state slots each free of the slot allocator gives back."""

from __future__ import annotations

from typing import Any

from kvreplay.trace.profile import Figures, length


def see(f: Figures, c: Any) -> None:
    if c.method == "alloc_reqs":
        f.request_ids.update(str(r) for r in c.args.get("requests") or ())
    elif c.method == "free" and "free_index" in c.args:
        f.freed.append(length(c.args["free_index"]))
