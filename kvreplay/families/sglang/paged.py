"""Paged KV pool, behaving like sglang 0.5.23's ``PagedTokenToKVPoolAllocator``.

Pages 1..size//page_size; token index = page * page_size + offset. Without
``need_sort`` freed pages go to the *front* of the free list (hot pages reused
first); with it they are staged and sorted back in when an alloc runs short."""

from __future__ import annotations

from typing import Any

import torch

from kvreplay.families.sglang.pool_base import PoolBase


def new_pages_needed(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    after = (seq_lens_cpu + page_size - 1) // page_size
    before = (prefix_lens_cpu + page_size - 1) // page_size
    return int((after - before).sum().item())


def decode_pages_needed(seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    return int((seq_lens_cpu % page_size == 1).sum().item())


def extend_indices(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    num_tokens: int,
) -> torch.Tensor:
    """Token slots for a batched extend.

    Each request first fills the rest of its last page (``last_loc + 1 ...``),
    then takes whole new pages from the front of ``free_pages`` in request order."""
    device = prefix_lens.device
    extend_lens = seq_lens - prefix_lens
    if num_tokens == 0:
        return torch.empty((0,), dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), extend_lens)
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    pos = prefix_lens[owner] + torch.arange(num_tokens, device=device) - starts[owner]
    ceil_prefix = (prefix_lens + page_size - 1) // page_size * page_size
    pages_per_req = (seq_lens + page_size - 1) // page_size - ceil_prefix // page_size
    first_new_page = torch.cumsum(pages_per_req, 0) - pages_per_req

    in_old_page = pos < ceil_prefix[owner]
    same_page = last_loc[owner] + 1 + (pos - prefix_lens[owner])
    rel = (pos - ceil_prefix[owner]).clamp(min=0)
    if free_pages.numel() == 0:
        return same_page
    page_rank = (first_new_page[owner] + rel // page_size).clamp(max=free_pages.numel() - 1)
    new_page = free_pages[page_rank] * page_size + rel % page_size
    return torch.where(in_old_page, same_page, new_page)


class PagedPool(PoolBase):
    def __init__(self, size: int, page_size: int, dtype: Any = torch.int64, device: str | torch.device = "cpu",
                 kvcache: Any = None, need_sort: bool = False) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self.num_pages = self.size // self.page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.free_group = None
        self.free_page_ids_group: list[torch.Tensor] = []
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0

    def available_size(self) -> int:
        return (len(self.free_pages) + self.num_staged_pages) * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        return torch.cat((self.free_pages, *self.staged_pages))

    def merge_and_sort_free(self) -> None:
        if not self.staged_pages:
            return
        self.free_pages = torch.sort(self.get_all_free_pages())[0]
        self.staged_pages = []
        self.num_staged_pages = 0

    def _take(self, num_pages: int) -> torch.Tensor:
        out = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return out

    def alloc(self, need_size: int) -> torch.Tensor | None:
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        pages = self._take(num_pages)
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        # A cheap upper bound avoids counting pages on the fast path, as sglang does.
        upper_bound = extend_num_tokens // self.page_size + len(prefix_lens) + 1
        if upper_bound > len(self.free_pages):
            self.merge_and_sort_free()
        if num_new_pages is None:
            num_new_pages = new_pages_needed(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        if upper_bound > len(self.free_pages) and num_new_pages > len(self.free_pages):
            return None
        out = extend_indices(
            prefix_lens, seq_lens, last_loc, self.free_pages, self.page_size, extend_num_tokens
        )
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        if len(seq_lens) > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = decode_pages_needed(seq_lens_cpu, self.page_size)
        if num_new_pages > len(self.free_pages):
            return None
        if num_new_pages == 0:
            out = last_loc + 1
        else:
            need = ((seq_lens - 1) % self.page_size == 0).to(torch.int64)
            rank = (torch.cumsum(need, 0) - need).clamp(max=num_new_pages - 1)
            out = torch.where(need.bool(), self.free_pages[rank] * self.page_size, last_loc + 1)
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is None:
            self._release(torch.unique(free_index // self.page_size))
        else:
            self.free_group.append(free_index.clone())

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        if start_pos % self.page_size:
            raise AssertionError(f"segment start {start_pos} is not page-aligned")
        # Page-aligned start: every page_size-th token is one distinct page.
        self.free_page_ids(free_index[:: self.page_size] // self.page_size)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        if page_ids.numel() == 0:
            return
        if self.free_group is None:
            self._release(page_ids)
        else:
            self.free_page_ids_group.append(page_ids.clone())

    def _release(self, page_ids: torch.Tensor) -> None:
        if self.need_sort:
            self.staged_pages.append(page_ids)
            self.num_staged_pages += page_ids.numel()
        else:
            self.free_pages = torch.cat((page_ids, self.free_pages))

    def free_group_begin(self) -> None:
        super().free_group_begin()
        self.free_page_ids_group = []

    def free_group_end(self) -> None:
        super().free_group_end()
        if self.free_page_ids_group:
            self._release(torch.cat(self.free_page_ids_group))
            self.free_page_ids_group = []
