"""Replay a trace of a hybrid request pool (the ``mamba`` family) against a build.

The build is a wire (wire.py) over kvreplay's pool or a release's. Each top-level row
is issued on it: a pool call by request number, or a call the scheduler or the prefix
cache made on the state-slot allocator itself (target ``state``). Strict mode compares
the result, the free state slots after the call and the allocator calls made inside it
with the recording. Remap mode lets the build hand out its own slots and rows: the
slots a later row names (a prefix hit's copy, a kept slot freed on eviction) are
translated through what the build handed out in place of the recorded ones. The
checker (checker.py) holds every call to the state pool's invariants."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.errors import BuildUnsupported
from kvreplay.families.mamba.checker import StatePoolChecker
from kvreplay.families.mamba.wire import NONE, SLOT_METHODS
from kvreplay.replay.compare import block_remap_difference
from kvreplay.replay.loop import ReplayLoop, plain
from kvreplay.trace.format import Opaque, TopCall
from kvreplay.trace.reader import TraceReader

STATE = "state"  # the allocator's target in a trace


class StateReplayer(ReplayLoop):
    nested_args = True

    def __init__(self, trace: str | Path, build: str | BuildSpec, *, mode: str = "strict", device: str = "auto",
                 full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True,
                 keep: int = 20, reader: TraceReader | None = None, checked: bool = False, **_: Any) -> None:
        self._open(trace, build, mode=mode, device=device, stop_at_first=stop_at_first, keep=keep, reader=reader,
                   checked=checked, whole="state-pool")
        self.pool = self.wire = self._build(build, "cpu")
        checker = StatePoolChecker(self.wire, full_check_every=full_check_every, keep=keep) if check else None
        self._log: list[tuple[str, Any]] = []
        self.wire.wire_state.log = self._log
        self.slot_map: dict[int, int] | None = {} if self.mode == "remap" else None  # recorded -> build's
        self._watch(checker, {STATE: int(self.meta.ctor_args["mamba_size"])})
        self._see = self.timeline.seer(STATE)

    def calls_to_replay(self) -> Any:
        return self.reader.top_calls(device="cpu", nested_args=self.nested_args)

    def _fn(self, target: str, method: str) -> Callable[..., Any] | None:
        if target == STATE:
            return getattr(self.wire.wire_state, method, None) if method in SLOT_METHODS else None
        return getattr(self.wire, method, None) if not method.startswith("_") else None

    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        c, n = tc.call, tc.number
        self.calls += 1
        fn = self._fn(c.target, c.method)
        opaque = [k for k, v in c.args.items() if isinstance(v, Opaque)] if c.has_opaque else None
        if fn is None or opaque:
            why = (f"build {self.build_spec} has no method {c.method}" if fn is None else
                   f"argument(s) {', '.join(opaque)} of {c.method} were not recorded losslessly")
            return self._unsupported(n, c.method, why)
        if c.target == STATE and c.method not in self.wire._slot_real:
            self.translated[c.method] += 1  # a release before grouped allocation: a no-op there
        elif c.method == "donate_track" and not hasattr(self.wire.pool, "donate_mamba_ping_pong_slot"):
            self.translated[c.method] += 1  # a release whose cache copied the state instead
        log = self._log
        log.clear()
        args = c.args if self.slot_map is None else self._translate(c.method, c.args)
        raised: BaseException | None = None
        result: Any = None
        try:
            result = fn(**args)
        except BuildUnsupported as exc:
            return self._unsupported(n, c.method, str(exc))
        except Exception as exc:
            # the build's answer, compared with the recording's: its own assertion, arguments it
            # does not take, or an error on a request it holds no row for (a release indexes by it)
            raised = exc
        want = c.counters.get("available")
        avail = None
        if want is not None:
            avail = self.wire.available_size()
            self._see(n, avail)
        if raised is not None or c.exc_type is not None:
            if type(raised).__name__ != c.exc_type:
                self._diverge(n, c.method, "exception", c.exc_type, type(raised).__name__ if raised else None,
                              f"the build raised {type(raised).__name__}: {str(raised)[:200]}" if raised
                              else "the recording raised here; the build did not")
            return result, raised
        if self.slot_map is None:
            self._compare(tc, result, want, avail, log)
        else:
            self._learn(tc, result, log)
        if self.checker is not None and c.method not in ("available_size",):
            # the slot wire logs a top-level allocator call as it logs a nested one
            self.checker.after(n, c.method, args, result, log, self._requests(c.method, args))
        return result, raised

    @staticmethod
    def _requests(method: str, args: dict[str, Any]) -> tuple[int, ...]:
        if method == "alloc_reqs":
            return tuple(int(r) for r in args.get("requests") or () if type(r) is int)
        r = args.get("request")
        return (r,) if type(r) is int else ()

    # -- strict -----------------------------------------------------------------------------------
    def _compare(self, tc: TopCall, result: Any, want: int | None, avail: int | None,
                 log: list[tuple[str, Any]]) -> None:
        c, n = tc.call, tc.number
        if plain(c.result) != plain(result):
            self._diverge(n, c.method, "result", c.result, result, "result differs from the recording")
            return
        if want is not None and want != avail:
            self._diverge(n, c.method, "counter", [want], [avail], "free state slots after the call differ")
        if c.target == STATE:
            return
        rec = [(x.method, plain(x.result if x.method == "alloc" else x.args.get("free_index")))
               for x in tc.nested]
        got = [(m, plain(v) if m in ("alloc", "free") else None) for m, v in log]
        if rec != got:
            first = next((i for i, (a, b) in enumerate(zip(rec, got, strict=False)) if a != b), min(len(rec), len(got)))
            self._diverge(n, c.method, "nested", [f"state.{m} -> {r}" for m, r in rec[first:first + 3]],
                          [f"state.{m} -> {r}" for m, r in got[first:first + 3]],
                          "the build's state-slot calls differ from the recording")

    # -- remap ------------------------------------------------------------------------------------
    def _translate(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        m = self.slot_map
        assert m is not None
        out = dict(args)
        for key in ("state", "slot"):
            v = out.get(key)
            if type(v) is int and v != NONE:
                out[key] = m.get(v, v)
        for key in ("track", "free_index"):
            v = out.get(key)
            if isinstance(v, (tuple, list)):
                out[key] = tuple(m.get(s, s) if type(s) is int and s >= 0 else s for s in v)
        return out

    def _learn(self, tc: TopCall, result: Any, log: list[tuple[str, Any]]) -> None:
        c, n = tc.call, tc.number
        m = self.slot_map
        assert m is not None
        why = block_remap_difference(c.result, result)
        if why is not None:
            self._diverge(n, c.method, "result", c.result, result, why)
        rec = [x.result for x in tc.nested if x.method == "alloc"]
        if c.target == STATE and c.method == "alloc":
            rec.insert(0, c.result)
        got = [v for k, v in log if k == "alloc"]
        for r_ids, g_ids in zip(rec, got, strict=False):
            if isinstance(r_ids, (tuple, list)) and isinstance(g_ids, (tuple, list)):
                m.update(zip(r_ids, g_ids, strict=False))
        if c.method == "donate_track" and type(c.result) is int and type(result) is int:
            m[c.result] = result
            slot = c.args.get("slot")
            if self.wire.kept_in_place is not None and type(slot) is int:  # a release that copied:
                m[slot] = self.wire.kept_in_place  # the recording's new pair entry is the build's old one
                self.wire.kept_in_place = None
