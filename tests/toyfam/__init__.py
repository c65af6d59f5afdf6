"""A toy third pool family, kept in the tests alone: a stack of slots that promises
to hand out the lowest free slots first. It enters kvreplay as any family outside it
does: this package (its record, its pool, its one rule, its scenario) named in
KVREPLAY_FAMILIES, or registered at run time."""

from __future__ import annotations

from typing import Any

from kvreplay.contract.record import BuiltinBuild, Family, Scenario
from kvreplay.families.sglang.vocabulary import RECORDED_METHODS, VOCABULARY, VOID_METHODS

TOY = Family(
    name="toy",
    summary="a stack of token slots, lowest first (kvreplay's tests)",
    engine=None,
    ctor_args=("size", "device"),
    sizes=("size",),
    units=("size",),
    methods=RECORDED_METHODS,
    sub_pools=("pool",),
    sub_counters=("available",),
    unit="slots",
    builtins=(
        BuiltinBuild("toy", "toy", "toyfam.pool:StackPool", "toy stack pool: lowest free slots first"),
        BuiltinBuild("toy@highest-first", "toy", "toyfam.pool:HighestFirstPool",
                     "breaks the toy's promise: hands out the highest free slots"),
    ),
    replayer="kvreplay.families.sglang.replayer:Replayer",
    checker="kvreplay.families.sglang.checker:InvariantChecker",
    vocabulary=VOCABULARY,
    profile="kvreplay.families.sglang.profile:see",
    void_methods=VOID_METHODS,
    detect=lambda pool: getattr(pool, "toy_stack", False),
    ctor_of=lambda pool: {"size": int(pool.size), "device": str(pool.device)},
    sizes_of=lambda ctor: {"pool": int(ctor["size"])},
    construct="toyfam.pool:construct",
    specificity=50,
    base_classes=("toyfam.pool:StackPool",),
    release_classes=("toyfam.pool:StackPool",),  # what `kvreplay record` patches in a program
    checks="toyfam.checks:LowestFirst",
    invariants=(("toy-order", "8 toy order: a toy pool hands out the lowest free slots first"),),
    rules="toy-order/not-lowest-first | misreports | a handout skipped a lower free slot",
    scenarios=(
        Scenario("toy-churn", "toy", "requests take slots and give them back, out of order",
                 server="toyfam.scenario:server", ctor="toyfam.scenario:ctor"),
    ),
)

FAMILIES = (TOY,)


def ctor(size: int = 64) -> dict[str, Any]:
    return {"size": size, "device": "cpu"}
