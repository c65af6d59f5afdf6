"""Pool builds with other behaviours, loaded by tests as py:pool_policies:CLASS."""

from __future__ import annotations

import torch

from kvreplay.families.sglang.paged import PagedPool
from kvreplay.families.sglang.swa import SWAPool


class HighPagesFirstPagedPool(PagedPool):
    """A correct paged pool with another free-slot policy: highest pages first."""

    def clear(self) -> None:
        super().clear()
        self.free_pages = torch.flip(self.free_pages, (0,))


class NoSegmentFreePagedPool(PagedPool):
    """An older API: no free_segments (replayed through a translation)."""

    free_segments = None  # type: ignore[assignment]


class NoDecodePagedPool(PagedPool):
    """A build without alloc_decode, which no translation can stand in for."""

    alloc_decode = None  # type: ignore[assignment]


class OldAPISWAPool(SWAPool):
    """sglang 0.5.19's SWA API surface: none of the segment frees (the
    sub-allocators keep theirs)."""

    free_segment = free_swa_segment = free_full_segment = None  # type: ignore[assignment]
    free_segments = free_full_segments = None  # type: ignore[assignment]


class NoSWAFreeSWAPool(OldAPISWAPool):
    """Older still: not even free_swa, so an SWA-only free has no translation."""

    free_swa = None  # type: ignore[assignment]


class PreMappingAPISWAPool:
    """sglang 0.5.8-0.5.11's SWA surface over a correct pool: no segment frees, the
    caller writes the mapping tensor itself (no set/clear_full_to_swa_mapping), no
    free_full, and available_size() is abstract."""

    HIDDEN = frozenset({"free_segment", "free_swa_segment", "free_full_segment", "free_segments",
                        "free_full_segments", "set_full_to_swa_mapping", "clear_full_to_swa_mapping", "free_full"})

    def __init__(self, *a, **k) -> None:
        self._pool = SWAPool(*a, **k)

    def __getattr__(self, name: str):
        if name in PreMappingAPISWAPool.HIDDEN:
            raise AttributeError(name)
        return getattr(self._pool, name)

    def available_size(self) -> int:
        raise NotImplementedError()


class BrokenImportPool:  # pragma: no cover - never constructed
    def __init__(self, *a, **k) -> None:
        raise RuntimeError("this build cannot be constructed")


class HighPagesFirstSWAPool(SWAPool):
    """A correct SWA pool whose sub-pools hand out their highest pages first."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        for sub in (self.full_attn_allocator, self.swa_attn_allocator):
            sub.free_pages = torch.flip(sub.free_pages, (0,))


class SlotsStateSWAPool(SWAPool):
    """Keeps its SWA mapping under another name: it cannot take a snapshot made on
    the builtin pools (nothing to restore the mapping into)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.swa_of_full = self.__dict__.pop("full_to_swa_index_mapping")

    def __getattr__(self, name):
        if name == "full_to_swa_index_mapping":
            return self.__dict__["swa_of_full"]
        raise AttributeError(name)


class ListResultPagedPool(HighPagesFirstPagedPool):
    """Hands out slots as a Python list instead of an index tensor: in remap mode a
    caller can tell that apart (it cannot index a KV buffer with it)."""

    def alloc_extend(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = super().alloc_extend(*args, **kwargs)
        return None if out is None else out.tolist()
