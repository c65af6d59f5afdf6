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

from typing import Any

from kvreplay.builds.resolve import load_build
from kvreplay.check.driver import Checked
from kvreplay.check.pool_view import view_of
from kvreplay.families.sglang.checked_call import checked_call, method_of
from kvreplay.families.sglang.checker import InvariantChecker
from kvreplay.families.sglang.vocabulary import COUNTER_METHODS


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
