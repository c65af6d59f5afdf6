"""Hybrid full + sliding-window KV pool, behaving like sglang 0.5.23's
``SWATokenToKVPoolAllocator`` with two fixes: #38519 (unmapped pages are skipped by
``free_swa_segment`` instead of freeing SWA page 0) and a None from ``alloc_decode``
leaves both sub-pools as they were (0.5.23 leaks the pages of the sub-pool that
succeeded). Both differ from 0.5.23 only on paths where 0.5.23 corrupts state.

Two sub-pools page in step; ``full_to_swa_index_mapping[full_token]`` is the SWA
peer of a full token (0: none). The trailing entry is -1 so that a ``last_loc`` of
-1 translates to -1 on the SWA side.

The bug variants in ``variants.py`` override the few hooks marked below; every
other line is shared so a variant differs from the correct pool only where the
historical bug lived."""

from __future__ import annotations

from typing import Any

import torch

from kvreplay.families.sglang.paged import PagedPool, decode_pages_needed, new_pages_needed
from kvreplay.families.sglang.pool_base import PoolBase, expand_to_pages
from kvreplay.families.sglang.token import TokenPool


class SWAPool(PoolBase):
    def __init__(self, size: int, size_swa: int, page_size: int, dtype: Any = torch.int64,
                 device: str | torch.device = "cpu", kvcache: Any = None, need_sort: bool = False) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self._size_full = int(size)
        self._size_swa = int(size_swa)
        if page_size == 1:
            self.full_attn_allocator: TokenPool | PagedPool = TokenPool(
                size, dtype, device, None, need_sort
            )
            self.swa_attn_allocator: TokenPool | PagedPool = TokenPool(
                size_swa, dtype, device, None, need_sort
            )
        else:
            self.full_attn_allocator = PagedPool(size, page_size, dtype, device, None, need_sort)
            self.swa_attn_allocator = PagedPool(size_swa, page_size, dtype, device, None, need_sort)
        self.full_to_swa_index_mapping = torch.cat(
            [
                torch.zeros(size + page_size, dtype=torch.int64, device=self.device),
                torch.tensor([-1], dtype=torch.int64, device=self.device),
            ]
        )
        self.clear()

    # -- sizes -----------------------------------------------------------------
    @property
    def size(self) -> int:  # type: ignore[override]
        return min(self._size_full, self._size_swa)

    @size.setter
    def size(self, value: int) -> None:
        # PoolBase.__init__ assigns size; the hybrid pool derives it instead.
        pass

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        ps = self.page_size
        return num_full_pages <= self.full_available_size() // ps and (
            num_swa_pages <= self.swa_available_size() // ps
        )

    # -- mapping ---------------------------------------------------------------
    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[kv_indices]

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        if full_indices.numel() == 0:
            return
        if full_indices.numel() != swa_indices.numel():
            raise AssertionError("full and swa index counts differ")
        self.full_to_swa_index_mapping[full_indices.to(torch.int64)] = swa_indices.to(torch.int64)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        if full_indices.numel() == 0:
            return
        self.full_to_swa_index_mapping.index_fill_(0, full_indices.to(torch.int64), 0)

    # -- allocation ------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        if self.page_size != 1:
            raise AssertionError("alloc() on an SWA pool needs page_size 1")
        if need_size > self.full_available_size() or need_size > self.swa_available_size():
            return None
        full = self.full_attn_allocator.alloc(need_size)
        swa = self.swa_attn_allocator.alloc(need_size)
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor | None:
        if self.page_size <= 1:
            raise AssertionError("alloc_extend needs page_size > 1")
        n = new_pages_needed(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        if not self.new_pages_available(n, n):
            return None
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
            extend_num_tokens, num_new_pages=n,
        )
        swa = self.swa_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, swa_last_loc,
            extend_num_tokens, num_new_pages=n,
        )
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                              seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> torch.Tensor | None:
        """Full KV for the whole extend, SWA KV only for its last ``swa_tail_len`` tokens."""
        ps = self.page_size
        if ps <= 1 or len(seq_lens_cpu) != 1 or len(prefix_lens_cpu) != 1:
            raise AssertionError("alloc_extend_swa_tail needs page_size > 1 and bs == 1")
        if not 0 <= swa_tail_len <= extend_num_tokens:
            raise AssertionError(f"swa_tail_len {swa_tail_len} outside [0, {extend_num_tokens}]")
        num_full = new_pages_needed(prefix_lens_cpu, seq_lens_cpu, ps)
        num_swa = (swa_tail_len + ps - 1) // ps
        if not self.new_pages_available(num_full, num_swa):
            return None
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
            extend_num_tokens, num_new_pages=num_full,
        )
        if swa_tail_len == 0:
            # sglang 0.5.23 returns here without clearing the mapping (kept faithful).
            return full
        dev = self.device
        zero = torch.zeros((1,), dtype=torch.int64)
        tail = torch.tensor([swa_tail_len], dtype=torch.int64)
        swa = self.swa_attn_allocator.alloc_extend(
            zero.to(dev), zero, tail.to(dev), tail,
            torch.tensor([-1], dtype=torch.int64, device=dev), swa_tail_len,
            num_new_pages=num_swa,
        )
        self.set_full_to_swa_mapping(full[-swa_tail_len:], swa)
        if swa_tail_len < extend_num_tokens:
            self._clear_non_tail(full[:-swa_tail_len])
        return full

    def _clear_non_tail(self, non_tail: torch.Tensor) -> None:
        """Hook (#25805): recycled full pages must not keep an old SWA peer."""
        self.clear_full_to_swa_mapping(non_tail)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        if self.page_size <= 1:
            raise AssertionError("alloc_decode needs page_size > 1")
        n = decode_pages_needed(seq_lens_cpu, self.page_size)
        if not self.new_pages_available(n, n):
            # sglang 0.5.23 asks both sub-pools anyway and leaks the pages of the one
            # that succeeds; here a None changes nothing but the staged-page merges
            # 0.5.23 does on the way, so later indices still match it.
            for sub in (self.full_attn_allocator, self.swa_attn_allocator):
                if len(seq_lens) > len(sub.free_pages):
                    sub.merge_and_sort_free()
            return None
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        full = self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, swa_last_loc)
        if full is None or swa is None:
            return None
        self.full_to_swa_index_mapping[full] = swa
        return full

    # -- frees -----------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        # SWA first: it reads the mapping, which a later action in a group may re-point.
        self.free_swa(free_index)
        self.free_full(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Release the SWA peers of any set of full slots and clear their mapping."""
        if free_index.numel() == 0:
            return
        if self.page_size == 1:
            self._free_swa_pages(free_index)
            return
        touched = self._mapping_to_clear(free_index)
        swa = self.full_to_swa_index_mapping[touched]
        self.clear_full_to_swa_mapping(touched)
        if self.free_group is not None:
            self.swa_free_group.append(swa)
            return
        self._release_swa(swa)

    def _mapping_to_clear(self, free_index: torch.Tensor) -> torch.Tensor:
        """Hook (#27779): a freed page must lose the mapping of all its tokens,
        not only of those passed, or a recycled page keeps a stale SWA peer."""
        return expand_to_pages(free_index, self.page_size)

    def _release_swa(self, swa_indices: torch.Tensor) -> None:
        if self.page_size > 1:
            swa_indices = swa_indices[swa_indices > 0]
        self.swa_attn_allocator.free(swa_indices)
        self._assert_capacity(self.swa_attn_allocator)

    @staticmethod
    def _assert_capacity(sub: PoolBase) -> None:
        # sglang's own guard: a double free shows up here, usually long after its cause.
        assert sub.available_size() <= sub.size, (  # noqa: S101
            f"available_size() {sub.available_size()} > size {sub.size}"
        )

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        if start_pos % self.page_size:
            raise AssertionError(f"segment start {start_pos} is not page-aligned")
        self._free_swa_pages(free_index)

    def _free_swa_pages(self, free_index: torch.Tensor) -> None:
        ps = self.page_size
        reps = free_index[::ps]
        swa_tokens = self.full_to_swa_index_mapping[reps]
        swa_pages = self._mapped_pages(swa_tokens) // ps
        self.clear_full_to_swa_mapping(self._mapping_to_clear(free_index))
        if self.free_group is not None:
            self.swa_page_ids_group.append(swa_pages)
            return
        self.swa_attn_allocator.free_page_ids(swa_pages)
        self._assert_capacity(self.swa_attn_allocator)

    def _mapped_pages(self, swa_tokens: torch.Tensor) -> torch.Tensor:
        """Hook (#38519): a page with no SWA peer reads as 0; skip it, never free page 0."""
        return swa_tokens[swa_tokens > 0]

    def free_full(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.full_attn_allocator.free(free_index)
        self._assert_capacity(self.full_attn_allocator)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        self.free_swa_segment(free_index, start_pos=start_pos)
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_group_begin(self) -> None:
        super().free_group_begin()
        self.swa_free_group = []
        self.swa_page_ids_group = []
        self.full_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        super().free_group_end()
        if self.swa_page_ids_group:
            pages, self.swa_page_ids_group = self.swa_page_ids_group, []
            self.swa_attn_allocator.free_page_ids(torch.cat(pages))
        if self.swa_free_group:
            pending, self.swa_free_group = self.swa_free_group, []
            self._release_swa(self._resolve_swa_group(pending))
        self.full_attn_allocator.free_group_end()
        self._assert_capacity(self.full_attn_allocator)
        self._assert_capacity(self.swa_attn_allocator)

    def _resolve_swa_group(self, pending: list[torch.Tensor]) -> torch.Tensor:
        """Hook (#36081): grouped ``free_swa`` resolved its SWA peers at call time."""
        return torch.cat(pending)

    def clear(self) -> None:
        self.swa_attn_allocator.clear()
        self.full_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1].fill_(0)
        self.free_group = None
        self.swa_free_group: list[torch.Tensor] = []
        self.swa_page_ids_group: list[torch.Tensor] = []
