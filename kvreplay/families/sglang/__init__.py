"""sglang's KV-cache allocators: the token, paged and SWA (full + sliding-window)
families, and sglang as an engine whose releases are builds.

The families speak sglang's allocator API (pool_api.RECORDED_METHODS): the generic
replayer and invariant checker serve all three; the SWA family adds its mapping
checks (swa_checks.py here) through the sub-pools it declares."""

from __future__ import annotations

from functools import partial
from typing import Any

from kvreplay.contract.record import BuiltinBuild, Engine, Family, Scenario
from kvreplay.families.sglang.vocabulary import RECORDED_METHODS, VOCABULARY, VOID_METHODS

ENGINE = Engine(
    name="sglang",
    example="0.5.12",
    summary="sglang's token, paged and SWA allocators",
    installed="kvreplay.families.sglang.release:installed",
    dists=("sglang",),
    sdists=True,
    git_trees=True,
    drive="kvreplay.families.sglang.drive:NATIVE",
    cpu_compat="kvreplay.families.sglang.cpu_compat:PATCHES",
)

_BUILD = "kvreplay.families.sglang.release:construct"
_V = "kvreplay.families.sglang.variants:"
_SCENARIOS = "kvreplay.families.sglang.scenarios:"
# Where each family's allocator lives in a release, newest layout first (the
# allocator package was split into modules over the 0.5 series).
_TOKEN_CLASSES = ("sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator",
                  "sglang.srt.mem_cache.allocator:TokenToKVPoolAllocator")
_PAGED_CLASSES = ("sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator",
                  "sglang.srt.mem_cache.allocator:PagedTokenToKVPoolAllocator")
_SWA_CLASSES = ("sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator",
                "sglang.srt.mem_cache.allocator:SWATokenToKVPoolAllocator",
                "sglang.srt.mem_cache.swa_memory_pool:SWATokenToKVPoolAllocator")


def _common(pool: Any, size: int) -> dict[str, Any]:
    return {"size": size, "dtype": str(getattr(pool, "dtype", "torch.int64")),
            "device": str(getattr(pool, "device", "cpu")), "need_sort": bool(getattr(pool, "need_sort", False))}


def _token_ctor(pool: Any) -> dict[str, Any]:
    return _common(pool, int(pool.size))


def _paged_ctor(pool: Any) -> dict[str, Any]:
    return {**_common(pool, int(pool.size)), "page_size": int(pool.page_size)}


def _swa_ctor(pool: Any) -> dict[str, Any]:
    return {**_common(pool, int(getattr(pool, "size_full", pool.size))), "page_size": int(pool.page_size),
            "size_swa": int(pool.size_swa)}


def _one_pool(ctor: dict[str, Any]) -> dict[str, int]:
    return {"pool": int(ctor["size"])}


# What the three families share: sglang's allocator API, token slots, the generic replayer.
_sglang_family = partial(Family, engine=ENGINE.name, methods=RECORDED_METHODS, unit="slots",
                         replayer="kvreplay.families.sglang.replayer:Replayer",
                         checker="kvreplay.families.sglang.checker:InvariantChecker",
                         vocabulary=VOCABULARY, void_methods=VOID_METHODS,
                         profile="kvreplay.families.sglang.profile:see")

TOKEN = _sglang_family(
    name="token",
    summary="sglang's token allocator (page size 1)",
    ctor_args=("size", "dtype", "device", "kvcache", "need_sort"),
    sizes=("size",),
    units=(),
    sub_pools=("pool",),
    sub_counters=("available",),
    builtins=(BuiltinBuild("token", "token", "kvreplay.families.sglang.token:TokenPool",
                           "token pool (page_size 1), as sglang 0.5.23"),),
    detect=lambda pool: callable(getattr(pool, "alloc", None)) and hasattr(pool, "size"),
    ctor_of=_token_ctor,
    sizes_of=_one_pool,
    construct=_BUILD,
    specificity=0,
    base_classes=("kvreplay.families.sglang.token:TokenPool",),
    release_classes=_TOKEN_CLASSES,
)

PAGED = _sglang_family(
    name="paged",
    summary="sglang's paged allocator",
    ctor_args=("size", "page_size", "dtype", "device", "kvcache", "need_sort"),
    sizes=("size", "page_size"),
    units=("page_size",),
    sub_pools=("pool",),
    sub_counters=("available",),
    builtins=(BuiltinBuild("paged", "paged", "kvreplay.families.sglang.paged:PagedPool",
                           "paged pool, as sglang 0.5.23"),),
    detect=lambda pool: getattr(pool, "page_size", 1) > 1 or hasattr(pool, "num_pages"),
    ctor_of=_paged_ctor,
    sizes_of=_one_pool,
    construct=_BUILD,
    specificity=1,
    base_classes=("kvreplay.families.sglang.paged:PagedPool",),
    class_words=("paged",),
    release_classes=_PAGED_CLASSES,
    scenarios=(
        Scenario("decode", "paged", "continuous batching on a paged pool: batched prefill, alloc_decode, retraction",
                 server=_SCENARIOS + "decode", ctor=_SCENARIOS + "pool_ctor", check=_SCENARIOS + "check"),
    ),
)

SWA = _sglang_family(
    name="swa",
    summary="sglang's SWA allocator: a full and a sliding-window pool with a mapping between them",
    ctor_args=("size", "size_swa", "page_size", "dtype", "device", "kvcache", "need_sort"),
    sizes=("size", "page_size", "size_swa"),
    units=("page_size",),
    sub_pools=("full", "swa"),
    sub_counters=("full_available", "swa_available"),
    sub_allocators=(("full", "full_attn_allocator"), ("swa", "swa_attn_allocator")),
    builtins=(
        BuiltinBuild("swa", "swa", "kvreplay.families.sglang.swa:SWAPool",
                     "full + SWA pool, as sglang 0.5.23 with #38519 and the alloc_decode None leak fixed"),
        BuiltinBuild("swa@stale-tail", "swa", _V + "StaleTailSWAPool",
                     "sglang 0.5.12: no #25805, no #27779 (seed double-free bug)"),
        BuiltinBuild("swa@page-partial-clear", "swa", _V + "PagePartialClearSWAPool",
                     "sglang 0.5.12.post1: #25805 in, #27779 not (released page keeps a mapping)"),
        BuiltinBuild("swa@unfiltered-page0", "swa", _V + "UnfilteredPage0SWAPool",
                     "#38519: free_swa_segment frees SWA page 0 for unmapped pages"),
        BuiltinBuild("swa@deferred-lookup", "swa", _V + "DeferredLookupSWAPool",
                     "#36081: grouped free_swa reads the mapping at free_group_end"),
    ),
    detect=lambda pool: hasattr(pool, "full_to_swa_index_mapping"),
    ctor_of=_swa_ctor,
    sizes_of=lambda ctor: {"full": int(ctor["size"]), "swa": int(ctor["size_swa"])},
    construct=_BUILD + "_swa",
    checks="kvreplay.families.sglang.swa_checks:mapping_checks",
    invariants=(("swa-mapping", "5 SWA mapping: injective over live full slots, peers live, released pages "
                                "unmapped, sentinel -1"),),
    rules="""
swa-mapping/released-page-keeps-peer | corrupts | a released full page (or one whose SWA peer was freed) still maps
swa-mapping/tail-prealloc-nontail-mapped | corrupts | after alloc_extend_swa_tail, a non-tail slot maps to an SWA slot
swa-mapping/shared-swa-slot | corrupts | two live full slots map to one SWA slot
swa-mapping/peer-not-live | corrupts | a live full slot maps to an SWA slot that is free
swa-mapping/allocated-without-peer | corrupts | an allocated full slot has no SWA peer
swa-mapping/orphan-swa-slot | leaks | a live SWA slot is mapped from no live full slot
swa-mapping/sentinel-changed | corrupts | the mapping's trailing -1 was overwritten
quiescence/orphan-swa-slot | leaks | at the end, a live SWA slot is mapped from nothing
""",
    specificity=2,
    base_classes=("kvreplay.families.sglang.swa:SWAPool",),
    class_words=("swa",),
    release_classes=_SWA_CLASSES,
    scenarios=(
        Scenario("disagg-mtp", "swa", "disaggregated decode with MTP speculation on an SWA pool (need_sort on)",
                 server=_SCENARIOS + "disagg_mtp", ctor=_SCENARIOS + "pool_ctor_sorted", check=_SCENARIOS + "check"),
        Scenario("radix-swa", "swa", "prefix cache over an SWA pool: hits, leaf eviction, SWA tombstones "
                 "(--speculative: draft-and-verify steps of --k draft tokens, as sglang 0.5.23 serves them)",
                 server=_SCENARIOS + "radix_swa", ctor=_SCENARIOS + "pool_ctor", check=_SCENARIOS + "check",
                 options=frozenset({"speculative", "draft_accept"})),
    ),
)

FAMILIES = (TOKEN, PAGED, SWA)
