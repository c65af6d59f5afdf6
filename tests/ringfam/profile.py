"""What a ring call adds to a trace's profile: tickets taken per take, given per give."""

from __future__ import annotations

from typing import Any

from kvreplay.trace.profile import Figures


def see(f: Figures, c: Any) -> None:
    if c.method == "take" and type(c.args.get("count")) is int:
        f.extend.append(c.args["count"])
    elif c.method == "give":
        f.freed.append(len(c.args.get("tickets") or ()))
