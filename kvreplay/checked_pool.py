"""A pool driven by hand under kvreplay's invariant checker: what the reproducers
``kvreplay minimize --emit-test`` writes are built on, and usable in any pool test.

    pool = CheckedPool("builtin:swa", family="swa", ctor={...}, invariant="swa-mapping")
    r0 = pool.alloc_extend(...)
    pool.free(r0[:4])          # AssertionError here if this free breaks the invariant
    pool.finish()              # the end-of-trace checks

Every call goes to the real pool and through the same checker a replay uses, with
the O(pool) checks after every call, so an assertion points at the line that made
the bad state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.builds.resolve import load_build
from kvreplay.check.checked_call import checked_call, method_of
from kvreplay.check.checker import InvariantChecker
from kvreplay.check.pool_view import view_of
from kvreplay.check.rules import describe_violation
from kvreplay.pool_api import COUNTER_METHODS


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


class CheckedPool(Checked):
    def __init__(self, build: str, *, family: str, ctor: dict[str, Any], device: str = "cpu",
                 invariant: str | None = None) -> None:
        super().__init__(build, load_build(build, family, ctor, device), invariant)
        self.view = view_of(self.pool, family)
        self.checker = InvariantChecker(self.view, full_check_every=1, keep=1 << 30)

    def call(self, method: str, **args: Any) -> Any:
        """Make one call on the pool (keyword arguments, as a trace records them) and check it."""
        self.calls += 1
        fn, _ = method_of(self.pool, method)
        if fn is None:
            raise AttributeError(f"{self.build} has no method {method} and no translation applies")
        if method in COUNTER_METHODS:
            return fn(**args)
        result, raised, _ = checked_call(self.view, self.checker, self.calls, method, args, fn)
        self._assert_clean()
        if raised is not None:  # checked first, then re-raised: the state it left may be the finding
            raise raised
        return result


__all__ = ["CheckedPool"]
