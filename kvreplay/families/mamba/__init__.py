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

from kvreplay.families.mamba.wire import METHODS, POOL_CLASS, VOID_METHODS
from kvreplay.family.record import BuiltinBuild, Family, Scenario


def _check_ctor(args: dict[str, Any]) -> None:
    if type(args.get("extra_buffer")) is not bool:
        raise ValueError(f"constructor argument extra_buffer must be true or false, not "
                         f"{str(args.get('extra_buffer'))[:40]!r}")
    if args.get("ping_pong") not in (1, 2) or type(args.get("ping_pong")) is not int:
        raise ValueError(f"constructor argument ping_pong must be 1 or 2, not {str(args.get('ping_pong'))[:40]!r}")


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
