"""Historical vLLM v1 KV-cache manager bugs, each re-created on kvreplay's own manager
(block_pool.py) by overriding the one hook where the bug lived. They exist so the
block-pool checker can be shown to catch each one at the call that creates the bad
state, on the traces vLLM's scheduler makes."""

from __future__ import annotations

from kvreplay.pools.block_pool import BlockManager


class PinBeforeRoomCheckManager(BlockManager):
    """vLLM #11565 (the fix for #11562, December 2024): ``allocate_slots`` took a reference
    on the prefix hit's blocks (``touch``) before it checked that the request's new
    blocks fit. When they did not, it returned None with the hit's blocks referenced
    and out of the free queue, listed in no request's block table: blocks lost to the
    pool on every admission that had to wait, until none were left."""

    pins_hit_before_room_check = True
