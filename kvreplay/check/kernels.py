"""Index arithmetic the checker does on every call: the optional C loops (``_shadow.c``)
and the numpy and plain-Python code that stands in for them.

``native`` is None where the C module is not built; every caller reads it from this
module at call time, so a test can switch the C loops off in one place."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvreplay.check.pool_view import to_np

try:
    from kvreplay.check import _shadow as native  # type: ignore[attr-defined]
except ImportError:
    native = None
NOT_FOR_NATIVE = (TypeError, ValueError, BufferError)  # e.g. an int32 or strided array: use numpy

SMALL = 16  # below this many elements, Python lists are faster than numpy calls
EMPTY = np.empty(0, dtype=np.int64)

_OFFSETS: dict[int, np.ndarray] = {}


def expand(pages: np.ndarray, ps: int) -> np.ndarray:
    off = _OFFSETS.get(ps)
    if off is None:
        off = _OFFSETS[ps] = np.arange(ps, dtype=np.int64)
    return (pages[:, None] * ps + off).reshape(-1)


def distinct(pages: np.ndarray) -> np.ndarray | list[int]:
    """Sorted distinct pages: a Python list when few (cheaper to work on), else numpy."""
    if native is not None:
        try:
            return native.distinct_pages(pages, 1)
        except NOT_FOR_NATIVE:
            pass
    if len(pages) <= SMALL * 4:
        return sorted(set(pages.tolist()))
    return np.unique(pages)


def pages_of(tokens: Any, ps: int) -> np.ndarray | list[int]:
    """Sorted distinct pages of an index tensor (a Python list when few)."""
    if native is not None:
        try:
            return native.distinct_pages(to_np(tokens), ps)
        except NOT_FOR_NATIVE:
            pass
    if type(tokens) is torch.Tensor and tokens.device.type == "cpu" and tokens.numel() <= SMALL * 4:
        return sorted({x // ps for x in tokens.reshape(-1).tolist()})
    return distinct(to_np(tokens) // ps)
