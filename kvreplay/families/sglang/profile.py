"""What an sglang allocator call adds to a trace's profile (``kvreplay profile``):
requests admitted with their prefixes, decode batches, frees and their groups."""

from __future__ import annotations

from typing import Any

from kvreplay.trace.profile import Figures, length, total

_FREED_ARGS = ("free_index", "indices", "full_indices")  # the first one a free names is its slots


def see(f: Figures, c: Any) -> None:
    m = c.method
    if m == "free_group_begin":
        f.depth += 1
        f.groups += 1
    elif m == "free_group_end":
        f.depth = max(0, f.depth - 1)
    elif m.startswith("free"):
        _see_free(f, c)
    elif m in ("alloc_extend", "alloc_extend_swa_tail"):
        _see_extend(f, c)
    elif m == "alloc_decode":
        s = c.args.get("seq_lens")
        if s is not None:
            f.decode.append(length(s))
    elif m == "alloc" and c.target == "root":
        n = c.args.get("need_size")
        if n is not None:
            if type(n) is not int:
                raise TypeError(f"need_size is a {type(n).__name__}, not a number")
            f.extend.append(n)


def _see_free(f: Figures, c: Any) -> None:
    if f.depth:
        f.frees_in_groups += 1
    for name in _FREED_ARGS:
        if name in c.args:
            f.freed.append(length(c.args[name]))
            return
    segs = c.args.get("segments")
    if isinstance(segs, (list, tuple)):  # (indices, start_pos) pairs
        f.freed.append(sum(length(seg[0]) for seg in segs if isinstance(seg, (list, tuple)) and seg))


def _see_extend(f: Figures, c: Any) -> None:
    p, s = c.args.get("prefix_lens"), c.args.get("seq_lens")
    if p is None or s is None:
        return
    f.extended += length(p)
    f.prefix += total(p)
    f.seqs += total(s)
    try:
        f.extend.extend(int(x) for x in (s - p).tolist())
    except (AttributeError, TypeError):
        pass
