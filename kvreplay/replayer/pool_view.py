"""Read a pool's state for the invariant checker, whichever build it is.

The builtin pools and sglang's allocators keep their free lists under the same
names, but those moved between releases (``release_pages`` on token pools,
``staged_pages`` on paged pools since 0.5.20, ``get_all_free_pages`` on newer ones);
this module is the one place that knows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def to_np(t: Any) -> np.ndarray:
    """Host copy of an index tensor as int64 numpy (free for CPU tensors)."""
    if isinstance(t, torch.Tensor):
        return t.detach().reshape(-1).to(torch.int64).cpu().numpy()
    return np.asarray(t, dtype=np.int64).reshape(-1)


@dataclass
class SubPoolView:
    """One page-granular allocator: a token pool is one with page_size 1."""

    name: str
    obj: Any
    page_size: int
    num_pages: int

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def size(self) -> int:
        return int(self.obj.size)

    def available(self) -> int:
        return int(self.obj.available_size())

    def free_pages(self) -> np.ndarray:
        """Every page id the allocator can hand out: free list plus staged pages."""
        o = self.obj
        getter = getattr(o, "get_all_free_pages", None)
        if callable(getter):
            pages = getter()
            if pages is not None:
                return to_np(pages)
        parts = [to_np(o.free_pages)]
        for attr in ("staged_pages", "release_pages"):
            extra = getattr(o, attr, None)
            if isinstance(extra, list):
                parts.extend(to_np(x) for x in extra)
            elif isinstance(extra, torch.Tensor):
                parts.append(to_np(extra))
        return np.concatenate(parts) if parts else np.empty(0, np.int64)


@dataclass
class PoolView:
    family: str
    subs: dict[str, SubPoolView]
    pool: Any

    @property
    def mapping(self) -> torch.Tensor | None:
        return getattr(self.pool, "full_to_swa_index_mapping", None)

    def counters(self) -> tuple[int | None, int | None, int | None]:
        p = self.pool
        if self.family == "swa":
            return int(p.available_size()), int(p.full_available_size()), int(p.swa_available_size())
        return int(p.available_size()), None, None


def _sub(name: str, obj: Any) -> SubPoolView:
    ps = int(getattr(obj, "page_size", 1) or 1)
    num_pages = int(getattr(obj, "num_pages", 0) or 0) or int(obj.size) // ps
    return SubPoolView(name, obj, ps, num_pages)


def view_of(pool: Any, family: str) -> PoolView:
    if family == "swa":
        subs = {"full": _sub("full", pool.full_attn_allocator), "swa": _sub("swa", pool.swa_attn_allocator)}
    else:
        subs = {"pool": _sub("pool", pool)}
    return PoolView(family, subs, pool)
