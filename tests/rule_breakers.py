"""Pools that each break one rule of the checker, by one overridden method: the
subjects of tests/test_rules.py, loaded as py:rule_breakers:CLASS."""

from __future__ import annotations

import torch

from kvreplay.families.sglang.paged import PagedPool
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.families.sglang.token import TokenPool


class OverReportingTokenPool(TokenPool):
    def available_size(self) -> int:
        return super().available_size() + self.size  # more than the pool has


class UnderReportingTokenPool(TokenPool):
    def available_size(self) -> int:
        return max(0, super().available_size() - 1)  # within bounds, one slot short


class TwiceFreedTokenPool(TokenPool):
    def free(self, free_index: torch.Tensor) -> None:
        super().free(free_index)
        self.free_pages = torch.cat((self.free_pages, free_index[:1]))  # the first slot listed twice


class PaddingFreeingTokenPool(TokenPool):
    def free(self, free_index: torch.Tensor) -> None:
        super().free(free_index)
        self.free_pages = torch.cat((self.free_pages, torch.zeros(1, dtype=torch.int64)))


class WildFreeListTokenPool(TokenPool):
    def free(self, free_index: torch.Tensor) -> None:
        super().free(free_index)
        self.free_pages = torch.cat((self.free_pages, torch.tensor([self.size + 7])))


class KeepsHandedOutTokenPool(TokenPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.free_pages[:need_size].clone()  # handed out, and still on the free list


class WildHandoutTokenPool(TokenPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        out = super().alloc(need_size)
        return None if out is None else torch.cat((out[:-1], torch.tensor([self.size + 3])))


class DroppingFreeTokenPool(TokenPool):
    def free(self, free_index: torch.Tensor) -> None:
        pass  # the slots never come back


class NoneButTakenTokenPool(TokenPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        super().alloc(need_size)
        return None  # "no room", yet the slots are gone


class KeepsPeerSWAPool(SWAPool):
    def free_swa(self, free_index: torch.Tensor) -> None:
        peers = self.full_to_swa_index_mapping[free_index]
        self.swa_attn_allocator.free(peers[peers > 0])  # the mapping is not cleared


class SharedPeerSWAPool(SWAPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        full = super().alloc(need_size)
        if full is not None and len(full) > 1:
            self.full_to_swa_index_mapping[full[1]] = self.full_to_swa_index_mapping[full[0]]
        return full


class FreePeerSWAPool(SWAPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        full = super().alloc(need_size)
        if full is not None:
            free_swa = self.swa_attn_allocator.free_pages[-1]  # a slot the SWA pool still lists free
            self.full_to_swa_index_mapping[full[-1]] = free_swa
        return full


class NoPeerSWAPool(SWAPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        full = super().alloc(need_size)
        if full is not None:
            self.full_to_swa_index_mapping[full[-1]] = 0
        return full


class OrphanSWAPool(SWAPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        # unmaps the slots it handed out before, while they are still held: their SWA
        # peers stay taken, mapped from nothing
        previous = getattr(self, "_previous", None)
        if previous is not None:
            self.clear_full_to_swa_mapping(previous)
        self._previous = super().alloc(need_size)
        return self._previous


class SentinelSWAPool(SWAPool):
    def alloc(self, need_size: int) -> torch.Tensor | None:
        full = super().alloc(need_size)
        self.full_to_swa_index_mapping[-1] = 0
        return full


class StaleTailSWAPool(KeepsPeerSWAPool):
    """The seed bug's shape: pages freed with their mapping kept, then handed out again
    by alloc_extend_swa_tail, which does not clear their non-tail part (#25805)."""

    def _clear_non_tail(self, non_tail: torch.Tensor) -> None:
        pass


class HoardingTokenPool(TokenPool):
    """Keeps every freed index tensor in a list nobody drains: a pending-free list that is
    never flushed. Every slot is still accounted for; only the list grows."""

    def free(self, free_index: torch.Tensor) -> None:
        super().free(free_index)
        self.__dict__.setdefault("pending", []).append(free_index)


__all__ = [name for name, v in dict(globals()).items() if isinstance(v, type) and
           issubclass(v, (TokenPool, PagedPool, SWAPool)) and v not in (TokenPool, PagedPool, SWAPool)]
