"""kvreplay's own reference pools, written from scratch in torch, plus bug variants."""

from kvreplay.replayer.pools.paged import PagedPool
from kvreplay.replayer.pools.swa import SWAPool
from kvreplay.replayer.pools.token import TokenPool
from kvreplay.replayer.pools.variants import (
    DeferredLookupSWAPool,
    PagePartialClearSWAPool,
    StaleTailSWAPool,
    UnfilteredPage0SWAPool,
)

__all__ = [
    "DeferredLookupSWAPool",
    "PagePartialClearSWAPool",
    "PagedPool",
    "SWAPool",
    "StaleTailSWAPool",
    "TokenPool",
    "UnfilteredPage0SWAPool",
]
