"""What a pool driven by hand under a family's checker does, whatever the family: each
attribute is a call, checked as it is made; ``finish`` runs the end-of-trace checks, and
a violation of the invariant asked about raises an AssertionError at the line that made
it. Each family's checked pool (families/*/checked.py) adds how a call is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.check.rules import describe_violation


class Checked:
    """What both checked drivers share: a build, its checker, and a call per attribute."""

    checker: Any

    def __init__(self, build: str, pool: Any, invariant: str | None) -> None:
        self.build = build
        self.pool = pool
        self.invariant = invariant  # an invariant or one rule of it (invariant/rule); None: anything fails
        self.calls = 0
        self._reported = 0

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda **args: self.call(method, **args)

    def call(self, method: str, **args: Any) -> Any:  # pragma: no cover - each driver has its own
        raise NotImplementedError

    def finish(self) -> dict[str, int]:
        """The end-of-trace checks; returns what is still held per sub-pool."""
        held = self.checker.finish(self.calls)
        self._assert_clean()
        return held

    def _assert_clean(self) -> None:
        kept = self.checker.log.kept
        new, self._reported = kept[self._reported:], len(kept)
        for v in new:
            if self.invariant is None or self.invariant in (v.invariant, f"{v.invariant}/{v.rule}"):
                raise AssertionError(f"{self.build}: {describe_violation(v, long=True)}")
