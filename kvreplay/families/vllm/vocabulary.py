"""vLLM's KV-cache manager as the vllm family speaks it: the methods a recording names,
their kinds, and the KV-cache groups a trace's ``attention`` names."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

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


# The attention a vLLM manager is replayed with: one name per KV-cache group, in the
# manager's order, joined by commas: ``full``, ``sliding_window:W`` for a window of W
# tokens, or a state-space (Mamba) group by its cache mode: ``mamba`` (no prefix caching
# of states), ``mamba_all`` (a state per block) or ``mamba_align`` (states at block
# boundaries, interior ones let go), with ``:S`` where it keeps S speculative blocks for
# a drafter. ``full,sliding_window:128`` is a hybrid model's two attention groups,
# ``mamba_align,full`` a hybrid state-space model's.
MAMBA_MODES = {"mamba": "none", "mamba_all": "all", "mamba_align": "align"}


# A Mamba group where the checker lists windows: it keeps only the state after the last
# computed token, so a step starting at position p reads the block that holds p-1's state.
STATE_WINDOW = 0


class Group(NamedTuple):
    """One KV-cache group a trace names: ``kind`` is full, sliding_window or a
    MAMBA_MODES key; ``width`` a window's tokens, or a Mamba group's speculative blocks."""

    kind: str
    width: int = 0


def vllm_groups(attention: str) -> tuple[Group, ...] | None:
    """The KV-cache groups a vLLM trace's ``attention`` names; None when one is a kind no
    build constructs (chunked-local, ...: recorded by its spec's name)."""
    groups = []
    for name in attention.split(","):
        kind, colon, width = name.partition(":")
        sized = width.isdigit() and 0 < int(width) < 1 << 31
        if name == "full":
            groups.append(Group("full"))
        elif kind == "sliding_window" and sized:
            groups.append(Group(kind, int(width)))
        elif kind in MAMBA_MODES and (sized or not colon):
            groups.append(Group(kind, int(width) if colon else 0))
        else:
            return None
    return tuple(groups) if len(groups) <= 16 else None


ATTENTION_KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")  # a KV-cache group's kind, as recorded


def check_attention(att: Any) -> None:
    """A block manager's ``attention``: the KV-cache groups it had, comma-separated."""
    if type(att) is not str or not 0 < len(att) <= 200:
        # any KV-cache spec kinds a manager had (a hybrid model's several); the builds
        # say which they can construct (full attention, so far)
        raise ValueError(f"constructor argument attention must name the manager's attention kinds, not "
                         f"{str(att)[:40]!r}")
    for group in att.split(","):
        kind, colon, width = group.partition(":")
        sized = not colon or (width.isdigit() and 0 < int(width) < 1 << 31)
        ok = ATTENTION_KIND.match(kind) is not None and sized
        if not ok or (kind == "sliding_window" and not colon):
            raise ValueError(f"constructor argument attention: {group[:40]!r} is not a KV-cache group (full, "
                             "sliding_window:W with a window of W > 0 tokens, or a spec's name)")
