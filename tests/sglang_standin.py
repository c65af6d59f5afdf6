"""Real sglang allocators with a memory-free KV stand-in, for the parity tests.

Loaded as py:sglang_standin:CLASS. The SWA allocator insists on a BaseSWAKVPool; this
one holds the full->SWA mapping and allocates no KV buffers."""

from __future__ import annotations

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool


class MappingOnlySWAKV(BaseSWAKVPool):
    def __init__(self) -> None:
        self.full_to_swa_index_mapping = None

    def register_mapping(self, full_to_swa_index_mapping):
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa_index_mapping[kv_indices]

    def get_state_buf_infos(self):
        return [], [], []


MappingOnlySWAKV.__abstractmethods__ = frozenset()  # the KV-buffer methods are never called


class SglangSWA(SWATokenToKVPoolAllocator):
    def __init__(self, size, size_swa, page_size, dtype, device, kvcache, need_sort):
        super().__init__(size, size_swa, page_size, dtype, device, MappingOnlySWAKV(), need_sort)


SglangPaged = PagedTokenToKVPoolAllocator
