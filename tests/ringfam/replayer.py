"""The ring's replayer: its own step on the shared loop. Strict mode holds the build to
the tickets the recording got; remap mode lets it hand out its own and translates the
tickets a later ``give`` names through what it handed out instead."""

from __future__ import annotations

from typing import Any

from kvreplay.replay.loop import ReplayLoop, plain
from kvreplay.trace.format import TopCall
from ringfam.checker import RingChecker


class RingReplayer(ReplayLoop):
    nested_args = True

    def __init__(self, trace: Any, build: Any, *, mode: str = "strict", device: str = "auto",
                 full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True,
                 keep: int = 20, reader: Any = None, checked: bool = False, **_: Any) -> None:
        self._open(trace, build, mode=mode, device=device, stop_at_first=stop_at_first, keep=keep, reader=reader,
                   checked=checked, whole="ring")
        self.pool = self._build(build, "cpu")
        self.ids: dict[int, int] | None = {} if self.mode == "remap" else None  # recorded ticket -> build's

        self._watch(RingChecker(self.pool, keep=keep) if check else None, {"ring": int(self.meta.ctor_args["size"])})
        self._see = self.timeline.seer("ring")

    def calls_to_replay(self) -> Any:
        return self.reader.top_calls(device="cpu", nested_args=True)

    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        c, n = tc.call, tc.number
        self.calls += 1
        fn = getattr(self.pool, c.method, None) if c.method in ("take", "give", "left") else None
        if fn is None:
            return self._unsupported(n, c.method, f"build {self.build_spec} has no method {c.method}")
        args = dict(c.args)
        if self.ids is not None and "tickets" in args:
            args["tickets"] = tuple(self.ids.get(t, t) for t in args["tickets"])
        try:
            result, raised = fn(**args), None
        except Exception as exc:  # the build's own failure is what the replay reports
            result, raised = None, exc
        if (raised is None) != (c.exc_type is None):
            self._diverge(n, c.method, "exception", c.exc_type, type(raised).__name__ if raised else None,
                          "the build raised where the recording did not, or the reverse")
        if self.checker is not None and raised is None:
            self.checker.after(n, c.method, args, result)
        self._compare(n, c, result)
        return result, raised

    def _compare(self, n: int, c: Any, result: Any) -> None:
        recorded = plain(c.result)
        if self.ids is not None and c.method == "take" and isinstance(recorded, tuple) and isinstance(result, tuple):
            if len(recorded) == len(result):
                self.ids.update(zip(recorded, result, strict=True))
            else:
                self._diverge(n, c.method, "result", len(recorded), len(result), "another count of tickets")
        elif recorded != plain(result) and (self.ids is None or (recorded is None) != (result is None)):
            self._diverge(n, c.method, "result", c.result, result, "result differs from the recording")
        left = self.pool.left()
        self._see(n, left)
        want = c.counters.get("available")
        if want is not None and want != left and c.method != "left":
            self._diverge(n, c.method, "counter", [want], [left], "tickets left after the call differ")
