"""What every builtin pool shares: the constructor fields, free groups and the
segment-free contract of sglang 0.5.23's ``BaseTokenToKVPoolAllocator``.

A free group defers frees until ``free_group_end``; a segment is a slice of one
request's kv row starting on a page boundary, and its whole last page is released."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

Segment = tuple[torch.Tensor, int]


class PoolBase:
    free_pages: torch.Tensor

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: Any,
        device: str | torch.device,
        kvcache: Any,
        need_sort: bool,
    ) -> None:
        if size < 0 or page_size < 1:
            raise ValueError(f"bad pool geometry: size={size} page_size={page_size}")
        self.size = int(size)
        self.page_size = int(page_size)
        self.dtype = dtype
        self.device = torch.device(device) if isinstance(device, str) else device
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.free_group: list[torch.Tensor] | None = None

    @property
    def size_full(self) -> int:
        return self.size

    def get_kvcache(self) -> Any:
        return self._kvcache

    def free(self, free_index: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def free_group_begin(self) -> None:
        if self.free_group is not None:
            raise AssertionError("free groups cannot be nested")
        self.free_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(torch.cat(pending))

    def free_full(self, free_index: torch.Tensor) -> None:
        self.free(free_index)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        _check_aligned(start_pos, self.page_size)
        self.free(free_index)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        _check_aligned(start_pos, self.page_size)
        self.free_full(free_index)

    def free_segments(self, segments: Iterable[Segment]) -> None:
        for free_index, start_pos in page_disjoint(segments, self.page_size):
            self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments: Iterable[Segment]) -> None:
        for free_index, start_pos in page_disjoint(segments, self.page_size):
            self.free_full_segment(free_index, start_pos=start_pos)


def _check_aligned(start_pos: int, page_size: int) -> None:
    if start_pos % page_size:
        raise AssertionError(f"segment start {start_pos} is not page-aligned")


def page_disjoint(segments: Iterable[Segment], page_size: int) -> Iterator[Segment]:
    """Skip empty segments and refuse two that share a page, which would free it twice."""
    prev_end = None
    for free_index, start_pos in segments:
        n = free_index.numel()
        if n == 0:
            continue
        if prev_end is not None and start_pos // page_size <= (prev_end - 1) // page_size:
            raise AssertionError(
                f"segment at {start_pos} shares a page with the one ending at {prev_end}"
            )
        prev_end = start_pos + n
        yield free_index, start_pos


def expand_to_pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token index of every page touched by ``indices`` (duplicates kept)."""
    base = (indices // page_size) * page_size
    offsets = torch.arange(page_size, dtype=indices.dtype, device=indices.device)
    return (base[:, None] + offsets[None, :]).reshape(-1)
