"""A pool family kept in the tests alone and shaped unlike sglang's allocators: a ring
of tickets handed out in turn, its calls naming tickets (ids of its own, not token
slots), its counter read named ``left``, its own replayer, checker, profile figures and
synth scenario. It enters kvreplay by this package alone (``KVREPLAY_FAMILIES=ringfam``)
and must go through every command: the family contract holds nothing sglang-shaped."""

from __future__ import annotations

from typing import Any

from kvreplay.contract.record import BuiltinBuild, Family, Param, Scenario, Vocabulary

METHODS = ("take", "give", "left")


def _ctor_of(pool: Any) -> dict[str, Any]:
    return {"size": int(pool.size), "device": str(pool.device)}


def _check_ctor(args: dict[str, Any]) -> None:
    if args.get("device") not in ("cpu", None):
        raise ValueError("constructor argument device must be cpu: a ring of tickets lives in host memory")


RING = Family(
    name="ring",
    summary="a ring of tickets handed out in turn (a test family unlike sglang's)",
    engine=None,
    ctor_args=("size", "device"),
    sizes=("size",),
    units=("size",),
    methods=METHODS,
    sub_pools=("ring",),
    sub_counters=("available",),
    counter_reads=("left",),
    unit="slots",
    builtins=(
        BuiltinBuild("ring", "ring", "ringfam.pool:TicketRing", "tickets handed out in turn, each given back once"),
        BuiltinBuild("ring@give-twice", "ring", "ringfam.pool:GivesTwice",
                     "puts a given ticket back in the ring twice: later it is handed to two holders"),
    ),
    replayer="ringfam.replayer:RingReplayer",
    checker="ringfam.checker:RingChecker",
    vocabulary=Vocabulary(allocs=frozenset({"take"}), frees=frozenset({"give"}), reads=frozenset({"left"})),
    profile="ringfam.profile:see",
    detect=lambda pool: getattr(pool, "ticket_ring", False),
    ctor_of=_ctor_of,
    sizes_of=lambda ctor: {"ring": int(ctor["size"])},
    construct="ringfam.pool:construct",
    specificity=40,
    base_classes=("ringfam.pool:TicketRing",),
    release_classes=("ringfam.pool:TicketRing",),  # what `kvreplay record` patches in a program
    slots=False,
    snapshots=False,
    check_ctor=_check_ctor,
    void_methods=frozenset({"give"}),
    invariants=(("ring-owner", "9 ring owner: a ticket has one holder at a time"),),
    rules="""
ring-owner/handed-twice | corrupts | the ring handed out a ticket that is held
ring-owner/given-free | corrupts | a ticket was given back while no one held it
""",
    scenarios=(
        Scenario("ring-churn", "ring", "holders take a few tickets each and give them back in another order",
                 server="ringfam.scenario:server", ctor="ringfam.scenario:ctor",
                 params=(Param("give_chance", 0.6, "the chance a holder gives a batch back each step", 0.0, 1.0),)),
    ),
)

FAMILIES = [RING]
