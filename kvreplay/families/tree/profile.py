"""What a tree call adds to a trace's profile (``kvreplay profile``): requests by
number, the prefix each request's first match found, the slots each row extend, each row
free and each top-level free moves (a waiting request is matched again each round: only
its first match counts toward the prefix-cache hit share)."""

from __future__ import annotations

from typing import Any

from kvreplay.families.tree.runs import runs_length
from kvreplay.trace.profile import Figures


def see(f: Figures, c: Any) -> None:
    args = c.args
    if c.method == "match_prefix":
        request = str(args.get("request"))
        first = request not in f.request_ids
        f.request_ids.add(request)
        if first and isinstance(c.result, (tuple, list)) and c.result and type(args.get("length")) is int:
            f.prefix += int(c.result[0])
            f.seqs += int(args["length"]) + 1  # the last token, always computed
    elif c.method == "extend" and isinstance(args.get("runs"), (tuple, list)):
        f.extend.append(runs_length(args["runs"]))
    elif c.method == "free" and isinstance(args.get("runs"), (tuple, list)):
        f.freed.append(runs_length(args["runs"]))
    elif c.method == "free_kv_row" and type(args.get("start")) is int and type(args.get("end")) is int:
        f.freed.append(max(0, args["end"] - args["start"]))  # a row free: what the tree did not cache
