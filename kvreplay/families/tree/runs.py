"""Slot lists as runs: the tree family's traces name KV slots as flat ``(start, length,
start, length, ...)`` pairs. A request's row and a node's value are mostly ascending
runs of a free list, so a 2,000-token row is a few numbers, not 2,000, and a trace row
holds only flat lists of whole numbers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def to_runs(slots: Iterable[int]) -> tuple[int, ...]:
    """``[5, 6, 7, 20, 21]`` -> ``(5, 3, 20, 2)``."""
    out: list[int] = []
    start = prev = None
    n = 0
    for s in slots:
        if prev is not None and s == prev + 1:
            n += 1
        else:
            if start is not None:
                out += (start, n)
            start, n = s, 1
        prev = s
    if start is not None:
        out += (start, n)
    return tuple(out)


def from_runs(runs: Sequence[int], most: int | None = None) -> list[int]:
    """The slots ``runs`` names, in order. Raises ValueError on an odd count, a negative
    length or more than ``most`` slots (default: the largest tree a trace may hold):
    damage, not runs, and never a list of 2^40 numbers."""
    from kvreplay.families.tree import MAX_TREE_SLOTS

    if len(runs) % 2:
        raise ValueError(f"slot runs come in (start, length) pairs, not {len(runs)} numbers")
    most = MAX_TREE_SLOTS if most is None else most
    out: list[int] = []
    for k in range(0, len(runs), 2):
        start, n = int(runs[k]), int(runs[k + 1])
        if n < 0 or len(out) + n > most:
            raise ValueError(f"a slot run of length {n}" if n < 0 else f"slot runs naming more than {most:,} slots")
        out.extend(range(start, start + n))
    return out


def runs_length(runs: Sequence[int]) -> int:
    return sum(int(runs[k]) for k in range(1, len(runs), 2))
