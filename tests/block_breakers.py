"""vLLM-family managers that each break one block-pool rule by one overridden method:
the subjects of tests/test_block_rules.py, loaded as py:block_breakers:CLASS."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvreplay.families.vllm.pool import Block, BlockManager, BlockPool
from kvreplay.families.vllm.vocabulary import STATE_WINDOW


class DoubleFreeManager(BlockManager):
    def _free(self, **wire: Any) -> None:
        ids = [b.block_id for b in reversed(self._pop(wire["request_id"]))]
        self.wire_blocks.free_blocks(ids + ids[:1])  # the tail block listed twice


class _DoubleTouchPool(BlockPool):
    def touch(self, blocks: Sequence[Block]) -> None:
        super().touch(blocks)
        for b in blocks:
            b.ref_cnt += 1  # a prefix hit counted twice


class DoubleTouchManager(BlockManager):
    pool_class = _DoubleTouchPool


class _UnqueuedFreePool(BlockPool):
    def free_blocks(self, ordered: Iterable[Block]) -> None:
        for b in ordered:
            b.ref_cnt -= 1  # released, never queued


class UnqueuedFreeManager(BlockManager):
    pool_class = _UnqueuedFreePool


class _StickyPool(BlockPool):
    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        out = super().get_new_blocks(num_blocks)
        held = next((b for b in self.blocks[1:] if b.ref_cnt > 1 or (b.ref_cnt == 1 and b not in out)), None)
        return out if held is None else [held, *out[1:]]  # hands out a block someone holds


class StickyManager(BlockManager):
    pool_class = _StickyPool


class _MiscountingPool(BlockPool):
    def free_blocks(self, ordered: Iterable[Block]) -> None:
        super().free_blocks(ordered)
        self.free_block_queue.num_free_blocks += 1  # the count runs ahead of the links


class MiscountingManager(BlockManager):
    pool_class = _MiscountingPool


class NullFreeingManager(BlockManager):
    def _free(self, **wire: Any) -> None:
        super()._free(**wire)
        self.pool.free_block_queue.append_n([self.pool.null_block])  # the placeholder becomes free


class NullCountingManager(BlockManager):
    def _free(self, **wire: Any) -> None:
        super()._free(**wire)
        self.pool.null_block.ref_cnt -= 1  # as vLLM up to 0.32 freeing a window's placeholder


class _ForgetfulPool(BlockPool):
    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        out = self.free_block_queue.popleft_n(num_blocks) if num_blocks <= self.get_num_free_blocks() else []
        if len(out) < num_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        for b in out:
            b.block_hash = None  # reused, but the cache still maps its old hash to it
            b.ref_cnt += 1
        return out


class ForgetfulManager(BlockManager):
    pool_class = _ForgetfulPool


class LeakyManager(BlockManager):
    def _free(self, **wire: Any) -> None:
        ids = [b.block_id for b in reversed(self._pop(wire["request_id"]))]
        self.wire_blocks.free_blocks(ids[1:])  # the tail block is never released


class WindowManager(BlockManager):
    """The one group as a sliding window of WINDOW tokens, its blocks let go on the
    processed-token basis (vLLM 0.26 on): tokens scheduled but in flight still count as
    read. The correct counterpart of EagerWindowManager."""

    WINDOW = 8

    def windows(self) -> tuple[tuple[int, int], ...]:
        return ((self.WINDOW, self.block_size),)

    def window_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        return (tuple(-1 if b.is_null else b.block_id for b in self.req_to_blocks.get(request_id, ())),)

    def held_blocks(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ()) if not b.is_null]

    def basis(self, total: int, in_flight: int) -> int:
        return max(0, total - in_flight)

    def allocate_slots(self, **kw: Any) -> tuple[int, ...] | None:
        req = self._book.request(kw)
        total = req.num_computed_tokens + int(kw.get("num_new_computed_tokens") or 0)
        skip = max(0, self.basis(total, req.num_in_flight_tokens) - self.WINDOW + 1) // self.block_size
        table = self.req_to_blocks.get(req.request_id, [])
        gone = [b for b in table[:skip] if not b.is_null]
        for i in range(min(skip, len(table))):
            table[i] = self.pool.null_block
        if gone:
            self.wire_blocks.free_blocks([b.block_id for b in gone])
        return super().allocate_slots(**kw)

    def _free(self, **wire: Any) -> None:
        blocks = [b for b in reversed(self._pop(wire["request_id"])) if not b.is_null]
        self.wire_blocks.free_blocks([b.block_id for b in blocks])


class EagerWindowManager(WindowManager):
    def basis(self, total: int, in_flight: int) -> int:
        return total  # vLLM up to 0.25: the optimistic count, in-flight tokens as if processed


class StateManager(WindowManager):
    """The one group as a vLLM Mamba group: only the block with the state after the last
    processed token stays (a step starting at position p reads p-1's state), the earlier
    ones retired on the processed-token basis (vLLM 0.30 on)."""

    WINDOW = 2  # positions p-1 and p: the state block the next step reads, and its own

    def windows(self) -> tuple[tuple[int, int], ...]:
        return ((STATE_WINDOW, self.block_size),)


class UnretiredStateManager(StateManager):
    def basis(self, total: int, in_flight: int) -> int:
        # vLLM 0.26 to 0.29 stopped retiring at the first null gap that align-mode prefill
        # leaves between states; here no state is retired at all
        return 0


class EagerStateManager(StateManager):
    def basis(self, total: int, in_flight: int) -> int:
        return total  # vLLM up to 0.25: a step's tokens retire its state while it is in flight


class HoardingManager(BlockManager):
    """Keeps the id of every request it freed, in a list nobody drains (as a per-step list
    of finished requests would be, were the step never to end)."""

    def _free(self, **wire: Any) -> None:
        super()._free(**wire)
        self.__dict__.setdefault("finished", []).append(wire["request_id"])
