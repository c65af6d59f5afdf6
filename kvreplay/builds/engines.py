"""The engines kvreplay records: the classes a recorder patches in a running server,
and what it records for an instance of one (an engine object as it is, or the wire its
family's record puts in front of it)."""

from __future__ import annotations

from typing import Any

from kvreplay.contract.record import load
from kvreplay.contract.registry import families, record_classes


def recordable(obj: Any) -> Any:
    """What a recording of ``obj`` records: a wire in front of an engine object whose
    calls carry values a trace cannot hold, else the object itself."""
    for fam in families():
        if fam.wire:
            wire = load(fam.wire)(obj)
            if wire is not None:
                return wire
    return obj


__all__ = ["record_classes", "recordable"]
