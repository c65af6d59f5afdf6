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
    """Host copy of an index tensor as int64 numpy (free for CPU int64 tensors)."""
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.int64 and t.device.type == "cpu" and not t.requires_grad:
            return t.numpy().reshape(-1)
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

    def pending_pages(self) -> np.ndarray:
        """Pages freed inside the free group in progress, not yet back on the free list."""
        return _group_pages(self.obj, "free_group", "free_page_ids_group", self.page_size)


def _group_pages(obj: Any, tokens_attr: str, pages_attr: str, page_size: int) -> np.ndarray:
    parts = []
    for attr, per in ((tokens_attr, page_size), (pages_attr, 1)):
        pending = getattr(obj, attr, None)
        if isinstance(pending, list):
            parts.extend(to_np(x) // per for x in pending)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


@dataclass
class PoolView:
    family: str
    subs: dict[str, SubPoolView]
    pool: Any
    _np_of: Any = None
    _np: Any = None
    _readers: Any = None  # (name, bound available_size) per sub-pool

    @property
    def mapping(self) -> torch.Tensor | None:
        return getattr(self.pool, "full_to_swa_index_mapping", None)

    def mapping_np(self) -> np.ndarray | None:
        """The SWA mapping as a numpy view sharing its memory (CPU pools), else None:
        no copy and no torch dispatch per lookup."""
        m = self.mapping
        if m is None or m.device.type != "cpu":
            return None
        if self._np_of is not m:
            self._np_of, self._np = m, m.numpy()
        return self._np

    def peers(self, full_tokens: np.ndarray) -> np.ndarray:
        """``full_to_swa_index_mapping[full_tokens]`` as numpy; a slot outside the
        mapping (a wild index from a trace) has no peer (0), and the trailing -1 entry
        is only reached by its own index."""
        m = self.mapping_np()
        n = len(self.mapping)
        inside = (full_tokens >= 0) & (full_tokens < n)
        if not inside.all():
            out = np.zeros(len(full_tokens), dtype=np.int64)
            out[inside] = self.peers(full_tokens[inside])
            return out
        if m is not None:
            return m[full_tokens]
        return to_np(self.mapping[torch.as_tensor(full_tokens, device=self.mapping.device)])

    def peer_item(self) -> Any:
        """A function full_token -> SWA peer (int), cheapest for a handful of lookups."""
        m = self.mapping_np()
        if m is not None:
            return m.item
        mapping = self.mapping
        return lambda i: int(mapping[i])

    def pending_pages(self, name: str) -> np.ndarray:
        """Pages of sub-pool ``name`` freed in the free group in progress (the SWA pool
        also defers SWA frees at its top level)."""
        pages = self.subs[name].pending_pages()
        if name == "swa":
            top = _group_pages(self.pool, "swa_free_group", "swa_page_ids_group", self.subs[name].page_size)
            pages = np.concatenate([pages, top[top > 0]])
        return pages

    def sub_available(self) -> dict[str, int]:
        if self._readers is None:
            self._readers = [(name, sub.obj.available_size) for name, sub in self.subs.items()]
        return {name: int(read()) for name, read in self._readers}

    def counters(self, avail: dict[str, int] | None = None) -> tuple[int | None, int | None, int | None]:
        """The counters a trace records: available_size() and, on SWA pools, those of
        the full and SWA sub-pools (``avail`` reuses sub-pool reads already made)."""
        p = self.pool
        if avail is None:
            if self.family == "swa":
                full, swa = int(p.full_available_size()), int(p.swa_available_size())
                try:
                    total = int(p.available_size())
                except NotImplementedError:  # abstract on SWA pools before 0.5.11
                    total = min(full, swa)
                return total, full, swa
            return int(p.available_size()), None, None
        if self.family == "swa":
            # The recorder read these through the pool's methods; for the SWA pools
            # that exist they are the sub-pools' sizes and their minimum.
            return min(avail["full"], avail["swa"]), avail["full"], avail["swa"]
        return avail["pool"], None, None


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
