"""Historical vLLM v1 KV-cache manager bugs, each re-created on kvreplay's own manager
(block_pool.py) by overriding the one hook where the bug lived. They exist so the
block-pool checker can be shown to catch each one at the call that creates the bad
state, on the traces vLLM's scheduler makes."""

from __future__ import annotations

from kvreplay.families.vllm.pool import Block, BlockManager, BlockPool


class PinBeforeRoomCheckManager(BlockManager):
    """vLLM #11565 (the fix for #11562, December 2024): ``allocate_slots`` took a reference
    on the prefix hit's blocks (``touch``) before it checked that the request's new
    blocks fit. When they did not, it returned None with the hit's blocks referenced
    and out of the free queue, listed in no request's block table: blocks lost to the
    pool on every admission that had to wait, until none were left."""

    pins_hit_before_room_check = True


class _TailWithCachingOffPool(BlockPool):
    def _reuse_first(self, block: Block) -> bool:
        return self.enable_caching and block.block_hash is None


class TailWithCachingOffManager(BlockManager):
    """vLLM 0.27.0 and 0.27.1 (put back in 0.28.0): with prefix caching off, ``free_blocks``
    appended every freed block to the free queue's tail, where its own comment asked for
    the head, so the next allocation got the coldest blocks instead of the ones just
    used. No block is lost or shared: a trace recorded elsewhere parts at the first
    allocation after a free, with other block ids."""

    pool_class = _TailWithCachingOffPool
