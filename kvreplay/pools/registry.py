"""The builtin builds: each reference pool and bug variant under its ``builtin:`` name.

Classes are named, not imported: reading the registry (to parse a build spec, to
list builds) costs no torch import."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinBuild:
    name: str
    family: str
    where: str  # MODULE:CLASS
    summary: str

    @property
    def cls(self) -> type:
        module, _, attr = self.where.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def base(self) -> str:
        """The correct pool a variant breaks (``swa`` for ``swa@stale-tail``)."""
        return self.name.partition("@")[0]


_V = "kvreplay.pools.variants:"
BUILTINS: dict[str, BuiltinBuild] = {
    b.name: b
    for b in [
        BuiltinBuild("token", "token", "kvreplay.pools.token:TokenPool", "token pool (page_size 1), as sglang 0.5.23"),
        BuiltinBuild("paged", "paged", "kvreplay.pools.paged:PagedPool", "paged pool, as sglang 0.5.23"),
        BuiltinBuild("swa", "swa", "kvreplay.pools.swa:SWAPool",
                     "full + SWA pool, as sglang 0.5.23 with #38519 and the alloc_decode None leak fixed"),
        BuiltinBuild("swa@stale-tail", "swa", _V + "StaleTailSWAPool",
                     "sglang 0.5.12: no #25805, no #27779 (seed double-free bug)"),
        BuiltinBuild("swa@page-partial-clear", "swa", _V + "PagePartialClearSWAPool",
                     "sglang 0.5.12.post1: #25805 in, #27779 not (released page keeps a mapping)"),
        BuiltinBuild("swa@unfiltered-page0", "swa", _V + "UnfilteredPage0SWAPool",
                     "#38519: free_swa_segment frees SWA page 0 for unmapped pages"),
        BuiltinBuild("swa@deferred-lookup", "swa", _V + "DeferredLookupSWAPool",
                     "#36081: grouped free_swa reads the mapping at free_group_end"),
        BuiltinBuild("vllm", "vllm", "kvreplay.pools.block_pool:BlockManager",
                     "vLLM v1 KV-cache manager: one full-attention group, prefix caching, as vllm 0.32"),
        BuiltinBuild("vllm@pin-before-room-check", "vllm", "kvreplay.pools.block_variants:PinBeforeRoomCheckManager",
                     "vLLM #11565: allocate_slots pins a prefix hit before it knows the request fits"),
        BuiltinBuild("vllm@tail-with-caching-off", "vllm",
                     "kvreplay.pools.block_variants:TailWithCachingOffManager",
                     "vLLM 0.27.0-0.27.1: with caching off, freed blocks go to the free queue's tail"),
    ]
}
# The correct pool of each family: what a trace of that family replays clean on.
DEFAULT_FOR_FAMILY = {"token": "builtin:token", "paged": "builtin:paged", "swa": "builtin:swa", "vllm": "builtin:vllm"}
