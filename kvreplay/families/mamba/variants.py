"""Historical bugs of sglang's hybrid request pool, each re-created on kvreplay's own pool
(pool.py) by overriding the one hook where it lived."""

from __future__ import annotations

from typing import Any

from kvreplay.families.mamba.pool import HybridStatePool


class StalePingPongPool(HybridStatePool):
    """sglang 0.5.9 to 0.5.12.post1 (fixed in 0.5.13): ``free_mamba_cache`` freed a
    request's tracking pair but left the pair on the request. A request that comes back
    (retracted, then scheduled again) skips the pair's allocation at its next ``alloc``
    and writes its tracked states into two slots that are free, and that the allocator
    hands to the next request: one slot, two owners, while the slots it should have
    taken stay free."""

    def forget_track(self, req: Any) -> None:
        pass
