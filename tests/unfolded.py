"""A trace's calls as a table to compare: every call (folded counter reads handed back
as calls by the reader) with the columns that must not depend on when the recorder
handed its batches over. Two recordings of the same program fold their reads into
rows alike only where their batches were taken alike; their calls are always alike.
The counters after a free group's calls are left out: a recorder that folds an empty
group reads none there (nothing changed), one that does not reads them."""

from __future__ import annotations

from typing import Any

from kvreplay.trace.format import GROUP_FOLD_METHODS
from kvreplay.trace.reader import TraceReader


def unfolded(path: Any) -> list[tuple[Any, ...]]:
    out = []
    for c in TraceReader(path).calls():
        args = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in c.args.items()}
        result = c.result.tolist() if hasattr(c.result, "tolist") else c.result
        out.append((c.seq, c.parent, c.depth, c.target, c.method, repr(args), repr(result), c.exc_type, c.exc_msg,
                    None if c.method in GROUP_FOLD_METHODS else tuple(sorted(c.counters.items()))))
    return out
