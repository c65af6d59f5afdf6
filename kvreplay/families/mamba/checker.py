"""Invariants of a state-slot pool (the mamba family), checked at the call that breaks them.

A state slot is owned once: by a request (its state, or one of its tracking pair), by
the prefix cache (a pair's entry kept or donated when a request ended, a prefix hit's
copy not yet handed to a request), or by a batch ``alloc_group_begin`` reserved. The
checker keeps its own owner per slot from the calls the allocator made (the wire's
nested rows) and the requests' fields the pool wrote, and flags at the call:
a slot handed out while owned, a slot freed while free, a request left naming a slot
that is free, two requests naming one slot. Every ``full_check_every`` calls and at the
end it checks the free list itself and that live and free slots add up to the pool."""

from __future__ import annotations

from typing import Any

from kvreplay.check.growth import RULE as GROWTH_RULE
from kvreplay.check.growth import GrowthWatch
from kvreplay.check.rules import RULES, Violation, ViolationLog

CACHE, GROUP, PENDING = "cache", "group", "pending"  # owners that are not a request


class StatePoolChecker:
    def __init__(self, wire: Any, *, full_check_every: int = 1000, keep: int = 20) -> None:
        self.wire = wire
        self.size = wire.size()
        self.full_check_every = full_check_every
        self.log = ViolationLog(keep=keep)
        self.owner: dict[int, str] = {}  # live slot -> who holds it (a request's number as text, or the above)
        self.named: dict[int, dict[int, str]] = {}  # request -> its slots as last seen, {slot: "state"|"track"}
        self.calls = 0
        # Without the extra buffer the prefix cache keeps a finished request's own state
        # slot in place (the request gives its row back still naming the slot it handed
        # over), and copies a running request's state into slots it takes itself: the
        # server's top-level allocations are the cache's until a request names one.
        self.no_buffer = not bool(wire.ctor_args.get("extra_buffer"))
        self.growth = GrowthWatch(wire, int(wire.ctor_args["size"]) + self.size)

    def _flag(self, call: int, method: str, rule_id: str, slots: list[int], message: str) -> None:
        rule = RULES[rule_id]
        self.log.add(Violation(call, method, rule.invariant, rule.rule, "state", sorted(slots)[:64], message, call))

    # -- per call -------------------------------------------------------------------------------
    def after(self, call: int, method: str, args: dict[str, Any], result: Any,
              nested: list[tuple[str, Any]], requests: tuple[int, ...]) -> None:
        """Check call ``call``: ``nested`` its allocator calls in order, ``requests`` the
        requests it named."""
        self.calls += 1
        owner = self.owner
        for m, ids in nested:
            if m == "alloc" and ids:
                held = [s for s in ids if s in owner and owner[s] != GROUP]
                if held:
                    self._flag(call, method, "state-pool/handout-while-held", held,
                               f"the allocator handed out state slot(s) {held[:8]} held by "
                               f"{', '.join(sorted({self._who(owner[s]) for s in held}))}")
                for s in ids:
                    owner[s] = CACHE if self.no_buffer and method == "alloc" else PENDING
            elif m == "free" and ids:
                free = [s for s in ids if s not in owner]
                if free:
                    self._flag(call, method, "state-pool/double-free", free,
                               f"state slot(s) {free[:8]} freed while free")
                for s in ids:
                    owner.pop(s, None)
            elif m == "alloc_group_begin":
                for s in self.wire.wire_state.reserved:
                    owner[s] = GROUP
        if method == "donate_track" and type(result) is int and result in owner:
            owner[result] = CACHE
        for n in requests:
            self._request(call, method, n)
        if self.full_check_every and self.calls % self.full_check_every == 0:
            self.full_check(call, method)

    @staticmethod
    def _who(tag: str) -> str:
        return f"request {tag}" if tag.isdigit() else {CACHE: "the prefix cache", GROUP: "a group",
                                                        PENDING: "no request yet"}[tag]

    def _request(self, call: int, method: str, n: int) -> None:
        """Hold the request's slots after the call to what the allocator did."""
        req = self.wire.requests.get(n)
        if req is None:
            return
        row, state, track = req.slots()
        now = {s: "track" for s in track}
        if state is not None:
            now[state] = "state"
        before = self.named.get(n, {})
        tag = str(n)
        for s in before:  # let go of: freed (gone from owner), kept for the cache, or moved on
            if s not in now and self.owner.get(s) == tag:
                self.owner[s] = CACHE
        if method == "free_req" and self.no_buffer and req.req_pool_idx is None:
            for s in now:
                if self.owner.get(s) == tag:
                    self.owner[s] = CACHE
            now = {}
        # a request between lives (ended, retracted) may still name slots it gave back; the
        # pool must not give them to it again when it is allocated anew
        free = [s for s in now if s not in self.owner] if method == "alloc_reqs" else []
        if free:
            self._flag(call, method, "state-pool/request-holds-free-slot", free,
                       f"request {n} was allocated with state slot(s) {free[:8]} that are free")
        shared = [s for s in now if self.owner.get(s, tag) not in (tag, PENDING, GROUP, CACHE)]
        if shared:
            self._flag(call, method, "state-pool/slot-shared", shared,
                       f"request {n} names state slot(s) {shared[:8]} that request "
                       f"{self.owner[shared[0]]} holds")
        for s in now:
            if s in self.owner:
                self.owner[s] = tag
        if now:
            self.named[n] = now
        else:
            self.named.pop(n, None)

    # -- the whole pool ------------------------------------------------------------------------
    def full_check(self, call: int, method: str) -> None:
        free = self.wire.free_slots()
        seen: set[int] = set()
        bad = sorted({s for s in free if s in seen or seen.add(s) or not 1 <= s <= self.size})  # type: ignore[func-returns-value]
        if bad:
            self._flag(call, method, "state-pool/free-list", bad,
                       f"the free list holds slot(s) {bad[:8]} twice, slot 0 or out of range")
        live_free = sorted(set(free) & set(self.owner))
        if live_free:
            self._flag(call, method, "state-pool/free-list", live_free,
                       f"held state slot(s) {live_free[:8]} are on the free list")
        lost = self.size - len(seen) - len(self.owner)
        if lost and not bad and not live_free:
            gone = sorted(set(range(1, self.size + 1)) - seen - set(self.owner))
            self._flag(call, method, "state-pool/conservation", gone,
                       f"{lost} state slot(s) are neither free nor held (held {len(self.owner)}, free {len(seen)}, "
                       f"size {self.size})")
        for path, size in self.growth.sample():
            self._flag(call, method, GROWTH_RULE, [size], self.growth.message(path, size))

    def finish(self, call: int) -> dict[str, int]:
        self.full_check(call, "end")
        orphans = sorted(s for s, o in self.owner.items() if o in (PENDING, GROUP))
        if orphans:
            self._flag(call, "end", "quiescence/orphan-state-slot", orphans,
                       f"{len(orphans)} state slot(s) were handed out and never given to a request, kept or freed")
        ended = sorted(s for n, slots in self.named.items()
                       if self.wire.requests[n].req_pool_idx is None for s in slots if self.owner.get(s) == str(n))
        if ended:
            self._flag(call, "end", "quiescence/ended-request-state", ended,
                       f"{len(ended)} state slot(s) are still held by requests that gave up their row")
        leaked = len(orphans) + len(ended)
        return {"state": leaked} if leaked else {}
