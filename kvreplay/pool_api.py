"""The allocator vocabulary: the one place that knows the KV-pool APIs kvreplay speaks,
sglang's allocators and vLLM's KV-cache manager.

Which methods exist, what kind of call each is, and which arguments carry slot
indices. The recorder, the replayer, the checker, the minimizer and the trace summary
all read this table; when sglang adds a method, this file changes and nothing else
has to. What a pool family is (its constructor, its sub-pools, its builds) is its
record's (families/).

Nothing here imports torch: the trace writer's process reads it too."""

from __future__ import annotations

# -- methods and their kinds ---------------------------------------------------------
ALLOCS = frozenset({"alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail"})
# Frees of the full side (and, on SWA pools, their SWA peers too).
FULL_AND_SWA_FREES = frozenset({"free", "free_segment", "free_segments", "free_page_ids"})
FULL_ONLY_FREES = frozenset({"free_full", "free_full_segment", "free_full_segments"})
SWA_ONLY_FREES = frozenset({"free_swa", "free_swa_segment"})
FREES = FULL_AND_SWA_FREES | FULL_ONLY_FREES | SWA_ONLY_FREES
GROUP_METHODS = frozenset({"free_group_begin", "free_group_end"})
MAPPING_METHODS = frozenset({"set_full_to_swa_mapping", "clear_full_to_swa_mapping"})
OTHER_METHODS = frozenset({"merge_and_sort_free", "clear"})
COUNTER_METHODS = frozenset({"available_size", "full_available_size", "swa_available_size"})

# Every method a recorder wraps and a replay may call, in a stable order (the
# recorder's name ids follow it). A trace naming anything else is not a trace of
# this API.
RECORDED_METHODS: tuple[str, ...] = (
    "alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail",
    "free", "free_page_ids", "free_segment", "free_segments", "free_full",
    "free_full_segment", "free_full_segments", "free_swa", "free_swa_segment",
    "free_group_begin", "free_group_end", "merge_and_sort_free", "clear",
    "set_full_to_swa_mapping", "clear_full_to_swa_mapping",
    "available_size", "full_available_size", "swa_available_size",
)
assert frozenset(RECORDED_METHODS) == ALLOCS | FREES | GROUP_METHODS | MAPPING_METHODS | OTHER_METHODS | COUNTER_METHODS

# -- vLLM's KV-cache manager: the "vllm" family ------------------------------------------
# vLLM's scheduler calls its KVCacheManager with Request objects and gets blocks back;
# kvreplay records those calls in a wire form (families/vllm/wire.py): a request as its id, the
# counts the manager reads of it and the block hashes it has not sent before; blocks by
# id. The BlockPool calls the manager makes are nested rows with target "blocks".
# ``free_request`` is the manager's ``free(request)``: the name keeps it apart from
# sglang's ``free(free_index)``.
VLLM_MANAGER_METHODS: tuple[str, ...] = (
    "get_computed_blocks", "allocate_slots", "free_request", "pop_blocks_for_free", "cache_blocks",
    "remove_skipped_blocks", "evict_blocks", "reset_prefix_cache", "new_step_starts",
)
# The BlockPool calls that change its state (allocation, release, reference counts).
VLLM_BLOCK_METHODS: tuple[str, ...] = ("get_new_blocks", "free_blocks", "touch")
VLLM_METHODS: tuple[str, ...] = (*VLLM_MANAGER_METHODS, *VLLM_BLOCK_METHODS, "available_size")
# What a manager's own method is called where the wire renames it.
VLLM_MANAGER_NAMES = {"free_request": "free"}

# vLLM calls that return nothing: a None from them is not a refusal for room.
VLLM_VOID_METHODS = frozenset({"free_request", "cache_blocks", "remove_skipped_blocks", "evict_blocks",
                               "new_step_starts", "free_blocks", "touch"})

# vLLM calls that hand out and free nothing when the build needs no work at their point
# (full attention has no window to slide, no state-space blocks to step): minimize tries
# a trace without all of them at once before it tries calls one by one.
VLLM_HOUSEKEEPING = frozenset({"new_step_starts", "remove_skipped_blocks"})

# Calls whose result is always None: a None from them is not an out-of-memory answer.
VOID_METHODS = FREES | GROUP_METHODS | MAPPING_METHODS | OTHER_METHODS | VLLM_VOID_METHODS


def method_kind(method: str) -> str:
    """alloc | free | free-group | read, or the method itself (mapping, clear, ...)."""
    if method in ALLOCS:
        return "alloc"
    if method in FREES:
        return "free"
    if method in GROUP_METHODS:
        return "free-group"
    if method in COUNTER_METHODS:
        return "read"
    return method


# Counter columns of a trace, and the reads that fill them, in the same order.
COUNTERS = ("available", "full_available", "swa_available")
COUNTER_READS = ("available_size", "full_available_size", "swa_available_size")

# -- arguments that hold slot indices ------------------------------------------------------
FULL_TOKEN_ARGS = ("free_index", "last_loc", "full_indices", "indices")
SWA_TOKEN_ARGS = ("swa_indices",)

# The attention a vLLM manager is replayed with: one name per KV-cache group, in the
# manager's order, joined by commas: ``full``, or ``sliding_window:W`` for a window of W
# tokens (``full,sliding_window:128``: a hybrid model's two groups).
def vllm_groups(attention: str) -> tuple[int, ...] | None:
    """The KV-cache groups a vLLM trace's ``attention`` names, each as its sliding window
    in tokens (0: full attention); None when one is a kind no build constructs (Mamba,
    chunked-local, ...: recorded by its spec's name)."""
    groups = []
    for name in attention.split(","):
        kind, _, width = name.partition(":")
        if name == "full":
            groups.append(0)
        elif kind == "sliding_window" and width.isdigit() and 0 < int(width) < 1 << 31:
            groups.append(int(width))
        else:
            return None
    return tuple(groups) if len(groups) <= 16 else None
