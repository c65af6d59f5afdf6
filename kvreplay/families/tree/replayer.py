"""Replay a trace of a prefix cache (the ``tree`` family) against a build.

Each top-level row is issued on the build: a tree call by request number (target
``root``), or a call the scheduler made on the KV allocator itself (target ``kv``).
Strict mode compares the result, the free, evictable and protected sizes after the
call and the allocator calls made inside it with the recording; where a result parts
(a divergence, reported there), a node or lock handle the build named otherwise is
followed under the build's name from then on, so that the checker does not take the
recording's names for the build's faults. Remap mode lets the
build hand out its own slots, nodes and lock handles: a later row's slots, node and
handle are translated through what the build gave in place of the recorded ones, and
only the shape of a result is compared. The checker (checker.py) holds every call to
the ownership rules either way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.families.tree.checker import TreeChecker
from kvreplay.families.tree.runs import from_runs, runs_length, to_runs
from kvreplay.replay.loop import ReplayLoop, plain
from kvreplay.trace.format import Opaque, TopCall
from kvreplay.trace.reader import TraceReader

KV = "kv"  # the allocator's target in a trace
SWA = "swa"  # a sliding-window tree's window side
STATE = "state"  # a Mamba tree's state slots
SIDES = {SWA: "swa.", STATE: "state."}  # a side's calls in the log, by their prefix
TREE_METHODS = ("match_prefix", "lock", "unlock", "extend", "checkpoint", "free_kv_row", "release", "evict", "slide",
                "hold_state", "drop_state", "group_states", "ungroup_states", "touch",
                "available_size", "evictable_size", "protected_size")
KV_METHODS = ("alloc", "free")
# the trace's counter columns, as the tree's reads fill them
COLUMNS = (("available", "available"), ("full_available", "evictable"), ("swa_available", "protected"))


class TreeReplayer(ReplayLoop):
    nested_args = True

    def __init__(self, trace: str | Path, build: str | BuildSpec, *, mode: str = "strict", device: str = "auto",
                 full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True,
                 keep: int = 20, reader: TraceReader | None = None, checked: bool = False, **_: Any) -> None:
        self._open(trace, build, mode=mode, device=device, stop_at_first=stop_at_first, keep=keep, reader=reader,
                   checked=checked, whole="tree")
        self.pool = self._build(build, "cpu")
        self.size = int(self.meta.ctor_args["size"])
        self._slots = max(self.size, *(int(self.meta.ctor_args.get(k) or 0) for k in ("swa_size", "state_size")))
        self._log: list[tuple[str, list[int]]] = []  # (method, slots); another side's as "swa.METHOD", "state.METHOD"
        self._listen(self.pool.kv)
        for target, prefix in SIDES.items():
            if getattr(self.pool, target, None) is not None:
                self._listen(getattr(self.pool, target), prefix)
        # recorded -> build's: slots, nodes and lock handles (remap mode)
        self.maps: dict[str, dict[int, int]] | None = ({"slot": {}, "node": {}, "handle": {}}
                                                       if self.mode == "remap" else None)
        # strict: the build's names for the recording's nodes and handles where a result parted
        self.renamed: dict[str, dict[int, int]] = {"node": {}, "handle": {}}
        checker = TreeChecker(self.pool, full_check_every=full_check_every, keep=keep) if check else None
        self._watch(checker, {KV: int(self.meta.ctor_args["size"])})
        self._see = self.timeline.seer(KV)

    def _listen(self, kv: Any, side: str = "") -> None:
        """Log the allocator's calls (in slots) while the tree makes them."""
        log, real_alloc, real_free = self._log, kv.alloc, kv.free

        def alloc(need_size: int) -> Any:
            got = real_alloc(need_size)
            log.append((side + "alloc", from_runs(got) if got is not None else []))
            return got

        def free(runs: Any) -> None:
            log.append((side + "free", from_runs(runs)))
            return real_free(runs)

        kv.alloc, kv.free = alloc, free

    def calls_to_replay(self) -> Any:
        return self.reader.top_calls(device="cpu", nested_args=self.nested_args)

    def _fn(self, target: str, method: str) -> Callable[..., Any] | None:
        if target in (KV, STATE):  # the scheduler's own calls on an allocator
            side = getattr(self.pool, target, None)
            return getattr(side, method, None) if method in KV_METHODS and side is not None else None
        return getattr(self.pool, method, None) if method in TREE_METHODS else None

    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        c, n = tc.call, tc.number
        self.calls += 1
        fn = self._fn(c.target, c.method)
        opaque = [k for k, v in c.args.items() if isinstance(v, Opaque)] if c.has_opaque else None
        if fn is None or opaque:
            why = (f"build {self.build_spec} has no method {c.method}" if fn is None else
                   f"argument(s) {', '.join(opaque)} of {c.method} were not recorded losslessly")
            return self._unsupported(n, c.method, why)
        bad = self._bad_kinds(tc) or self._bad_runs(tc)
        if bad:
            return self._unsupported(n, c.method, bad)
        self._log.clear()
        if self.checker is not None:
            self.checker.before(n, c.method)
        args = _renamed(c.args, self.renamed) if self.maps is None else self._translate(c.args)
        result: Any = None
        raised: BaseException | None = None
        try:
            result = fn(**args)
        except Exception as exc:  # the build's own failure is what the replay compares
            raised = exc
        counters = self._counters()
        self._see(n, counters["available"])
        if raised is not None or c.exc_type is not None:
            if type(raised).__name__ != c.exc_type:
                self._diverge(n, c.method, "exception", c.exc_type, type(raised).__name__ if raised else None,
                              f"the build raised {type(raised).__name__}: {str(raised)[:200]}" if raised
                              else "the recording raised here; the build did not")
            if self.checker is not None and raised is not None and c.exc_type is None:
                self.checker.raised(n, c.method, c.result)
            return result, raised
        # the checker first: a counter divergence says whose books broke, the build's or the recording's
        if self.checker is not None:
            method = c.method if c.target not in (KV, STATE) else f"{c.target}.{c.method}"
            self.checker.after(n, method, args, result, list(self._log), counters)
        if self.maps is None:
            self._compare(tc, result, counters)
        else:
            self._learn(tc, result)
        return result, raised

    @staticmethod
    def _bad_kinds(tc: TopCall) -> str | None:
        """Why a row's arguments are not what the tree's wire speaks (whole numbers and
        lists of them: a tensor or a text is damage), or None."""
        for x in (tc.call, *tc.nested):
            for k, v in x.args.items():
                if type(v) is int or isinstance(v, (tuple, list)) and all(type(e) is int for e in v):
                    continue
                return f"argument {k} of {x.method} is a {type(v).__name__}, not what the tree's wire records"
        return None

    def _bad_runs(self, tc: TopCall) -> str | None:
        """Why a row's slot runs cannot be slots of this pool (damage: each run must lie in
        the pool and a call cannot name more slots than the pool has), or None."""
        size = self._slots
        c = tc.call
        values = [c.args.get("runs"), *(x.args.get("runs") for x in tc.nested),
                  *(x.result for x in tc.nested if x.method == "alloc")]
        if c.method == "alloc":
            values.append(c.result)
        for v in values:
            if not isinstance(v, (tuple, list)):
                continue
            if len(v) % 2 or any(type(x) is not int for x in v):
                return f"a slot run list of {c.method} is not (start, length) pairs of whole numbers"
            if any(v[k] < 0 or v[k + 1] < 0 or v[k] + v[k + 1] > size + 1 for k in range(0, len(v), 2)) \
                    or runs_length(v) > size:
                return f"the slot runs of {c.method} name slots outside a pool of {size:,} (a damaged trace)"
        return None

    def _counters(self) -> dict[str, int]:
        p = self.pool
        return {"available": p.available_size(), "evictable": p.evictable_size(), "protected": p.protected_size()}

    # -- strict -------------------------------------------------------------------------------------
    def _compare(self, tc: TopCall, result: Any, counters: dict[str, int]) -> None:
        c, n = tc.call, tc.number
        if plain(c.result) != plain(result):
            self._diverge(n, c.method, "result", c.result, result, _result_gap(c.method, c.result, result))
            _learn_names(c.method, c.result, result, self.renamed)
            return
        want = [c.counters.get(col) for col, _ in COLUMNS]
        got = [counters[name] for _, name in COLUMNS]
        if all(w is not None for w in want) and want != got:
            self._diverge(n, c.method, "counter", want, got,
                          _books_gap(want, got, self.checker.gap if self.checker is not None else 0))
        if c.target in (KV, STATE):
            return
        rec = [(SIDES.get(x.target, "") + x.method,
                tuple(plain(x.result if x.method == "alloc" else x.args.get("runs")) or ())) for x in tc.nested]
        got = [(m, to_runs(s)) for m, s in self._log]
        # Side by side: each allocator's own calls in order (a window tree's full and window
        # frees of one node may come in either order, and leave both allocators the same)
        for side in ("", *SIDES.values()):
            want = _one_free_per_run([x for x in rec if _side(x[0]) == side])
            have = _one_free_per_run([x for x in got if _side(x[0]) == side])
            if want != have:
                first = next((i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b),
                             min(len(want), len(have)))
                name = side or "kv."
                said = [[f"{name}{m.removeprefix(side)} -> {r}" for m, r in calls[first:first + 3]]
                        for calls in (want, have)]
                self._diverge(n, c.method, "nested", said[0], said[1], _frees_gap(name, want, have))
                return

    # -- remap --------------------------------------------------------------------------------------
    def _translate(self, args: dict[str, Any]) -> dict[str, Any]:
        m = self.maps
        assert m is not None
        out = _renamed(args, m)
        if isinstance(out.get("runs"), (tuple, list)):
            out["runs"] = to_runs(m["slot"].get(s, s) for s in from_runs(out["runs"]))
        return out

    def _learn(self, tc: TopCall, result: Any) -> None:
        c, n = tc.call, tc.number
        m = self.maps
        assert m is not None
        rec = c.result
        if (rec is None) != (result is None) or type(rec) is not type(result) and not (
                isinstance(rec, (tuple, list)) and isinstance(result, (tuple, list))):
            self._diverge(n, c.method, "result", rec, result, "the build answered where the recording refused, "
                                                              "or the reverse")
            return
        allocs = [x.result for x in tc.nested if x.method == "alloc" and x.target not in SIDES]
        if c.target == KV and c.method == "alloc":
            allocs.insert(0, rec)
        got = [s for k, s in self._log if k == "alloc"]
        for r_runs, g in zip(allocs, got, strict=False):
            if isinstance(r_runs, (tuple, list)):
                m["slot"].update(zip(from_runs(r_runs), g, strict=False))
        if c.method in ("match_prefix", "checkpoint") and isinstance(rec, (tuple, list)) and len(rec) >= 2 \
                and rec[0] != result[0]:
            self._diverge(n, c.method, "result", rec[0], result[0], _result_gap(c.method, rec, result))
        _learn_names(c.method, rec, result, m)


def _frees_gap(name: str, want: list[tuple[str, tuple[int, ...]]], have: list[tuple[str, tuple[int, ...]]]) -> str:
    """What a nested divergence says: where one side freed slots the other did not (a
    free the recording lacks is its leak here, unless a later call frees them), or else
    that the calls differ in order or in what they handed out."""
    def freed(calls: list[tuple[str, tuple[int, ...]]]) -> set[int]:
        return {s for m, runs in calls if m.endswith("free") for s in from_runs(runs)}

    kept, extra = freed(have) - freed(want), freed(want) - freed(have)
    what = {"kv.": "", "swa.": "window ", "state.": "state "}.get(name, "")
    if kept and not extra:
        return (f"the recording did not free {len(kept)} {what}slot(s) this build frees here "
                f"({', '.join(map(str, sorted(kept)[:8]))}): lost in the recording, unless a later call frees them")
    if extra and not kept:
        return (f"the recording freed {len(extra)} {what}slot(s) this build keeps here "
                f"({', '.join(map(str, sorted(extra)[:8]))})")
    return f"the build's {name.rstrip('.')} allocator calls differ from the recording"


def _side(method: str) -> str:
    """The prefix of the allocator a logged call was made on ("" for the KV allocator)."""
    return next((p for p in SIDES.values() if method.startswith(p)), "")


def _renamed(args: dict[str, Any], names: dict[str, dict[int, int]]) -> dict[str, Any]:
    """A row's arguments with each node and lock handle the build named otherwise put in
    the build's name: remap mode's from every call, strict mode's from a call whose result
    parted (reported there), so that the later calls speak of what the build holds and
    the checker does not report the recording's names as faults of the build."""
    out = dict(args)
    for kind in ("node", "handle"):
        if type(out.get(kind)) is int and names[kind]:
            out[kind] = names[kind].get(out[kind], out[kind])
    return out


def _learn_names(method: str, recorded: Any, result: Any, names: dict[str, dict[int, int]]) -> None:
    """The build's names for the node and lock handle a call's recorded result named."""
    if method in ("match_prefix", "checkpoint") and isinstance(recorded, (tuple, list)) \
            and isinstance(result, (tuple, list)) and len(result) >= len(recorded) >= 2:
        names["node"][int(recorded[1])] = int(result[1])
        if method == "checkpoint" and len(recorded) >= 3:
            names["handle"][int(recorded[2])] = int(result[2])
    elif method == "lock" and type(recorded) is int and type(result) is int:
        names["handle"][recorded] = result


def _one_free_per_run(calls: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """Frees that follow one another, with no alloc between, as one free of their slots in
    order: the allocator's free list ends the same, and a tree that frees each node's
    duplicates apart (the unified tree) frees what one call of another tree frees."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for method, runs in calls:
        if method.endswith("free") and out and out[-1][0] == method:
            out[-1] = (method, to_runs([*from_runs(out[-1][1]), *from_runs(runs)]))
        else:
            out.append((method, runs))
    return out


def _result_gap(method: str, recorded: Any, here: Any) -> str:
    """What a result divergence says: for a match or a checkpoint, how the prefix the
    request holds of the tree differs."""
    if (method in ("match_prefix", "checkpoint") and isinstance(recorded, (tuple, list))
            and isinstance(here, (tuple, list)) and recorded and here and recorded[0] != here[0]):
        verb = "matched" if method == "match_prefix" else "cached"
        diff = int(here[0]) - int(recorded[0])
        return (f"the request holds {int(here[0]):,} token(s) of the tree here, {int(recorded[0]):,} in the "
                f"recording: {abs(diff):,} {'more' if diff > 0 else 'fewer'} {verb}")
    return "result differs from the recording"


def _books_gap(recorded: list[int], here: list[int], build_gap: int = 0) -> str:
    """What a counter divergence says of the pool's books: which sizes part, and whose
    books broke. Where the build's own books are off (``build_gap``, the checker's: its
    sizes against the slots the calls said it holds), the build lost slots or counts them
    twice; where they balance, the recording did."""
    parts = ", ".join(f"{name} {w:,} recorded, {g:,} here"
                      for name, w, g in zip(("free", "evictable", "protected"), recorded, here, strict=True) if w != g)
    if build_gap < 0:
        return f"{parts}: this build's own books are {-build_gap:,} slot(s) short by this call (it lost them)"
    if build_gap > 0:
        return f"{parts}: this build's own books count {build_gap:,} slot(s) twice by this call"
    gap = sum(here) - sum(recorded)
    if gap > 0:
        return f"{parts}: the recording lost {gap:,} slot(s) at this call that this build keeps on its books (a leak)"
    if gap < 0:
        return (f"{parts}: the recording counts {-gap:,} slot(s) at this call that this build does not have "
                "(counted twice)")
    return f"{parts}: slots moved between the sizes, none lost"
