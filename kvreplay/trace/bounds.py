"""Bounds a pool family puts on the numbers its calls carry, checked by a scan of the
argument columns (``TraceReader.check_calls``) before anything replays a row.

A wire family's rows name requests, slots and blocks by number and give counts of
tokens and slots to allocate; its pools index lists and tensors with them and allocate
what they ask for. A damaged or hostile trace can say anything an int64 holds: a
request number near 2^62, a need of -3 slots, a list of 10^7 block ids, a hash
length of 2^40 bytes. Each family says, from its constructor arguments, what every
such argument may hold (``Family.value_bounds``); the scan refuses the rest in one
line, reading only the argument columns, before a value is decoded into Python.

Importing this module costs nothing: a family's record names its bounds without
pulling pyarrow in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import pyarrow as pa

# The columns the scan reads: an argument's name, kind, scalar and list.
COLUMNS = ["args.list.element.name", "args.list.element.kind", "args.list.element.i", "args.list.element.data"]

_SCALAR_KINDS = ("int", "bool", "none")
_LIST_KINDS = ("ints", "tensor", "none")


class Bound(NamedTuple):
    """What one argument (by name, in any call) may hold: a whole number, or with
    ``longest`` a list of at most that many, in ``lo``..``hi``."""

    lo: int
    hi: int
    longest: int | None = None
    what: str = ""  # what the number is, for the message ("a state slot", "a request number")
    env: str = ""  # the KVREPLAY_MAX_* variable that raises ``hi`` or ``longest``, where a user may need more


def check_values(path: Path, batches: Iterable[pa.RecordBatch], bounds: Mapping[str, Bound]) -> None:
    """TraceFormatError for the first argument outside its bound: a number out of range,
    a list too long or holding one, or a value of another kind (a list where a count
    belongs). ``batches``: the trace's COLUMNS (one struct column of arguments)."""
    import pyarrow.compute as pc

    from kvreplay.errors import TraceFormatError

    if not bounds:
        return
    for batch in batches:
        args = batch.column(0).flatten()
        names, kinds = args.field("name"), args.field("kind")
        present = set(pc.unique(names).to_pylist()) & bounds.keys()
        for name in sorted(present):
            b = bounds[name]
            mine = pc.equal(names, name)
            allowed = _LIST_KINDS if b.longest is not None else _SCALAR_KINDS
            odd = set(pc.unique(pc.filter(kinds, mine)).to_pylist()) - set(allowed)
            if odd:
                shape = "a list of numbers" if b.longest is not None else "a whole number"
                raise TraceFormatError(f"{path}: argument {name} is {sorted(odd)[0][:20]!r}, not {shape}")
            if b.longest is None:
                values = pc.filter(args.field("i"), pc.and_(mine, pc.not_equal(kinds, "none")))
                _in_range(path, name, b, pc.min_max(values).as_py())
                continue
            lists = pc.filter(args.field("data"), pc.and_(mine, pc.not_equal(kinds, "none")))
            longest = pc.max(pc.list_value_length(lists)).as_py() if len(lists) else None
            if longest is not None and longest > b.longest:
                raise TraceFormatError(f"{path}: argument {name} lists {longest:,} values, more than the "
                                       f"{b.longest:,} a call on this pool can{_why(b)}")
            _in_range(path, name, b, pc.min_max(pc.list_flatten(lists)).as_py())


def _why(b: Bound) -> str:
    """What the bound is and what raises it, as a message's last words ("" when neither)."""
    parts = [p for p in (b.what, f"{b.env} raises the limit" if b.env else "") if p]
    return f" ({'; '.join(parts)})" if parts else ""


def _in_range(path: Path, name: str, b: Bound, got: dict[str, int | None]) -> None:
    from kvreplay.errors import TraceFormatError

    for v in (got["min"], got["max"]):
        if v is not None and not b.lo <= v <= b.hi:
            raise TraceFormatError(f"{path}: argument {name} holds {v:,}, outside {b.lo:,}..{b.hi:,} on this "
                                   f"pool{_why(b)}")
