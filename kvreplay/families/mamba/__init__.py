"""sglang's state pool of state-space and hybrid linear-attention models: the mamba family.

A hybrid model's request holds, beside its KV cache, a recurrent state in a slot of a
pool of its own, and with the extra buffer a ping-pong pair of tracking slots whose
states the prefix cache may keep. sglang's ``HybridReqToTokenPool`` hands out both;
its calls are recorded in a wire form (wire.py: requests by number, slots by id), the
state-slot allocator's calls as nested rows of target ``state``. The family has its own
replayer (replayer.py) and checker (checker.py); its builds are kvreplay's pool
(pool.py), its bug variants (variants.py) and every sglang release with the pool
(``sglang==X``, from 0.5.2)."""

from __future__ import annotations

from typing import Any

from kvreplay.contract.record import BuiltinBuild, Family, Scenario, Vocabulary
from kvreplay.families.mamba.wire import METHODS, NONE, POOL_CLASS, VOID_METHODS
from kvreplay.limits import MAX_POOL_SLOTS, limit
from kvreplay.trace.bounds import Bound

# A pool's request rows and state slots: each row is a Python int on the free list and a
# row of the tracking table, each slot a state in every layer (a release's pool), and a
# replay reads the whole free list at every allocation group, so 2^27 of either is
# gigabytes and 2^17 replays in seconds; a server keeps a few thousand (a state is
# megabytes on a GPU).
MAX_REQUEST_ROWS = limit("KVREPLAY_MAX_REQUEST_ROWS", 1 << 17)
MAX_STATE_SLOTS = limit("KVREPLAY_MAX_STATE_SLOTS", 1 << 17)
# A request's number: the wire counts requests from 1 as the server sends them, so 2^48
# is decades of a busy server's traffic; a larger one is damage, not a request.
MAX_REQUEST_NUMBER = (1 << 48) - 1
PAIR = 2  # the most tracking slots a request holds (ping_pong is 1 or 2)


def _check_ctor(args: dict[str, Any]) -> None:
    for name, most, env in (("size", MAX_REQUEST_ROWS, "KVREPLAY_MAX_REQUEST_ROWS"),
                            ("mamba_size", MAX_STATE_SLOTS, "KVREPLAY_MAX_STATE_SLOTS")):
        if args[name] > most:
            raise ValueError(f"constructor argument {name} is {args[name]:,}, more than {most:,} ({env} raises "
                             "the limit)")
    if type(args.get("extra_buffer")) is not bool:
        raise ValueError(f"constructor argument extra_buffer must be true or false, not "
                         f"{str(args.get('extra_buffer'))[:40]!r}")
    if args.get("ping_pong") not in (1, 2) or type(args.get("ping_pong")) is not int:
        raise ValueError(f"constructor argument ping_pong must be 1 or 2, not {str(args.get('ping_pong'))[:40]!r}")


def _value_bounds(ctor: dict[str, Any]) -> dict[str, Bound]:
    """What the wire's arguments may hold on a pool of these sizes (wire.py): requests by
    number, rows and state slots by id (NONE: none), counts no larger than the pool."""
    rows, slots = int(ctor["size"]), int(ctor["mamba_size"])
    request = Bound(0, MAX_REQUEST_NUMBER, what="a request number")
    # a batch names no more requests than the pool has rows and state slots together (a
    # scheduler's group may name more requests than there are rows: 15 on 8 in a live trace)
    batch = rows + slots
    return {
        "requests": request._replace(longest=batch),
        "request": request,
        "state": Bound(NONE, slots, what="a state slot"),
        "slot": Bound(0, slots, what="a state slot"),
        "track": Bound(NONE, slots, longest=PAIR, what="a state slot"),
        "free_index": Bound(0, slots, longest=slots, what="a state slot"),
        # (an entry past the pool's own pair is its assertion to make, as the server's was)
        "last": Bound(0, PAIR - 1, what="an entry of the tracking pair"),
        "keep": Bound(0, PAIR - 1, what="an entry of the tracking pair"),
        "need_size": Bound(0, slots, what="state slots to allocate"),
        "num_reqs": Bound(0, batch, what="requests in a group"),
        "kv_len": Bound(0, MAX_POOL_SLOTS, what="a request's KV length"),
    }


_SCENARIOS = "kvreplay.families.mamba.scenarios:"

MAMBA = Family(
    name="mamba",
    summary="sglang's hybrid request pool: request rows and the state slots of a state-space model",
    engine="sglang",
    # rows, state slots, the tracking pair (on, and its size), the longest context
    ctor_args=("size", "mamba_size", "extra_buffer", "ping_pong", "max_context_len"),
    sizes=("size", "mamba_size", "max_context_len"),
    units=("size", "mamba_size"),
    methods=METHODS,
    sub_pools=("state",),
    sub_counters=("available",),
    sub_allocators=(("state", "wire_state"),),
    unit="slots",
    builtins=(
        BuiltinBuild("mamba", "mamba", "kvreplay.families.mamba.pool:HybridStatePool",
                     "hybrid request pool with its state slots and tracking pair, as sglang 0.5.23"),
        BuiltinBuild("mamba@stale-ping-pong", "mamba", "kvreplay.families.mamba.variants:StalePingPongPool",
                     "sglang 0.5.9-0.5.12.post1: free_mamba_cache leaves the freed tracking pair on the request"),
    ),
    replayer="kvreplay.families.mamba.replayer:StateReplayer",
    checker="kvreplay.families.mamba.checker:StatePoolChecker",
    vocabulary=Vocabulary(allocs=frozenset({"alloc"}), frees=frozenset({"free"}), reads=frozenset({"available_size"})),
    profile="kvreplay.families.mamba.profile:see",
    detect=lambda pool: hasattr(pool, "wire_state"),
    ctor_of=lambda pool: dict(pool.ctor_args),
    sizes_of=lambda ctor: {"state": int(ctor["mamba_size"])},
    construct="kvreplay.families.mamba.wire:construct",
    specificity=20,
    base_classes=("kvreplay.families.mamba.pool:HybridStatePool", "kvreplay.families.mamba.wire:StateWire"),
    class_words=("hybridreqtotoken",),
    release_classes=(POOL_CLASS,),
    wire="kvreplay.families.mamba.live:wire_for",
    slots=False,
    snapshots=False,
    check_ctor=_check_ctor,
    value_bounds=_value_bounds,
    void_methods=VOID_METHODS,
    invariants=(("state-pool", "8 state pool: a state slot has one owner (a request, the prefix cache, an "
                               "allocation group), is freed once, and live + free slots add up to the pool"),),
    rules="""
state-pool/handout-while-held | corrupts | the allocator handed out a state slot that is held
state-pool/double-free | corrupts | a state slot was freed while free
state-pool/request-holds-free-slot | corrupts | alloc gave a request a state or tracking slot that is free
state-pool/slot-shared | corrupts | a request names a state slot another request holds
state-pool/free-list | corrupts | the state free list holds a slot twice, slot 0, an out-of-range or a held slot
state-pool/conservation | leaks | some state slots are neither free nor held
quiescence/orphan-state-slot | leaks | at the end, a state slot handed out went to no request and was not freed
quiescence/ended-request-state | leaks | at the end, a request that gave up its row still holds state slots
""",
    scenarios=(
        Scenario("hybrid-mamba", "mamba",
                 "sglang's scheduler on a hybrid model's state pool: prefix hits copy cached states, chunked "
                 "prefill, tracking pairs, donation to the cache, aborts, retraction (--state-slots, --aborts)",
                 server=_SCENARIOS + "hybrid", ctor=_SCENARIOS + "pool_ctor", check=_SCENARIOS + "check",
                 options=frozenset({"state_slots", "aborts", "no_extra_buffer"})),
    ),
)

FAMILIES = (MAMBA,)
