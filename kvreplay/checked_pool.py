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

from kvreplay.recorder.recording import COUNTER_METHODS
from kvreplay.replayer.engine import load_build
from kvreplay.replayer.invariants import InvariantChecker
from kvreplay.replayer.pool_view import view_of
from kvreplay.replayer.translations import translate


class CheckedPool:
    def __init__(self, build: str, *, family: str, ctor: dict[str, Any], device: str = "cpu",
                 invariant: str | None = None) -> None:
        self.build = build
        self.pool = load_build(build, family, ctor, device)
        self.view = view_of(self.pool, family)
        self.checker = InvariantChecker(self.view, full_check_every=1, keep=1 << 30)
        self.invariant = invariant  # None: any invariant fails the test
        self.calls = 0
        self._reported = 0

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda **args: self.call(method, **args)

    def call(self, method: str, **args: Any) -> Any:
        """Make one call on the pool (keyword arguments, as a trace records them) and check it."""
        seq = self.calls
        self.calls += 1
        fn = getattr(self.pool, method, None)
        if fn is None:
            t = translate(self.pool, method)
            if t is None:
                raise AttributeError(f"{self.build} has no method {method} and no translation applies")
            pool = self.pool
            fn = lambda **a: t.call(pool, a)  # noqa: E731
        if method in COUNTER_METHODS:
            return fn(**args)
        pre = self.checker.before(method, args)
        raised: BaseException | None = None
        result = None
        try:
            result = fn(**args)
        except Exception as exc:  # checked first, then re-raised: the state it left may be the finding
            raised = exc
        avail = None if self.checker.in_group and method != "free_group_end" else self.view.sub_available()
        self.checker.after(seq, method, args, result, raised is not None, pre, avail)
        self._assert_clean()
        if raised is not None:
            raise raised
        return result

    def finish(self) -> dict[str, int]:
        """The end-of-trace checks; returns what is still held per sub-pool."""
        held = self.checker.finish(self.calls)
        self._assert_clean()
        return held

    def _assert_clean(self) -> None:
        kept = self.checker.log.kept
        new, self._reported = kept[self._reported:], len(kept)
        for v in new:
            if self.invariant is None or v.invariant == self.invariant:
                raise AssertionError(f"{self.build}: invariant {v.invariant} ({v.rule}) broken by call {v.seq} "
                                     f"{v.method}: {v.message}")


__all__ = ["CheckedPool"]
