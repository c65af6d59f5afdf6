"""kvreplay's own vLLM-family pool: a KV-cache manager over a block pool, written from
the behaviour of vLLM v1's (``KVCacheManager``, the full-attention single-type
manager, ``BlockPool`` and its free-block queue), speaking the family's wire
(block_wire.py) directly, so that no vLLM is needed to replay a vLLM trace.

What it covers: one full-attention KV-cache group, prefix caching with whole-block
hashes (``hash_block_size == block_size``), the watermark, ``full_sequence_must_fit``.
Blocks keep their attributes under vLLM's names (``ref_cnt``, ``block_hash``, the free
queue's links), so the checker reads both alike.

The free queue is a doubly linked list in eviction order: blocks taken from its head;
a freed block without a hash goes to the head (reused first), one with a hash to the
tail (an eviction candidate, reused last). Taking a cached block from the queue drops
its hash; a prefix hit takes a reference on a block (``touch``), lifting it out of
the queue if it was free."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvreplay.errors import BuildUnsupported
from kvreplay.families.vllm.block_wire import EMPTY, RequestBook, StandIn, blocks_by_id, groups_in, groups_out
from kvreplay.families.vllm.vocabulary import VLLM_MANAGER_NAMES


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Any = None
        self.prev_free_block: Block | None = None
        self.next_free_block: Block | None = None
        self.is_null = False


class FreeQueue:
    """Free blocks in eviction order, between two fake ends."""

    def __init__(self, blocks: list[Block]) -> None:
        self.fake_free_list_head = Block(-1)
        self.fake_free_list_tail = Block(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def _link(self, after: Block, blocks: list[Block]) -> None:
        before = after.next_free_block
        assert before is not None
        for b in blocks:
            b.prev_free_block, after.next_free_block = after, b
            after = b
        after.next_free_block, before.prev_free_block = before, after
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[Block]) -> None:
        if blocks:
            tail_prev = self.fake_free_list_tail.prev_free_block
            assert tail_prev is not None
            self._link(tail_prev, blocks)

    def prepend_n(self, blocks: list[Block]) -> None:
        if blocks:
            self._link(self.fake_free_list_head, blocks)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def popleft_n(self, n: int) -> list[Block]:
        out = []
        for _ in range(n):
            first = self.fake_free_list_head.next_free_block
            if first is None or first is self.fake_free_list_tail:
                raise ValueError("no free blocks available")
            self.remove(first)
            out.append(first)
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block (block 0 is the null block)")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.free_block_queue = FreeQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft_n(1)[0]  # a placeholder, never handed out
        self.null_block.is_null = True
        # hash key -> the blocks carrying it, first cached first (a lookup takes the first)
        self.cache: dict[Any, dict[int, Block]] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, key: Any) -> Block | None:
        blocks = self.cache.get(key)
        return next(iter(blocks.values())) if blocks else None

    def _evict(self, block: Block) -> None:
        key = block.block_hash
        if key is None:
            return
        blocks = self.cache.get(key)
        if blocks is not None and blocks.pop(block.block_id, None) is not None and not blocks:
            del self.cache[key]
        block.block_hash = None

    def cache_block(self, block: Block, key: Any) -> None:
        if block.is_null or block.block_hash == key:
            return
        if block.block_hash is not None:
            self._evict(block)
        block.block_hash = key
        self.cache.setdefault(key, {})[block.block_id] = block

    # the calls a recording shows as nested rows
    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        out = self.free_block_queue.popleft_n(num_blocks)
        for b in out:
            if self.enable_caching:
                self._evict(b)
            assert b.ref_cnt == 0
            b.ref_cnt += 1
        return out

    def touch(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        first, last = [], []
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                (first if self._reuse_first(b) else last).append(b)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def _reuse_first(self, block: Block) -> bool:
        """Does a freed block go to the free queue's head (handed out next)? One that holds
        nothing a lookup could hit: the recently used, still warm in the caches."""
        return block.block_hash is None or not self.enable_caching

    def reset_prefix_cache(self) -> bool:
        if len(self.blocks) - self.get_num_free_blocks() != 1:  # only the null block in use
            return False
        self.cache = {}
        for b in self.blocks:
            b.block_hash = None
        return True


class _BlockWire:
    """The nested calls, as the wire's BlockWire shows them (blocks by id)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.log: list[tuple[str, Any]] | None = None

    def _logged(self, name: str, result: Any) -> Any:
        if self.log is not None:
            self.log.append((name, result))
        return result

    def get_new_blocks(self, num_blocks: int) -> tuple[int, ...]:
        return self._logged("get_new_blocks", tuple(b.block_id for b in self.pool.get_new_blocks(num_blocks)))  # type: ignore[no-any-return]

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self.pool.free_blocks(blocks_by_id(self.pool, block_ids))
        self._logged("free_blocks", tuple(block_ids))

    def touch(self, block_ids: Sequence[int]) -> None:
        self.pool.touch(blocks_by_id(self.pool, block_ids))
        self._logged("touch", tuple(block_ids))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """vLLM's KV-cache manager for one full-attention group, on the family's wire."""

    # the requests the scheduler looked up: its queue, which no pool bounds
    growth_exempt = ("_book",)

    engine = "kvreplay"
    pool_class: type[BlockPool] = BlockPool  # a bug variant may break the pool
    # vLLM since #11565 takes a reference on a prefix hit's blocks only once the request's
    # new blocks are known to fit; before it, first (block_variants.py)
    pins_hit_before_room_check = False

    def __init__(self, num_blocks: int, block_size: int, hash_block_size: int, max_model_len: int,
                 max_in_flight_tokens: int, enable_caching: bool, watermark: float, attention: str,
                 retention_interval: int | None = None, use_eagle: bool | None = None) -> None:
        # retention_interval thins a sliding window's cached blocks; full attention caches every one
        # a trace this manager cannot model is one it does not replay, not bad input
        if attention != "full":
            raise BuildUnsupported(f"the builtin vLLM manager has full attention only, not {attention}")
        if hash_block_size != block_size:
            raise BuildUnsupported("the builtin vLLM manager hashes whole blocks only (hash_block_size == block_size)")
        self.ctor_args = dict(num_blocks=num_blocks, block_size=block_size, hash_block_size=hash_block_size,
                              max_model_len=max_model_len, max_in_flight_tokens=max_in_flight_tokens,
                              enable_caching=enable_caching, watermark=watermark, attention=attention)
        if retention_interval is not None:
            self.ctor_args["retention_interval"] = retention_interval
        if use_eagle:
            self.ctor_args["use_eagle"] = True
        # An EAGLE drafter runs one token ahead of the verified prefix, so a hit gives up its
        # last block: the drafter's states for it are not cached with it.
        self.use_eagle = bool(use_eagle)
        self.pool = self.pool_class(num_blocks, enable_caching)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.wire_blocks = _BlockWire(self.pool)
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._book = RequestBook()
        # a replay reads the free count after every call: one frame, not two
        self.available_size = self.pool.get_num_free_blocks  # type: ignore[method-assign]
        for name, real in VLLM_MANAGER_NAMES.items():  # the wire's names for this manager's methods
            setattr(self, name, getattr(self, f"_{real}"))

    # -- what the checker and the trace counters read --------------------------------------
    def available_size(self) -> int:  # replaced per instance by the pool's own method (__init__)
        return self.pool.get_num_free_blocks()

    def held_blocks(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def windows(self) -> tuple[tuple[int, int], ...]:  # full attention only: no window to prune
        return ()

    def window_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        return ()

    def cached_blocks(self) -> Iterator[tuple[Any, list[int]]]:
        for key, blocks in self.pool.cache.items():
            yield key, list(blocks)

    # -- values ------------------------------------------------------------------------------
    def _blocks_out(self, blocks: list[Block]) -> tuple[int, ...]:
        return groups_out([blocks]) if blocks else EMPTY

    def _blocks_in(self, wire: Sequence[int] | None) -> list[Block] | None:
        """Blocks from the wire; None for the manager's shared empty list."""
        if wire is None:
            return None
        groups = groups_in(wire)
        if groups is None:
            return None
        if len(groups) != 1:
            raise ValueError("the builtin vLLM manager has one KV-cache group")
        return blocks_by_id(self.pool, groups[0])

    # -- the manager's calls -------------------------------------------------------------------
    def get_computed_blocks(self, **wire: Any) -> tuple[int, ...]:
        req = self._book.request(wire)
        if not self.enable_caching or req.skip_reading_prefix_cache:
            return (0, 0, *EMPTY)
        # a full hit still recomputes the last token, for its logits
        hit: list[Block] = []
        for h in req.block_hashes[:(req.num_tokens - 1) // self.block_size]:
            block = self.pool.get_cached_block((h, 0))
            if block is None:
                break
            hit.append(block)
        if self.use_eagle and hit:
            hit.pop()
        return (len(hit) * self.block_size, 0, *self._blocks_out(hit))

    def allocate_slots(self, *, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[int] | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, **wire: Any) -> tuple[int, ...] | None:
        req = self._book.request(wire)
        rid = req.request_id
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError("the builtin vLLM manager has no KV connector or cross-attention")
        computed = self._blocks_in(new_computed_blocks)
        new_list = computed or []
        num_local = req.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local, self.max_model_len)
        watermark = self.watermark_blocks if has_scheduled_reqs and _status(req) in ("WAITING", "PREEMPTED") else 0
        pinned = bool(self.pins_hit_before_room_check and new_list and rid not in self.num_cached_block)
        if pinned and self.enable_caching:
            self.wire_blocks.touch([b.block_id for b in new_list])
        if full_sequence_must_fit:
            need = self._to_allocate(rid, min(req.num_tokens, self.max_model_len), new_list, num_local)
            if need + watermark > self.pool.get_num_free_blocks():
                return None
        main = total_computed + num_new_tokens
        need_slot = min(main + num_lookahead_tokens, self.max_model_len)
        need = self._to_allocate(rid, need_slot, new_list, num_local)
        if need + watermark > self.pool.get_num_free_blocks() - reserved_blocks:
            return None
        if computed is not None:
            self._add_computed(rid, new_list, num_local, pinned)
        new_blocks = self._allocate_new(rid, need_slot)
        if not delay_cache_blocks:
            self._cache(req, min(total_computed + num_new_tokens, req.num_tokens))
        return self._blocks_out(new_blocks)

    def _to_allocate(self, rid: str, num_tokens: int, new_computed: list[Block], num_local: int) -> int:
        required = _cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(rid, ()))
        if rid in self.num_cached_block:  # a running request has no new prefix hits
            return max(required - held, 0)
        new = max(required - (len(new_computed) + held), 0)
        evictable = sum(b.ref_cnt == 0 and not b.is_null for b in new_computed)
        if new_computed and num_local % self.block_size:
            raise NotImplementedError("a prefix hit ending inside a block (copy-on-write) is not built in")
        return new + evictable

    def _add_computed(self, rid: str, blocks: list[Block], num_local: int, pinned: bool = False) -> None:
        if rid in self.num_cached_block:
            return
        table = self.req_to_blocks.setdefault(rid, [])
        assert not table
        if self.enable_caching and not pinned:
            self.wire_blocks.touch([b.block_id for b in blocks])
        table.extend(blocks)
        self.num_cached_block[rid] = len(table)

    def _allocate_new(self, rid: str, num_tokens: int) -> list[Block]:
        table = self.req_to_blocks.setdefault(rid, [])
        n = _cdiv(num_tokens, self.block_size) - len(table)
        if n <= 0:
            return []
        new = [self.pool.blocks[i] for i in self.wire_blocks.get_new_blocks(n)]
        table.extend(new)
        return new

    def _cache(self, req: StandIn, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = req.request_id
        cached = self.num_cached_block.get(rid, 0)
        full = num_tokens // self.block_size
        if cached >= full:
            return
        table = self.req_to_blocks.get(rid, [])
        for i, block in enumerate(table[cached:full], start=cached):
            self.pool.cache_block(block, (req.block_hashes[i], 0))
        self.num_cached_block[rid] = full

    def cache_blocks(self, *, num_computed_tokens: int, **wire: Any) -> None:
        self._cache(self._book.request(wire), num_computed_tokens)

    def _free(self, **wire: Any) -> None:
        rid = wire["request_id"]
        blocks = self._pop(rid)
        self.wire_blocks.free_blocks([b.block_id for b in reversed(blocks)])
        self._book.forget(rid)

    def _pop(self, rid: str) -> list[Block]:
        self.num_cached_block.pop(rid, None)
        return self.req_to_blocks.pop(rid, [])

    def pop_blocks_for_free(self, **wire: Any) -> tuple[int, ...]:
        return tuple(b.block_id for b in self._pop(wire["request_id"]))

    def remove_skipped_blocks(self, **wire: Any) -> None:
        """Full attention skips no tokens: nothing leaves the window."""

    def evict_blocks(self, *, block_ids: Sequence[int]) -> None:
        for block in blocks_by_id(self.pool, block_ids):
            self.pool._evict(block)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def new_step_starts(self) -> None:
        """Only state-space (mamba) groups act at a step boundary."""


def _status(req: StandIn) -> str:
    status = req.status
    return getattr(status, "name", status) or ""
