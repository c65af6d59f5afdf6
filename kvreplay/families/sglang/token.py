"""Token-granular KV pool (page_size 1), behaving like sglang 0.5.23's
``TokenToKVPoolAllocator``: slot 0 is padding, frees append to the free list, and
with ``need_sort`` freed slots wait in ``release_pages`` until an alloc runs short."""

from __future__ import annotations

from typing import Any

import torch

from kvreplay.families.sglang.pool_base import PoolBase


class TokenPool(PoolBase):
    def __init__(self, size: int, dtype: Any = torch.int64, device: str | torch.device = "cpu", kvcache: Any = None,
                 need_sort: bool = False) -> None:
        super().__init__(size, 1, dtype, device, kvcache, need_sort)
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_group = None

    def available_size(self) -> int:
        return len(self.free_pages) + len(self.release_pages)

    def get_all_free_pages(self) -> torch.Tensor:
        return torch.cat((self.free_pages, self.release_pages))

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages) > 0:
            self.free_pages = torch.sort(torch.cat((self.free_pages, self.release_pages)))[0]
            self.release_pages = self.release_pages[:0]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        out = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
        elif self.need_sort:
            self.release_pages = torch.cat((self.release_pages, free_index))
        else:
            self.free_pages = torch.cat((self.free_pages, free_index))

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        # One token per page: page ids are token ids.
        self.free(page_ids)
