"""The toy family's pool: sglang's token allocator API over a stack of slots."""

from __future__ import annotations

from typing import Any

import torch


class StackPool:
    toy_stack = True

    def __init__(self, size: int, device: Any = "cpu") -> None:
        self.size, self.device, self.page_size = size, device, 1
        self.clear()

    def clear(self) -> None:
        # slot 0 is padding, as in sglang's pools; the lowest slot is at the end (popped first)
        self.free_pages = torch.arange(self.size, 0, -1, dtype=torch.int64)
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []

    def available_size(self) -> int:
        return len(self.free_pages)

    def _take(self, need: int) -> torch.Tensor:
        out = self.free_pages[-need:].flip(0)
        self.free_pages = self.free_pages[:-need]
        return out

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self.free_pages):
            return None
        return self._take(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        back = torch.cat([self.free_pages, free_index.to(torch.int64)])
        self.free_pages = back.sort(descending=True).values

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []


class HighestFirstPool(StackPool):
    """The bug: the stack's order is read the wrong way round."""

    def _take(self, need: int) -> torch.Tensor:
        out = self.free_pages[:need]
        self.free_pages = self.free_pages[need:]
        return out


def construct(fam: Any, cls: type, ctor: dict[str, Any], device: Any) -> Any:
    return cls(size=int(ctor["size"]), device=device)
