"""sglang's allocator vocabulary, which its three families (token, paged, swa) speak:
their record's ``vocabulary`` (contract.record.Vocabulary) is drawn from here, and the
shared code asks the record, never this module.

Which methods exist, what kind of call each is, and which arguments carry slot
indices. The recorder, the replayer, the checker, the minimizer and the trace summary
all read this table; when sglang adds a method, this file changes and nothing else
has to. What a pool family is (its constructor, its sub-pools, its builds) is its
record's (families/).

Nothing here imports torch: the trace writer's process reads it too."""

from __future__ import annotations

from kvreplay.contract.record import Vocabulary
from kvreplay.trace import format

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

# Calls whose result is always None: a None from them is not an out-of-memory answer.
# (a family outside this vocabulary names its own: its record's ``void_methods``)
VOID_METHODS = FREES | GROUP_METHODS | MAPPING_METHODS | OTHER_METHODS


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


# Counter columns of a trace, and the reads that fill them (the trace schema's, for now)
COUNTERS, COUNTER_READS = format.COUNTERS, format.COUNTER_READS

# -- arguments that hold slot indices ------------------------------------------------------
FULL_TOKEN_ARGS = ("free_index", "last_loc", "full_indices", "indices")
SWA_TOKEN_ARGS = ("swa_indices",)

VOCABULARY = Vocabulary(allocs=ALLOCS, frees=FREES, groups=GROUP_METHODS, reads=COUNTER_METHODS,
                        slot_args=FULL_TOKEN_ARGS, other_slot_args=SWA_TOKEN_ARGS)
