"""What a tree call adds to a trace's profile (``kvreplay profile``): requests by
number, the prefix each match found, the slots each row extend and each free moves."""

from __future__ import annotations

from typing import Any

from kvreplay.families.tree.runs import runs_length
from kvreplay.trace.profile import Figures


def see(f: Figures, c: Any) -> None:
    args = c.args
    if c.method == "match_prefix":
        f.request_ids.add(str(args.get("request")))
        if isinstance(c.result, (tuple, list)) and c.result and type(args.get("length")) is int:
            f.prefix += int(c.result[0])
            f.seqs += int(args["length"]) + 1  # the last token, always computed
            f.extended += 1
    elif c.method == "extend" and isinstance(args.get("runs"), (tuple, list)):
        f.extend.append(runs_length(args["runs"]))
    elif c.method == "free" and isinstance(args.get("runs"), (tuple, list)):
        f.freed.append(runs_length(args["runs"]))
