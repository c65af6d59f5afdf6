"""The wire of the mamba family: sglang's hybrid request pool spoken to in plain values.

sglang's scheduler hands its hybrid request pool Request objects, and the pool reads and
writes their fields (row, state slot, ping-pong pair). A trace row cannot hold a
Request, so a ``StateWire`` stands in front of the pool. A request is a number; what
the scheduler (or the prefix cache) changes of a request between pool calls is its own
call, ``set_request``; the pool's calls on its state-slot allocator (``mamba_allocator``)
go through a ``SlotWire`` and show as nested rows of target ``state``, slots as ids.

A replay builds a fresh pool behind a wire (``construct``): kvreplay's own
(pool.py) or a release's ``HybridReqToTokenPool``, made on the CPU with the
smallest state tensors the release accepts. Requests are stand-ins, rebuilt from the
rows: the pool's own writes to them stay, so a pool that forgets to clear a field
shows it at the next call that reads it."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from kvreplay.errors import BuildUnsupported

ENGINE = "sglang"
POOL_CLASS = "sglang.srt.mem_cache.memory_pool:HybridReqToTokenPool"

# The trace's vocabulary: the pool's calls (requests by number), the allocator's (slots by id).
POOL_METHODS = ("alloc_reqs", "free_req", "free_mamba_cache", "donate_track", "set_request", "clear")
SLOT_METHODS = ("alloc", "free", "alloc_group_begin", "alloc_group_end")
METHODS = (*POOL_METHODS, *SLOT_METHODS, "available_size")
VOID_METHODS = frozenset({"free_req", "free_mamba_cache", "set_request", "clear", "free", "alloc_group_begin",
                          "alloc_group_end"})
NONE = -1  # set_request's "the request holds none" for a slot or row


class WireRequest:
    """A request as the pool sees it: the fields every release reads, on the request
    itself and on ``kv`` (0.5.19 moved them there)."""

    def __init__(self, number: int) -> None:
        self.rid = str(number)
        self.kv = self
        self.req_pool_idx: int | None = None
        self.mamba_pool_idx: torch.Tensor | None = None
        self.mamba_ping_pong_track_buffer: torch.Tensor | None = None
        self.mamba_ping_pong_empty: list[bool] | None = None
        self.mamba_next_track_idx: int | None = None
        self.mamba_last_track_idx: int | None = None
        self.mamba_prev_track_seqlen: int | None = None
        self.mamba_last_track_seqlen: int | None = None
        self.mamba_cow_src_index: Any = None
        self.mamba_needs_clear = False
        self.is_chunked = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0

    def is_dllm(self) -> bool:  # 0.5.9 asks, for diffusion models' requests
        return False

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def inflight_middle_chunks(self) -> int:
        # 0.5.13 to 0.5.19 let a request keep its row only as a chunk in flight or with KV
        # committed; the trace says the KV length allocated (0.5.23's test), which answers both
        return int(self.kv_allocated_len > 0)

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None

    def slots(self) -> tuple[int | None, int | None, tuple[int, ...]]:
        """(row, state slot, tracking slots held) as plain values."""
        state = None if self.mamba_pool_idx is None else int(self.mamba_pool_idx)
        track: tuple[int, ...] = ()
        if self.mamba_ping_pong_track_buffer is not None:
            empty = self.mamba_ping_pong_empty or []
            track = tuple(int(s) for i, s in enumerate(self.mamba_ping_pong_track_buffer.tolist())
                          if s >= 0 and not (i < len(empty) and empty[i]))
        return self.req_pool_idx, state, track


def _no_group(*_: Any) -> None:
    return None


def _ids(t: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in t.reshape(-1).tolist())


class SlotWire:
    """The state-slot allocator's calls in wire form (slots by id)."""

    def __init__(self, owner: StateWire) -> None:
        self._owner = owner
        # (method, slot ids) of each call while a replay listens
        self.log: list[tuple[str, Any]] | None = None
        self.reserved: tuple[int, ...] = ()  # what the last alloc_group_begin took

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        got = self._owner._slot_real["alloc"](int(need_size))
        self._owner._slot_result = got
        ids = None if got is None else _ids(got)
        if self.log is not None:
            self.log.append(("alloc", ids))
        return ids

    def free(self, free_index: tuple[int, ...]) -> None:
        given = self._owner._slot_given
        self._owner._slot_given = None
        if given is None or _ids(given) != tuple(free_index):  # a replayed top-level free
            given = torch.tensor(list(free_index), dtype=torch.int64)
        if self.log is not None:
            self.log.append(("free", tuple(free_index)))
        self._owner._slot_real["free"](given)

    def _real(self, name: str) -> Callable[..., Any]:
        # Before 0.5.13 slots were taken one request at a time: a group changes only which
        # free slots come next, so a release without groups takes the calls as no-ops
        # (a replay counts them as translated; remap mode compares such a release).
        return self._owner._slot_real.get(name) or _no_group

    def alloc_group_begin(self, num_reqs: int) -> None:
        fn = self._real("alloc_group_begin")
        before = set(self._owner.free_slots()) if self.log is not None else None
        fn(int(num_reqs))
        if self.log is not None and before is not None:
            # the slots the group took off the free list (alloc(1) hands them out later)
            self.reserved = tuple(sorted(before - set(self._owner.free_slots())))
            self.log.append(("alloc_group_begin", int(num_reqs)))

    def alloc_group_end(self) -> None:
        fn = self._real("alloc_group_end")
        if self.log is not None:
            self.log.append(("alloc_group_end", None))
        fn()


class StateWire:
    """A hybrid request pool (kvreplay's or a release's) spoken to in wire form."""

    engine = ENGINE
    # the replay's stand-in for every request of the trace, kept so that one coming back
    # (retracted) brings what the pool left on it: the trace's, not the pool's, state
    growth_exempt = ("requests",)

    def __init__(self, pool: Any, ctor_args: dict[str, Any]) -> None:
        self.pool = pool
        self.ctor_args = ctor_args
        self.recorded_class = f"{type(pool).__module__}:{type(pool).__qualname__}"
        self.requests: dict[int, WireRequest] = {}
        self.kept_in_place: int | None = None  # donate_track on a release that copied (see there)
        self.wire_state = SlotWire(self)
        allocator = pool.mamba_allocator
        # a release before 0.5.13 has no grouped allocation (its state pool allocates)
        self._slot_real: dict[str, Callable[..., Any]] = {m: getattr(allocator, m) for m in SLOT_METHODS
                                                           if callable(getattr(allocator, m, None))}
        self._slot_result: Any = None
        self._slot_given: Any = None
        for name in self._slot_real:
            setattr(allocator, name, self._slot_shim(name))

    def _slot_shim(self, name: str) -> Callable[..., Any]:
        wire = self.wire_state

        def shim(*args: Any) -> Any:
            if name == "alloc":
                wire.alloc(int(args[0]))
                return self._slot_result
            if name == "free":
                self._slot_given = args[0]
                return wire.free(_ids(args[0]))
            return getattr(wire, name)(*args)

        return shim

    # -- what the checker reads ---------------------------------------------------------------
    def request(self, number: int) -> WireRequest:
        req = self.requests.get(number)
        if req is None:
            req = self.requests[number] = WireRequest(number)
        return req

    def size(self) -> int:
        return int(self.ctor_args["mamba_size"])

    def free_slots(self) -> list[int]:
        free = self.pool.mamba_allocator.free_slots
        return [int(s) for s in (free.tolist() if isinstance(free, torch.Tensor) else free)]

    # -- the counter a row carries: free state slots ----------------------------------------
    def available_size(self) -> int:
        return int(self.pool.mamba_allocator.available_size())

    # -- the pool's calls ----------------------------------------------------------------------
    def alloc_reqs(self, requests: tuple[int, ...]) -> tuple[int, ...] | None:
        rows = self.pool.alloc([self.request(int(n)) for n in requests])
        return None if rows is None else tuple(int(r) for r in rows)

    def free_req(self, request: int) -> None:
        self.pool.free(self.request(int(request)))

    def free_mamba_cache(self, request: int, keep: int | None = None) -> None:
        free = getattr(self.pool, "free_mamba_cache", None)
        if free is None:  # up to 0.5.7 a request's state went with its row, in free
            raise BuildUnsupported(f"{type(self.pool).__name__} has no free_mamba_cache (it came in sglang 0.5.9)")
        free(self.request(int(request)), keep)

    def donate_track(self, request: int, slot: int) -> int:
        """The prefix cache takes the request's last tracked state: the pair's entry, with
        ``slot`` in its place. Before 0.5.13 the cache copied the state into ``slot``
        instead (``fork_from``) and the pair stayed: a release without the method keeps
        ``slot`` for the cache, which owns one slot either way."""
        donate = getattr(self.pool, "donate_mamba_ping_pong_slot", None)
        if donate is None:
            req = self.request(int(request))
            at, pair = req.mamba_last_track_idx, req.mamba_ping_pong_track_buffer
            if at is None and req.mamba_next_track_idx is not None and pair is not None:
                at = 1 - req.mamba_next_track_idx if len(pair) == 2 else 0  # 0.5.12 kept only the next
            # what stands, in this build, for the slot the recording put into the pair
            self.kept_in_place = int(pair[at]) if pair is not None and at is not None else None
            return int(slot)
        got = donate(self.request(int(request)),
                                                    torch.tensor([int(slot)], dtype=torch.int64))
        return int(got.reshape(-1)[0])

    def set_request(self, request: int, state: int | None = None, track: tuple[int, ...] | None = None,
                    last: int | None = None, kv_len: int | None = None) -> None:
        """What the scheduler or the prefix cache changed of a request the pool reads:
        its state slot (a prefix hit's copy; NONE: none), its tracking pair (``()``: none),
        which entry of the pair holds the last tracked state, its allocated KV length."""
        req = self.request(int(request))
        if state is not None:
            req.mamba_pool_idx = None if state == NONE else torch.tensor(int(state), dtype=torch.int64)
        if track is not None:
            if track:
                req.mamba_ping_pong_track_buffer = torch.tensor(list(track), dtype=torch.int64)
                req.mamba_ping_pong_empty = [s < 0 for s in track]
                req.mamba_next_track_idx = 0
            else:
                req.mamba_ping_pong_track_buffer = req.mamba_ping_pong_empty = None
                req.mamba_next_track_idx = None
        if last is not None:
            req.mamba_last_track_idx = int(last)
            if req.mamba_next_track_idx is not None:
                req.mamba_next_track_idx = 1 - int(last) if len(req.mamba_ping_pong_empty or ()) == 2 else 0
        if kv_len is not None:
            req.kv_allocated_len = req.kv_committed_len = int(kv_len)

    def clear(self) -> None:
        self.pool.clear()
        self.requests.clear()


# -- building a pool ---------------------------------------------------------------------------
def _fit(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _release_pool(cls: type, ctor: dict[str, Any], device: Any) -> Any:
    """A release's HybridReqToTokenPool with one state-space layer of the smallest shape:
    the allocator's behaviour does not depend on what a state holds."""
    if ctor.get("extra_buffer") and "enable_mamba_extra_buffer" not in inspect.signature(cls.__init__).parameters:
        raise BuildUnsupported(f"{cls.__module__}.{cls.__name__} has no tracking pair (the extra buffer came in "
                               "sglang 0.5.9); the trace uses one")
    try:
        mu = importlib.import_module("sglang.srt.configs.mamba_utils")
    except ModuleNotFoundError:
        raise BuildUnsupported(f"{cls.__module__}.{cls.__name__} takes no state shape kvreplay can build "
                               "(sglang.srt.configs.mamba_utils came in 0.5.4)") from None
    # up to 0.5.7 the state's dtype is read from the environment the server's arguments set
    os.environ.setdefault("SGLANG_MAMBA_SSM_DTYPE", "float32")
    shape = mu.Mamba2StateShape.create(**_fit(mu.Mamba2StateShape.create, dict(
        tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=2)))
    params = mu.Mamba2CacheParams(shape=shape, layers=[0])
    ping_pong = int(ctor.get("ping_pong") or 2)
    kwargs = dict(size=int(ctor["size"]), mamba_size=int(ctor["mamba_size"]),
                  mamba_spec_state_size=int(ctor["mamba_size"]), max_context_len=8, device=str(device),
                  enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0],
                  enable_mamba_extra_buffer=bool(ctor.get("extra_buffer")), speculative_num_draft_tokens=None,
                  enable_overlap_schedule=ping_pong == 2)
    pool = cls(**_fit(cls.__init__, kwargs))
    got = int(getattr(pool, "mamba_ping_pong_track_buffer_size", ping_pong))
    if ctor.get("extra_buffer") and got != ping_pong:
        raise BuildUnsupported(f"{cls.__module__}.{cls.__name__} keeps {got} tracking slots per request, "
                               f"the trace {ping_pong}")
    if not hasattr(pool, "mamba_allocator"):  # before 0.5.13 the state pool allocated its own slots
        pool.mamba_allocator = pool.mamba_pool
    return pool


def construct(fam: Any, cls: type, ctor: dict[str, Any], device: Any) -> StateWire:
    """A pool of ``cls`` behind a wire, from a trace's constructor arguments."""
    if cls.__module__.split(".")[0] == ENGINE:
        pool = _release_pool(cls, ctor, device)
    else:
        pool = cls(**{name: ctor.get(name) for name in fam.ctor_args}, device=str(device))
    return StateWire(pool, dict(ctor))


def ctor_of(wire: Any) -> dict[str, Any]:
    return dict(wire.ctor_args)
