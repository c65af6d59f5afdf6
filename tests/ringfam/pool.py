"""The ring of tickets: tickets 1..size wait in a queue; ``take`` hands out the oldest,
``give`` puts tickets at the back. A variant overrides one hook."""

from __future__ import annotations

from collections import deque
from typing import Any


class TicketRing:
    ticket_ring = True

    def __init__(self, size: int, device: Any = "cpu") -> None:
        self.size, self.device = size, device
        self.queue: deque[int] = deque(range(1, size + 1))

    def take(self, count: int) -> tuple[int, ...] | None:
        if count > len(self.queue):
            return None
        return tuple(self.queue.popleft() for _ in range(count))

    def give(self, tickets: tuple[int, ...]) -> None:
        for t in tickets:
            self._put_back(t)

    def left(self) -> int:
        return len(self.queue)

    def _put_back(self, ticket: int) -> None:
        self.queue.append(ticket)


class GivesTwice(TicketRing):
    """The bug: a ticket given back enters the queue twice."""

    def _put_back(self, ticket: int) -> None:
        self.queue.append(ticket)
        self.queue.append(ticket)


def construct(family: Any, cls: type, ctor: dict[str, Any], device: Any) -> Any:
    return cls(int(ctor["size"]), "cpu")
