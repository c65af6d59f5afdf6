"""Replay a trace against a build: issue the recorded top-level calls in order,
compare what the build does with what was recorded, and check invariants.

strict: any difference in results, counters or nested sub-allocator calls is a
divergence. remap: recorded indices are translated to the build's own (per page),
so a build with another free-slot policy replays; only semantic differences count
(None vs a tensor, lengths, exceptions)."""

from __future__ import annotations

import binascii
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from kvreplay.builds.spec import BuildSpec
from kvreplay.check.pool_view import view_of
from kvreplay.contract.registry import family
from kvreplay.errors import BadInput, BuildUnloadable
from kvreplay.families.sglang.checked_call import checked_call, method_of
from kvreplay.families.sglang.checker import InvariantChecker
from kvreplay.families.sglang.remap import PageTable, Remapper
from kvreplay.families.sglang.vocabulary import ALLOCS, COUNTER_METHODS
from kvreplay.replay.compare import alike, exception_difference, remap_difference, same
from kvreplay.replay.loop import UNSUPPORTED, ReplayLoop, Segment, start_point
from kvreplay.trace import snapshot
from kvreplay.trace.format import CHECKPOINT_METHOD, GAP_TARGET, Opaque, TopCall, parse_json
from kvreplay.trace.reader import TraceReader


class NestedCapture:
    """Collects a build's sub-allocator calls, as the recorder would see them."""

    def __init__(self, pool: Any, family_name: str) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self._stack: list[str] = []
        fam = family(family_name)
        for target, attr in fam.sub_allocators:
            sub = getattr(pool, attr, None)
            if sub is None or sub is pool:
                continue
            for name in fam.methods:
                fn = getattr(sub, name, None)
                if fn is not None and name not in COUNTER_METHODS:
                    setattr(sub, name, self._wrap(target, name, fn))

    def _wrap(self, target: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        stack, calls = self._stack, self.calls

        def captured(*a: Any, **k: Any) -> Any:
            if stack and stack[-1] == target:
                return fn(*a, **k)
            stack.append(target)
            try:
                r = fn(*a, **k)
            finally:
                stack.pop()
            calls.append((target, name, r))
            return r

        return captured


def restore_snapshot(pool: Any, state: dict[str, Any], spec: str) -> None:
    """Put a trace's starting state (a mid-life attach, a flight-recorder dump) into the build."""
    try:
        missing = snapshot.restore(pool, state)
    except (ValueError, KeyError, TypeError, RuntimeError, AttributeError, zlib.error, binascii.Error) as exc:
        raise BadInput(f"the trace's starting snapshot is unreadable ({type(exc).__name__}: {exc})") from None
    if missing:
        raise BuildUnloadable(f"{spec} cannot start from the trace's snapshot: it keeps no "
                              f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")


class Replayer(ReplayLoop):
    """One replay of one trace of an sglang pool family against one build; ``run``
    (the shared loop) drives it to the end."""

    # Sub-allocator rows are compared by target and method only: their arguments are not
    # decoded (a third of the work). Whoever feeds ``step`` decodes them this way.
    nested_args = False
    replays_segments = True

    def __init__(self, trace: str | Path, build: str | BuildSpec, *, mode: str = "strict", device: str = "auto",
                 full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True,
                 keep: int = 20, after_gap: bool = False, reader: TraceReader | None = None,
                 start: tuple[int, dict[str, Any] | None] | None = None, checked: bool = False,
                 segment: Segment | None = None) -> None:
        """``reader`` and ``start`` (``start_point``'s answer) let a caller that replays
        one trace many times (minimize) open it and scan it for gaps once; ``checked``
        says its rows were already checked (``TraceReader.check_calls``)."""
        self._open(trace, build, mode=mode, device=device, stop_at_first=stop_at_first, keep=keep, reader=reader,
                   checked=checked)
        self.segment = segment
        if segment is not None and segment.start_row > 0:
            start = (-1, None)  # the segment's checkpoint holds its state (_start_segment)
        self.start_after, start_state = start or start_point(self.reader, after_gap)
        self.pool = self._build(build, self.device)
        if start_state is not None:
            restore_snapshot(self.pool, start_state, build)
        self.view = view_of(self.pool, self.meta.family)
        checker = InvariantChecker(self.view, full_check_every=full_check_every, keep=keep) if check else None
        self._watch(checker, {name: sub.size for name, sub in self.view.subs.items()})
        if self.checker is not None and start_state is not None:
            self.checker.adopt()
        if segment is not None and segment.start_row > 0:
            self._start_segment(segment)
        self.capture = NestedCapture(self.pool, self.meta.family) if mode == "strict" else None
        self.remap: Remapper | None = None
        if mode == "remap":
            # the first sub-pool's slots are what the API's indices name; a second one's
            # (SWA) are reached through the pool's mapping
            subs = list(self.view.subs.values())
            main, second = subs[0], (subs[1] if len(subs) > 1 else None)
            self.remap = Remapper(PageTable(main.num_pages, main.page_size),
                                  PageTable(second.num_pages, second.page_size) if second else None)
        self._methods: dict[str, tuple[Callable[..., Any] | None, bool, Any]] = {}  # the build's method per name
        self._own = vars(self.pool) if hasattr(self.pool, "__dict__") else {}
        self._sizes = [(name, sub.size) for name, sub in self.view.subs.items()]

    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        """Issue one recorded call; returns what the build returned or raised."""
        c, n = tc.call, tc.number
        self.calls += 1
        # Looked up once per method name, again only if the instance's own attribute
        # changed (a recorder attached to the pool patches its methods there).
        own = self._own.get(c.method)
        got = self._methods.get(c.method)
        if got is None or got[2] is not own:
            got = self._methods[c.method] = (*method_of(self.pool, c.method), own)
        fn, translated, _ = got
        if fn is None:
            why = f"build {self.build_spec} has no method {c.method} and no translation applies"
            self._diverge(n, c.method, "unsupported", "method", "missing", why)
            if c.method not in COUNTER_METHODS and self.unsupported is None:
                self.unsupported = f"{why} (call #{n})"
            return None, UNSUPPORTED
        if translated:
            self.translated[c.method] += 1
        opaque = [k for k, v in c.args.items() if isinstance(v, Opaque)] if c.has_opaque else None
        if opaque:
            why = f"argument(s) {', '.join(opaque)} of {c.method} were not recorded losslessly"
            self._diverge(n, c.method, "unsupported", "recordable arguments", ",".join(opaque), why)
            if c.method not in COUNTER_METHODS and self.unsupported is None:
                self.unsupported = f"{why} (call #{n})"
            return None, UNSUPPORTED
        args = self.remap.args(c.args) if self.remap else c.args
        if c.method in COUNTER_METHODS:
            return self._read(tc, fn, args)
        if self.capture:
            self.capture.calls.clear()
        # Inside a free group nothing reads availability: frees there take effect at its
        # end, the recorder stored no counters, and the checker settles at the end.
        self._current = tc
        result, raised, avail = checked_call(self.view, self.checker, n, c.method, args, fn,
                                             in_group=c.counters.get("available") is None, between=self._between)
        if avail is not None and c.counters.get("available") is not None:
            # sampled where the recording read the counters too, so both sides compare bucket by bucket
            self.timeline.see(n, avail)
        if self.capacity_call is None and self._capacity_broken(raised, avail):
            self.capacity_call = n
        return result, raised

    def _read(self, tc: TopCall, fn: Callable[..., Any], args: dict[str, Any]) -> tuple[Any, BaseException | None]:
        """A counter read: nothing to check but what it returned."""
        c = tc.call
        try:
            result = fn(**args)
        except Exception as exc:
            self._compare(tc, None, exc, None)
            return None, exc
        if not (same(c.result, result) if self.mode == "strict" else alike(c.result, result)):
            self._diverge(tc.number, c.method, "result", c.result, result, "counter read differs")
        return result, None

    def _between(self, result: Any, raised: BaseException | None, avail: dict[str, int] | None) -> None:
        self._compare(self._current, result, raised, avail)

    def _capacity_broken(self, raised: BaseException | None, avail: dict[str, int] | None) -> bool:
        """sglang's own assertion: raised by the build, or true of its counters now
        (not read inside a free group, where nothing is released yet)."""
        if isinstance(raised, AssertionError) and "available_size" in str(raised):
            return True
        if avail is None:
            return False
        for name, size in self._sizes:
            if avail[name] > size:
                return True
        return False

    def _compare(self, tc: TopCall, result: Any, raised: BaseException | None,
                 avail: dict[str, int] | None) -> None:
        c, n = tc.call, tc.number
        got_exc, why = exception_difference(c.exc_type, raised)
        if why is not None:
            self._diverge(n, c.method, "exception", c.exc_type, got_exc, why)
            return
        if raised is not None:
            return
        if self.mode == "strict":
            if not same(c.result, result):
                self._diverge(n, c.method, "result", c.result, result, "result differs from the recording")
                return
            self._compare_counters(tc, avail)
            if tc.nested or self.capture.calls:
                self._compare_nested(tc)
            return
        # remap: only what the caller could tell apart (compare.py's one definition)
        why = remap_difference(c.result, result)
        if why is not None:
            self._diverge(n, c.method, "result", c.result, result, why)
        elif self.remap is not None and isinstance(result, torch.Tensor):
            self.remap.full.learn(c.result, result)
            self._learn_swa(tc, result)

    def _learn_swa(self, tc: TopCall, result: torch.Tensor) -> None:
        if self.remap is None or self.remap.swa is None or tc.call.method not in ALLOCS:
            return
        second = list(self.view.subs)[1]
        rec = [n.result for n in tc.nested if n.target == second and isinstance(n.result, torch.Tensor)]
        if not rec:
            return
        mapped = result[-rec[-1].numel():] if rec[-1].numel() else result[:0]
        self.remap.swa.learn(rec[-1], self.view.mapping[mapped])

    def _compare_counters(self, tc: TopCall, avail: dict[str, int] | None) -> None:
        c = tc.call
        counters = c.counters
        want = (counters.get("available"), counters.get("full_available"), counters.get("swa_available"))
        if want[0] is None and want[1] is None:
            return  # not recorded for this call
        got = self.view.counters(avail)
        if (want[0] is not None and want[0] != got[0]) or (want[1] is not None and want[1] != got[1]) or \
                (want[2] is not None and want[2] != got[2]):
            self._diverge(tc.number, c.method, "counter", list(want), list(got), "pool counters after the call differ")

    def _compare_nested(self, tc: TopCall) -> None:
        if self.capture is None:
            return
        want, got = tc.nested, self.capture.calls
        if len(want) == len(got):
            for n, (t, m, g) in zip(want, got, strict=True):
                if n.target != t or n.method != m:
                    break
                if not same(n.result, g):
                    self._diverge(tc.number, tc.call.method, "nested", n.result, g,
                                  f"{t}.{m} returned something else")
                    return
            else:
                return
        self._diverge(tc.number, tc.call.method, "nested", [f"{n.target}.{n.method}" for n in want],
                      [f"{t}.{m}" for t, m, _ in got], "the build's sub-allocator calls differ from the recording")

    # -- the loop's hooks for a segment (replay --jobs) --------------------------------
    def calls_to_replay(self) -> Iterable[TopCall]:
        seg = self.segment
        rows_from = None if seg is None else (seg.start_row, self.reader.num_rows)
        return self.reader.top_calls(device=self.device, rows=rows_from, nested_args=self.nested_args,
                                     number_from=0 if seg is None else seg.number_from)

    def first_row(self) -> int:
        return self.segment.start_row if self.segment is not None else 0

    def ends_at(self, c: Any, row: int) -> bool:
        seg = self.segment
        return (seg is not None and seg.end_row is not None and c.method == CHECKPOINT_METHOD
                and row >= seg.end_row and row in seg.stop_rows and self.at_checkpoint(c))

    # -- segments (replay --jobs) --------------------------------------------------
    def _start_segment(self, seg: Segment) -> None:
        """Put the build and the checker in the state of the checkpoint the segment starts at."""
        cp = next(iter(self.reader.calls(rows=(seg.start_row, seg.start_row + 1))), None)
        if cp is None or cp.target != GAP_TARGET or cp.method != CHECKPOINT_METHOD:
            raise BadInput(f"{self.reader.path.name}: row {seg.start_row} is not a checkpoint")
        if cp.args.get("calls") != seg.number_from:
            raise BadInput(f"{self.reader.path.name}: the checkpoint at row {seg.start_row} says it follows call "
                           f"#{cp.args.get('calls')}, but call #{seg.number_from} comes before it")
        state, checker = _checkpoint_states(self.reader, cp)
        restore_snapshot(self.pool, state, self.build_spec)
        if self.checker is not None:
            try:
                self.checker.restore(checker)
            except (ValueError, KeyError, TypeError, zlib.error, binascii.Error) as exc:
                raise BadInput(f"{self.reader.path.name}: the checkpoint at row {seg.start_row} has an "
                               f"unreadable checker state ({exc})") from None

    def at_checkpoint(self, cp: Any) -> bool:
        """Whether the build and the checker are now exactly where the recording was at
        checkpoint row ``cp``: then a replay started there goes on as this one would."""
        try:
            state, checker = _checkpoint_states(self.reader, cp)
        except BadInput:
            return False
        if not snapshot.matches(self.pool, state):
            return False
        if self.remap is not None and not self.remap.is_identity():
            return False  # the build named pages its own way: a fresh start would not know
        if self.checker is not None:
            try:
                return self.checker.state() == checker
            except ValueError:
                return False
        return True


def _checkpoint_states(reader: TraceReader, cp: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        return parse_json(cp.args["state"], "a checkpoint"), parse_json(cp.args["checker"], "a checkpoint")
    except (KeyError, TypeError, ValueError):
        raise BadInput(f"{reader.path.name}: a checkpoint row (after call #{cp.args.get('calls', '?')}) "
                       "is damaged") from None


__all__ = ["Replayer", "Segment", "restore_snapshot", "start_point"]
