"""The live face of the mamba family's wire: a running sglang server's hybrid request
pool, recorded.

The server's scheduler hands the pool its own Request objects; the wire puts a number
on each (the first time the pool sees it) and records the pool's calls by number. What
the scheduler or the prefix cache changed of a request since the pool last saw it (a
prefix hit's copied state slot, a slot freed and cleared, a tracking pair refilled, the
KV length the pool checks) is recorded as one ``set_request`` just before the pool call
that reads it: the changes made in between belong to no pool call, and a replay needs
them only where the pool reads them. The server's own calls on the state-slot allocator
(the cache's copies, evictions, the scheduler's groups) are top-level rows of target
``state``; the pool's are nested under its call, as in a replay."""

from __future__ import annotations

import itertools
from typing import Any

from kvreplay.families.mamba.wire import NONE, POOL_CLASS, StateWire

# the wire's call -> the pool method it stands for
LIVE_NAMES = {"alloc_reqs": "alloc", "free_req": "free", "free_mamba_cache": "free_mamba_cache",
              "donate_track": "donate_mamba_ping_pong_slot", "clear": "clear"}
_TAG = "_kvreplay_request"


def ctor_args_of(pool: Any) -> dict[str, Any]:
    """A live pool's constructor arguments, as the family records them."""
    slots = getattr(pool, "mamba_allocator", None) or pool.mamba_pool  # before 0.5.13 the state pool allocated
    extra = bool(getattr(pool, "enable_mamba_extra_buffer", False))
    return {"size": int(pool.size), "mamba_size": int(slots.size), "extra_buffer": extra,
            "ping_pong": int(getattr(pool, "mamba_ping_pong_track_buffer_size", 2) or 2),
            "max_context_len": int(pool.max_context_len)}


def _fields(req: Any) -> tuple[int, tuple[int, ...], int | None, int]:
    """What the pool reads of a request: (state slot, tracking pair with -1 for an empty
    entry, the pair's entry with the last tracked state, allocated KV length)."""
    kv = getattr(req, "kv", req)  # 0.5.19 moved the fields onto the request's KV record
    state = NONE if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx)
    track: tuple[int, ...] = ()
    buf = getattr(kv, "mamba_ping_pong_track_buffer", None)
    if buf is not None:
        empty = getattr(kv, "mamba_ping_pong_empty", None) or []
        track = tuple(-1 if (i < len(empty) and empty[i]) else int(s) for i, s in enumerate(buf.tolist()))
    last = getattr(kv, "mamba_last_track_idx", None)
    return state, track, None if last is None else int(last), int(getattr(kv, "kv_allocated_len", 0) or 0)


_UNSEEN = (NONE, (), None, 0)  # a request the wire has not seen: as a replay's stand-in starts


class LiveStateWire(StateWire):
    """The wire in front of a running server's pool: the server's requests pass through
    to the pool's own methods; the recorder records the wire's calls."""

    def __init__(self, pool: Any) -> None:
        self._pool_real = {wire: getattr(pool, name) for wire, name in LIVE_NAMES.items()
                           if callable(getattr(pool, name, None))}
        super().__init__(pool, ctor_args_of(pool))
        self._numbers = itertools.count(1)
        self._known: dict[int, tuple[int, tuple[int, ...], int | None, int]] = {}
        self._call: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # the server's arguments, in flight
        self._result: Any = None
        for wire_name in self._pool_real:
            setattr(pool, LIVE_NAMES[wire_name], self._shim(wire_name))

    def _sync(self, req: Any, reads_kv_len: bool) -> int:
        """The request's number, after a ``set_request`` of what changed since the pool saw
        it. The KV length is said only before a call that reads it (``alloc``): it changes
        at every step, and a replay's stand-in keeps the last one said."""
        n = req.__dict__.get(_TAG)
        if n is None:  # new to the pool: the replay's stand-in starts empty
            n = req.__dict__[_TAG] = next(self._numbers)
            before = _UNSEEN
        else:  # back after its row was given back (retracted): said whole, as nothing is remembered
            before = self._known.get(n, (None, None, None, None))
        now = _fields(req)
        if not reads_kv_len:
            now = (*now[:3], before[3])
        if now != before:
            changed: dict[str, Any] = {}
            for key, a, b in zip(("state", "track", "last", "kv_len"), now, before, strict=True):
                if a != b and a is not None:
                    changed[key] = a
            if changed:
                self.set_request(request=n, **changed)
        self._known[n] = now
        return n

    def _shim(self, wire_name: str) -> Any:
        original = self._pool_real[wire_name]

        def live(*args: Any, **kwargs: Any) -> Any:
            if self._call is not None:  # the pool calling itself: one recorded call
                return original(*args, **kwargs)
            reqs = list(args[0]) if wire_name == "alloc_reqs" else args[:1] if wire_name != "clear" else []
            numbers = [self._sync(r, wire_name == "alloc_reqs") for r in reqs]
            wire = dict(self._wire_args(wire_name, numbers, args, kwargs))
            self._call, self._result = (args, kwargs), None
            try:
                getattr(self, wire_name)(**wire)  # looked up per call: the recorder wraps it
            finally:
                self._call = None
            for n, r in zip(numbers, reqs, strict=True):  # the pool's own writes (never the KV length)
                self._known[n] = (*_fields(r)[:3], self._known[n][3])
            if wire_name == "free_req":  # a server runs for months: forget requests that gave their row back
                self._known.pop(numbers[0], None)
            return self._result

        live.__wrapped__ = original  # type: ignore[attr-defined]
        return live

    @staticmethod
    def _wire_args(name: str, numbers: list[int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name == "alloc_reqs":
            yield "requests", tuple(numbers)
        elif name in ("free_req", "free_mamba_cache", "donate_track"):
            yield "request", numbers[0]
        if name == "free_mamba_cache":
            keep = args[1] if len(args) > 1 else kwargs.get("mamba_ping_pong_track_buffer_to_keep")
            yield "keep", None if keep is None else int(keep)
        elif name == "donate_track":
            slot = args[1] if len(args) > 1 else kwargs["new_slot"]
            yield "slot", int(slot.reshape(-1)[0])

    def _real(self, name: str) -> Any:
        assert self._call is not None
        args, kwargs = self._call
        self._result = self._pool_real[name](*args, **kwargs)
        return self._result

    # -- the wire's calls, served by the server's own objects --------------------------------
    def alloc_reqs(self, requests: tuple[int, ...]) -> tuple[int, ...] | None:
        rows = self._real("alloc_reqs")
        return None if rows is None else tuple(int(r) for r in rows)

    def free_req(self, request: int) -> None:
        self._real("free_req")

    def free_mamba_cache(self, request: int, keep: int | None = None) -> None:
        self._real("free_mamba_cache")

    def donate_track(self, request: int, slot: int) -> int:
        return int(self._real("donate_track").reshape(-1)[0])

    def set_request(self, request: int, state: int | None = None, track: tuple[int, ...] | None = None,
                    last: int | None = None, kv_len: int | None = None) -> None:
        """Recorded only: the server already changed its request."""

    def clear(self) -> None:
        self._real("clear")
        self._known.clear()


def wire_for(obj: Any) -> LiveStateWire | None:
    """What a recording of an engine object records: the wire before sglang's hybrid pool."""
    cls = type(obj)
    return LiveStateWire(obj) if f"{cls.__module__}:{cls.__qualname__}" == POOL_CLASS else None
