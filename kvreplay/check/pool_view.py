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

from kvreplay.contract.registry import family as family_record
from kvreplay.trace.format import COUNTER_READS, COUNTERS


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
    _columns: Any = None  # the counter column of each sub-pool (the family's record), read once

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
        """Pages of sub-pool ``name`` freed in the free group in progress (a pool may
        also defer a sub-pool's frees at its own level: the SWA pool's ``swa_free_group``)."""
        sub = self.subs[name]
        pages = sub.pending_pages()
        if sub.obj is not self.pool:
            top = _group_pages(self.pool, f"{name}_free_group", f"{name}_page_ids_group", sub.page_size)
            pages = np.concatenate([pages, top[top > 0]])
        return pages

    def sub_available(self) -> dict[str, int]:
        if self._readers is None:
            self._readers = [(name, sub.obj.available_size) for name, sub in self.subs.items()]
        return {name: int(read()) for name, read in self._readers}

    def counters(self, avail: dict[str, int] | None = None) -> tuple[int | None, int | None, int | None]:
        """The counters a trace records (trace.format.COUNTERS): available_size() and, on a
        pool of several sub-pools, each sub-pool's (``avail`` reuses sub-pool reads
        already made)."""
        p = self.pool
        if len(self.subs) == 1:
            return (int(p.available_size()) if avail is None else avail[next(iter(self.subs))]), None, None
        if self._columns is None:
            self._columns = family_record(self.family).counter_of
        column = self._columns
        if avail is None:
            got = {column[name]: int(getattr(p, _READ_OF[column[name]])()) for name in self.subs}
            try:
                total = int(p.available_size())
            except NotImplementedError:  # abstract on SWA pools before 0.5.11
                total = min(got.values())
        else:
            # The recorder read these through the pool's methods; for the pools that
            # exist they are the sub-pools' sizes and their minimum.
            got = {column[name]: avail[name] for name in self.subs}
            total = min(got.values())
        return total, got.get(COUNTERS[1]), got.get(COUNTERS[2])


def _sub(name: str, obj: Any) -> SubPoolView:
    ps = int(getattr(obj, "page_size", 1) or 1)
    num_pages = int(getattr(obj, "num_pages", 0) or 0) or int(obj.size) // ps
    return SubPoolView(name, obj, ps, num_pages)


_READ_OF = dict(zip(COUNTERS, COUNTER_READS, strict=True))


def view_of(pool: Any, family: str) -> PoolView:
    """The checker's view of a pool of ``family``: its sub-allocators as its record
    names them, or the pool itself as its one sub-pool."""
    fam = family_record(family)
    if fam.sub_allocators:
        subs = {name: _sub(name, getattr(pool, attr)) for name, attr in fam.sub_allocators}
    else:
        subs = {fam.sub_pools[0]: _sub(fam.sub_pools[0], pool)}
    return PoolView(family, subs, pool)
