"""One checked call: the build's method (or its API translation), made with the
checker's reads before it and its checks after it. A replay and a CheckedPool
(the emitted reproducers) both go through here, so they check alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.builds.translations import abstract, dropped_args, translate
from kvreplay.check.pool_view import PoolView
from kvreplay.contract.registry import all_methods
from kvreplay.errors import BadInput
from kvreplay.families.sglang.checker import InvariantChecker


def method_of(pool: Any, method: str) -> tuple[Callable[..., Any] | None, bool]:
    """(what to call for ``method`` on ``pool``, whether it is a translation); None
    when the build has neither. Only methods of the allocator API are ever looked up:
    a name from a trace never reaches ``getattr`` otherwise."""
    if method not in all_methods():
        raise BadInput(f"{method!r} is not a method of the allocator API")
    fn = getattr(pool, method, None)
    if fn is not None and callable(fn) and not abstract(pool, method, fn):
        drop = dropped_args(pool, method, fn)
        if drop:  # an older signature: same call without the host copies it predates
            return (lambda **args: fn(**{k: v for k, v in args.items() if k not in drop})), True
        return fn, False
    t = translate(pool, method)
    if t is None:
        return None, False
    return (lambda **args: t.call(pool, args)), True


def checked_call(view: PoolView, checker: InvariantChecker | None, call: int, method: str,
                 args: dict[str, Any], fn: Callable[..., Any], *, in_group: bool = False,
                 between: Callable[[Any, BaseException | None, dict[str, int] | None], None] | None = None,
                 ) -> tuple[Any, BaseException | None, dict[str, int] | None]:
    """Make call number ``call``; returns (result, what it raised, counters after it:
    None inside a free group, where nothing reads them). ``in_group`` stands in for
    the checker's own knowledge when there is no checker; ``between`` sees the call's
    outcome before the checker does."""
    pre = None
    if checker is not None:
        try:
            pre = checker.before(method, args)
        except _UNREADABLE as exc:
            raise _unreadable(call, method, exc) from None
    raised: BaseException | None = None
    result: Any = None
    try:
        result = fn(**args)
    except Exception as exc:  # the build's own failure is a finding, not a crash
        raised = exc
    if checker is not None:
        in_group = checker.in_group
    avail = None if in_group and method != "free_group_end" else view.sub_available()
    if between is not None:
        between(result, raised, avail)
    if checker is not None:
        try:
            checker.after(call, method, args, result, raised is not None, pre, avail)
        except _UNREADABLE as exc:
            raise _unreadable(call, method, exc) from None
    return result, raised, avail


_UNREADABLE = (TypeError, ValueError, IndexError, KeyError, AttributeError, OverflowError)


def _unreadable(call: int, method: str, exc: BaseException) -> BadInput:
    """Arguments the checker cannot read (None where slots belong, a string, a wrong
    shape) make the trace bad input, named at its call."""
    return BadInput(f"call #{call} {method}: arguments the checker cannot read "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
