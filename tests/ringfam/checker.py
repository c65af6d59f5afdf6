"""The ring's one invariant: a ticket has one holder. The checker keeps who holds what
from the calls themselves (the ring's own queue is the build's business)."""

from __future__ import annotations

from typing import Any

from kvreplay.check.rules import RULES, Violation, ViolationLog


class RingChecker:
    def __init__(self, pool: Any, *, full_check_every: int = 1000, keep: int = 20) -> None:
        self.log = ViolationLog(keep=keep)
        self.held: set[int] = set()

    def _flag(self, call: int, method: str, rule_id: str, tickets: list[int], message: str) -> None:
        rule = RULES[rule_id]
        self.log.add(Violation(call, method, rule.invariant, rule.rule, "ring", sorted(tickets)[:64], message, call))

    def after(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        if method == "take" and isinstance(result, tuple):
            twice = sorted({t for t in result if t in self.held} | {t for t in result if result.count(t) > 1})
            if twice:
                self._flag(call, method, "ring-owner/handed-twice", twice,
                           f"ticket(s) {twice[:8]} handed out while held")
            self.held.update(result)
        elif method == "give":
            tickets = tuple(args.get("tickets") or ())
            free = [t for t in tickets if t not in self.held]
            if free:
                self._flag(call, method, "ring-owner/given-free", free, f"ticket(s) {free[:8]} given back while free")
            self.held.difference_update(tickets)

    def finish(self, call: int) -> dict[str, int]:
        return {"ring": len(self.held)}
