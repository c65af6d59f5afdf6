"""kvreplay's own hybrid request pool: request rows and the state slots of a
state-space model, re-implemented from sglang 0.5.23's behaviour (its
``HybridReqToTokenPool`` over a ``MambaSlotAllocator``), with sglang's API so that the
wire (wire.py) speaks to it and to a release's pool alike.

A request holds one row, one state slot (its recurrent state) and, with the extra
buffer on, a ping-pong pair of tracking slots that snapshots of its state are written
to; when it ends, one of the pair may be kept for the prefix cache. Requests are
objects: the pool reads and writes their fields (``req.kv`` is the request itself in
the wire's stand-ins, as older releases kept the fields on the request)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class StateSlots:
    """The state slots' free list (sglang's MambaSlotAllocator): slot 0 is a dummy
    target for padded rows, never handed out; handed out from the head, freed to the
    tail; ``alloc_group_begin`` takes a batch that ``alloc(1)`` then draws from."""

    def __init__(self, size: int, device: str = "cpu") -> None:
        self.size = size
        self.device = device
        self._group: Iterator[torch.Tensor] | None = None
        self.clear()

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc_group_begin(self, num_reqs: int) -> None:
        self._group = None
        if num_reqs > 0:
            got = self._take(num_reqs)
            if got is not None:
                self._group = iter(got.split(1))

    def alloc_group_end(self) -> None:
        if self._group is not None:
            left = list(self._group)
            if left:
                self.free(torch.cat(left))
        self._group = None

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if self._group is not None and need_size == 1:
            slot = next(self._group, None)
            if slot is not None:
                return slot
        return self._take(need_size)

    def _take(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.free_slots = torch.cat((self.free_slots, free_index))

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)


class HybridStatePool:
    """Rows and state slots of requests, as sglang 0.5.23's hybrid request pool keeps
    them (the extra buffer's lazy mode and ReplaySSM left out)."""

    slots_class = StateSlots

    def __init__(self, size: int, mamba_size: int, extra_buffer: bool = True, ping_pong: int = 2,
                 max_context_len: int = 0, device: str = "cpu", **_: Any) -> None:
        self.size = size
        self.max_context_len = int(max_context_len or 0)
        self.device = device
        self.free_rows = list(range(1, size + 1))  # row 0 pads cuda-graph batches
        self.mamba_allocator = self.slots_class(mamba_size, device)
        self.enable_mamba_extra_buffer = bool(extra_buffer)
        self.mamba_ping_pong_track_buffer_size = int(ping_pong)
        self.track_of_row = torch.zeros((size + 1, max(int(ping_pong), 1)), dtype=torch.int64)

    # -- rows ---------------------------------------------------------------------------------
    def available_size(self) -> int:
        return len(self.free_rows)

    def _take_rows(self, n: int) -> list[int] | None:
        if n > len(self.free_rows):
            return None
        if n == 0:
            return []
        out = self.free_rows[-n:]  # from the tail: O(n)
        del self.free_rows[-n:]
        return out

    def alloc(self, reqs: list[Any]) -> list[int] | None:
        fresh = [r for r in reqs if r.kv.req_pool_idx is None]
        rows = self._take_rows(len(fresh))
        if rows is None:
            return None
        for r, row in zip(fresh, rows, strict=True):
            r.kv.req_pool_idx = row
        for r in reqs:
            if r.kv.mamba_pool_idx is None:  # a prefix hit or a continuing chunk holds one
                mid = self.mamba_allocator.alloc(1)
                assert mid is not None, "Not enough space for mamba cache"
                r.kv.mamba_pool_idx = mid[0]
            if self.enable_mamba_extra_buffer:
                if self.needs_track(r):
                    self.alloc_track(r)
                # the row's copy of the pair: what free_mamba_cache frees
                self.track_of_row[r.kv.req_pool_idx, :self.mamba_ping_pong_track_buffer_size] = \
                    r.kv.mamba_ping_pong_track_buffer
        return [r.kv.req_pool_idx for r in reqs]

    def free(self, req: Any) -> None:
        assert req.kv.req_pool_idx is not None, "request must have req_pool_idx"
        self.free_rows.append(req.kv.req_pool_idx)
        req.kv.req_pool_idx = None

    def clear(self) -> None:
        self.free_rows = list(range(1, self.size + 1))
        self.mamba_allocator.clear()

    # -- the ping-pong pair -------------------------------------------------------------------
    def needs_track(self, req: Any) -> bool:
        return req.kv.mamba_ping_pong_track_buffer is None

    def alloc_track(self, req: Any) -> None:
        n = self.mamba_ping_pong_track_buffer_size
        slots = self.mamba_allocator.alloc(n)
        assert slots is not None, "Not enough space for mamba ping pong idx"
        req.kv.mamba_ping_pong_track_buffer = slots
        req.kv.mamba_ping_pong_empty = [False] * n
        req.kv.mamba_next_track_idx = 0
        req.kv.mamba_last_track_idx = 1 if n == 2 else 0  # the other entry of the pair

    def donate_mamba_ping_pong_slot(self, req: Any, new_slot: torch.Tensor) -> torch.Tensor:
        """Hand the slot holding the last tracked state to the prefix cache; ``new_slot``
        takes its place in the pair."""
        at = req.kv.mamba_last_track_idx
        donated = req.kv.mamba_ping_pong_track_buffer[at].unsqueeze(-1).clone()
        req.kv.mamba_ping_pong_track_buffer[at] = new_slot[0]
        self.track_of_row[req.kv.req_pool_idx, at] = new_slot[0]
        return donated

    def free_mamba_cache(self, req: Any, mamba_ping_pong_track_buffer_to_keep: int | None = None) -> None:
        assert req.kv.mamba_pool_idx is not None, "double free? mamba_index is None"
        self.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(0))
        req.kv.mamba_pool_idx = None
        if not self.enable_mamba_extra_buffer:
            return
        size, keep = self.mamba_ping_pong_track_buffer_size, mamba_ping_pong_track_buffer_to_keep
        assert keep in (None, 0, 1) and (keep != 1 or size == 2), f"cannot keep ping-pong entry {keep} of {size}"
        row = self.track_of_row[req.kv.req_pool_idx]
        empty = req.kv.mamba_ping_pong_empty or [False] * size
        at = [p for p in range(size) if p != keep and not empty[p]]
        if len(at) == size:
            self.mamba_allocator.free(row[:size])
        else:  # one free per entry, as sglang frees them
            for p in at:
                self.mamba_allocator.free(row[p:p + 1])
        self.forget_track(req)

    def forget_track(self, req: Any) -> None:
        """The request no longer names its pair: the next alloc gives it a new one."""
        req.kv.mamba_ping_pong_track_buffer = None
        req.kv.mamba_ping_pong_empty = None
        req.kv.mamba_next_track_idx = None
        req.kv.mamba_last_track_idx = None
