"""The prefix cache above the pool: the tree family.

sglang's radix tree holds cached KV pages, locks the nodes a running request uses,
evicts under memory pressure and decides which slots a finished, aborted or retracted
request gives back. Its bookkeeping is what sglang's idle check ("pool memory leak
detected") audits, long after the call that broke it. A trace of this family records
the tree's calls in a wire form (requests by number, keys as page hashes, never token
ids; KV slots as runs, runs.py; nodes and lock handles by id) and the KV allocator's
calls inside them as nested rows of target ``kv``; its counter columns hold the free,
evictable and protected sizes after each call.

Its builds are kvreplay's tree (tree.py, re-implemented from sglang 0.5.23's
``RadixCache``) and its bug variants (variants.py); its replayer (replayer.py) and
checker (checker.py) hold every call to one owner per slot and to the books sglang's
idle check keeps, and name the call that first broke them."""

from __future__ import annotations

from typing import Any

from kvreplay.contract.record import BuiltinBuild, Family, Param, Scenario, Vocabulary
from kvreplay.limits import MAX_POOL_SLOTS, limit
from kvreplay.trace.bounds import Bound

# A tree's KV slots: the checker keeps an owner per slot in use and the tree a slot per
# cached token, as Python numbers; 2^24 is a few gigabytes at most and more than the
# largest pool a CPU replay serves (sglang's servers hold about 10^6).
MAX_TREE_SLOTS = limit("KVREPLAY_MAX_TREE_SLOTS", 1 << 24)
MAX_NUMBER = (1 << 48) - 1  # requests, nodes and lock handles are counted from 1
MAX_HASH = (1 << 63) - 1

METHODS = ("match_prefix", "lock", "unlock", "extend", "checkpoint", "free_kv_row", "release", "evict", "slide",
           "hold_state", "drop_state", "group_states", "ungroup_states", "touch",
           "alloc", "free", "available_size", "evictable_size", "protected_size")
VOID_METHODS = frozenset({"unlock", "extend", "free_kv_row", "release", "free", "slide",
                          "hold_state", "drop_state", "group_states", "ungroup_states", "touch"})
STATE_ARGS = ("state_size", "state_grid", "state_path_cap")  # a Mamba tree's (all or none)


def _check_ctor(args: dict[str, Any]) -> None:
    if args["size"] > MAX_TREE_SLOTS:
        raise ValueError(f"constructor argument size is {args['size']:,}, more than {MAX_TREE_SLOTS:,} "
                         "(KVREPLAY_MAX_TREE_SLOTS raises the limit)")
    if args["page_size"] > args["size"]:
        raise ValueError("constructor argument page_size is larger than the pool")
    for name in ("swa_size", "sliding_window"):  # a sliding-window tree's (both or neither)
        v = args.get(name, 0)
        if type(v) is not int or not 0 <= v <= MAX_TREE_SLOTS:
            raise ValueError(f"constructor argument {name} is not a whole number from 0 to {MAX_TREE_SLOTS:,}")
    if bool(args.get("swa_size")) != bool(args.get("sliding_window")):
        raise ValueError("constructor arguments swa_size and sliding_window come together")
    given = [name for name in STATE_ARGS if name in args]
    if given:
        if len(given) != len(STATE_ARGS):
            raise ValueError(f"constructor arguments {', '.join(STATE_ARGS)} come together")
        for name in ("state_size", "state_grid"):
            v = args[name]
            if type(v) is not int or not 1 <= v <= MAX_TREE_SLOTS:
                raise ValueError(f"constructor argument {name} is not a whole number from 1 to {MAX_TREE_SLOTS:,}")
        v = args["state_path_cap"]
        if type(v) is not int or not -1 <= v <= MAX_TREE_SLOTS:
            raise ValueError(f"constructor argument state_path_cap is not a whole number from -1 to {MAX_TREE_SLOTS:,}")
        if args.get("swa_size"):
            raise ValueError("a tree has a sliding window or Mamba states, not both (the wire records neither pair)")


def _value_bounds(ctor: dict[str, Any]) -> dict[str, Bound]:
    size = int(ctor["size"])
    largest = max(size, int(ctor.get("swa_size") or 0), int(ctor.get("state_size") or 0))
    number = Bound(0, MAX_NUMBER, what="a request, node or lock number")
    tokens = Bound(0, MAX_POOL_SLOTS, what="a token count")
    return {
        "request": number, "node": number, "handle": number,
        "pages": Bound(0, MAX_HASH, longest=MAX_POOL_SLOTS, what="a page hash"),
        # (start, length) pairs of slots: each in the pool; their total is checked per call
        "runs": Bound(0, largest, longest=2 * largest, what="a slot run"),
        "length": tokens, "up_to": tokens, "outputs": tokens, "start": tokens, "end": tokens,
        "need_size": Bound(0, largest, what="slots to allocate"),
        "num_tokens": Bound(0, MAX_POOL_SLOTS, what="tokens to evict"),
        "swa_num_tokens": Bound(0, MAX_POOL_SLOTS, what="window tokens to evict"),
        "state_num": Bound(0, MAX_POOL_SLOTS, what="state slots to evict"),
        "cow": Bound(0, 1, what="a copy-on-write flag"),
        "pre_len": tokens, "interval": tokens,
    }


_AT = "kvreplay.families.tree."

TREE = Family(
    name="tree",
    summary="sglang's prefix cache (radix tree) over its KV slots: matches, locks, caching, eviction, release",
    engine="sglang",
    ctor_args=("size", "page_size", "device"),
    sizes=("size", "page_size"),
    units=("size", "page_size"),
    methods=METHODS,
    # the counter columns: free slots, then the tree's evictable and protected sizes
    sub_pools=("kv", "evictable", "protected"),
    sub_counters=("available", "full_available", "swa_available"),
    counter_reads=("available_size", "evictable_size", "protected_size"),
    # the KV allocator (a sliding-window tree's full side), a sliding-window tree's window side
    # and a Mamba tree's state slots
    sub_allocators=(("kv", "kv"), ("swa", "swa"), ("state", "state")),
    unit="slots",
    builtins=(
        BuiltinBuild("tree", "tree", _AT + "tree:PrefixTree",
                     "radix tree of KV pages over a token allocator, as sglang 0.5.23's RadixCache"),
        BuiltinBuild("tree@forgets-row", "tree", _AT + "variants:ForgetsRow",
                     "a finished request's row free returns early for one request in ten: its slots are lost"),
        BuiltinBuild("tree@keeps-old-lock", "tree", _AT + "variants:KeepsOldLock",
                     "a checkpoint locks the new last node but never unlocks the old one"),
        BuiltinBuild("tree@evicts-locked", "tree", _AT + "variants:EvictsLocked",
                     "eviction ignores lock counts and frees a leaf a running request uses"),
        BuiltinBuild("tree@frees-cached-prefix", "tree", _AT + "variants:FreesCachedPrefix",
                     "a checkpoint frees the row's cached prefix with its duplicates: slots counted twice"),
        BuiltinBuild("tree@unlock-leaves-size", "tree", _AT + "variants:UnlockLeavesSize",
                     "a node's last unlock leaves its size in the protected count"),
    ),
    replayer=_AT + "replayer:TreeReplayer",
    checker=_AT + "checker:TreeChecker",
    vocabulary=Vocabulary(allocs=frozenset({"alloc"}), frees=frozenset({"free", "free_kv_row"}),
                          reads=frozenset({"available_size", "evictable_size", "protected_size"})),
    profile=_AT + "profile:see",
    detect=lambda pool: getattr(pool, "prefix_tree", False),
    ctor_of=lambda pool: dict(pool.ctor_args),
    sizes_of=lambda ctor: {"kv": int(ctor["size"]), "evictable": int(ctor["size"]), "protected": int(ctor["size"])},
    held_counters=frozenset({"evictable", "protected"}),
    construct=_AT + "tree:construct",
    specificity=30,
    base_classes=(_AT + "tree:PrefixTree",),
    class_words=("radixcache",),  # sglang's trees: RadixCache, UnifiedRadixCache
    # the wire's own era (0.5.22 and later), then the tree the releases before it had
    release_classes=("sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache",
                     "sglang.srt.mem_cache.radix_cache:RadixCache"),
    recorded_by_default=False,  # a row per request and decode step: recorded when named (--class)
    wire=_AT + "live:wire_for",
    slots=False,
    snapshots=False,
    check_ctor=_check_ctor,
    value_bounds=_value_bounds,
    void_methods=VOID_METHODS,
    invariants=(
        ("tree-owner", "10 tree ownership: a KV slot has one owner (free, the tree, a running request), and an "
                       "owner lets go of a slot only by freeing it or handing it over"),
        ("tree-lock", "11 tree locks: a node's lock count is the locks held on it and below it, never below zero, "
                      "released by the holder that took it"),
        ("tree-size", "12 tree sizes: the evictable and protected sizes are what the unlocked and locked nodes hold"),
        ("tree-books", "13 tree books: free + evictable + protected + what requests hold = the pool, after every "
                       "call"),
    ),
    rules="""
tree-owner/handout-while-owned | corrupts | the allocator handed out a KV slot a request or the tree holds
tree-owner/double-free | corrupts | a KV slot was freed while free
tree-owner/freed-cached | corrupts | a call that does not evict freed a KV slot the tree holds
tree-owner/freed-while-locked | corrupts | eviction freed a slot of a node a running request has locked
tree-owner/shared | corrupts | a request's row took a slot that is free or another owner holds
tree-owner/prefix-not-cached | corrupts | a match or checkpoint gave a request slots the tree does not hold
tree-owner/row-leak | leaks | a request's slots were let go of without being freed or given to the tree
tree-lock/unheld | corrupts | a lock was released that no one holds, or by a request that did not take it
tree-lock/negative | corrupts | a node's lock count went below zero
tree-lock/lost | corrupts | a node is locked fewer times than the locks held on it and below it
tree-lock/orphan | leaks | a node is locked more times than the locks held on it and below it: it can never be evicted
tree-lock/held-at-release | leaks | a request gave its row back still holding a lock
tree-size/evictable | misreports | the evictable size differs from what the unlocked nodes hold
tree-size/protected | misreports | the protected size differs from what the locked nodes hold
tree-books/lost | leaks | free + evictable + protected + what requests hold fell below the pool here: slots lost
tree-books/counted-twice | corrupts | free + evictable + protected + what requests hold rose above the pool here
quiescence/tree-idle | leaks | at idle, free + evictable + protected is not the pool (sglang's "memory leak detected")
""",
    scenarios=(
        Scenario("prefix-tree", "tree",
                 "sglang's scheduler over its prefix cache: prefix hits, chunked prefill, eviction under memory "
                 "pressure, retraction, aborts, release as release_kv_cache",
                 server=_AT + "scenarios:server", ctor=_AT + "scenarios:pool_ctor", check=_AT + "scenarios:check",
                 params=(Param("chunk", 256, "the prefill chunk, in tokens (sglang's --chunked-prefill-size)", 1,
                               1 << 20),
                         Param("abort_share", 0.05, "the share of requests aborted while they decode", 0.0, 1.0),
                         Param("score_share", 0.0, "the share of requests that ask for no output token "
                               "(max_new_tokens=0: scoring a prompt)", 0.0, 1.0))),
    ),
)

FAMILIES = (TREE,)
