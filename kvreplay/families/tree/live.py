"""The live face of the tree family: a running sglang server's prefix cache
(``UnifiedRadixCache``, 0.5.22 and later), recorded in the wire's plain values.

The server's scheduler hands its tree Request objects, token ids, lock objects and
node handles; none of them goes into a trace. The wire here numbers requests (from
the first call that names one; a retracted request that comes back is a new number),
nodes (in the order a result first names them; the root is 0) and locks (in the order
they are taken), and turns a request's token ids into page hashes keyed with a secret
drawn per process, so that equal prefixes hash alike inside the trace and no prompt can
be read back out of it, not even a page of one token by trying every token id.

What it records, besides the tree's own calls (``match_prefix`` with a request,
``lock``, ``unlock``, ``checkpoint``, ``free_kv_row``, ``evict_for_alloc``):
- ``extend``: the scheduler writing newly allocated slots at the end of a request's row
  (the request-to-token pool's ``write``);
- ``release``: the request pool's ``free``, where a request gives its row back;
- the token allocator's ``alloc`` and ``free`` as rows of target ``kv``: nested under
  the tree call that made them, top-level where the scheduler made them.

sglang holds the frees of a batch's results in a free group and gives them to the
allocator at the group's end. The wire records each free where it is asked for, and
counts what a group holds as free (``available_size``): the books a replay keeps free
at once. The group's end gives back what was recorded already, and is not recorded.

A tree over a token allocator (page size 1) is recorded: full attention alone, with a
sliding window (target ``swa``), or with Mamba states (target ``state``: the request
pool's state slots, and the calls that move them outside the tree: ``hold_state`` at
admission, ``drop_state``, a round's ``group_states`` and ``ungroup_states``). A paged
server's tree, one with a host tier, a state pool the wire does not speak (an extra
buffer, a unified memory pool) and one with no ``checkpoint`` (before 0.5.22) are left
alone, with one line on stderr saying why."""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvreplay.families.tree.release import TREE_CLASS, group_taken
from kvreplay.families.tree.runs import to_runs
from kvreplay.families.tree.tree import ROOT

_TAG = "_kvreplay_tree_request"
_MASK = (1 << 63) - 1


def _slots(index: Any) -> list[int]:
    return [int(s) for s in index.reshape(-1).tolist()]


class _LiveSlots:
    """The token allocator's calls in the wire's form: the recorder wraps these, and
    they call the server's allocator with the server's own tensors."""

    def __init__(self, wire: LiveTreeWire) -> None:
        self._wire = wire

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        got = self._wire._alloc_real(int(need_size))
        self._wire._alloc_got = got
        return None if got is None else to_runs(_slots(got))

    def free(self, runs: tuple[int, ...]) -> None:
        self._wire._free_real(self._wire._free_given)


class _LiveWindow:
    """The window side's calls in the wire's form (target ``swa``): an allocation of
    window slots, which the composite allocator's ``alloc`` makes beside the full one,
    and a free of window slots where the composite resolves them through its map (the
    window allocator itself frees them later, at a free group's end)."""

    def __init__(self, wire: LiveTreeWire) -> None:
        self._wire = wire

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        got = self._wire._window_alloc_real(int(need_size))
        self._wire._window_got = got
        return None if got is None else to_runs(_slots(got))

    def free(self, runs: tuple[int, ...]) -> None:
        """Recorded only: the composite already took the slots off its map."""


class _LiveState:
    """A Mamba tree's state slots in the wire's form (target ``state``): the request pool's
    state allocator, one slot per request or node. The wire decides which call each
    allocation and free belongs to (live.py's state shims); these make the real call."""

    def __init__(self, wire: LiveTreeWire) -> None:
        self._wire = wire

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        got = self._wire._state_take(int(need_size))
        self._wire._state_got = got
        return None if got is None else to_runs(_slots(got))

    def free(self, runs: tuple[int, ...]) -> None:
        self._wire._state_free_real(self._wire._state_given)


class LiveTreeWire:
    """The wire in front of a running server's tree."""

    prefix_tree = True
    swa: _LiveWindow | None = None  # a sliding-window tree's window side
    state: _LiveState | None = None  # a Mamba tree's state slots

    def __init__(self, tree: Any) -> None:
        alloc = tree.token_to_kv_pool_allocator
        self.tree, self.allocator, self.rows = tree, alloc, tree.req_to_token_pool
        self.ctor_args = {"size": int(alloc.size), "page_size": int(tree.page_size), "device": "cpu",
                          "need_sort": bool(getattr(alloc, "need_sort", False))}
        # A sliding-window tree (components full and window) over the composite allocator:
        # the full side's frees all reach its inner full allocator (the tree's eviction
        # calls it directly), and the window side's are resolved through the composite's map.
        self.windowed = _windowed(tree)
        full = alloc.full_attn_allocator if self.windowed else alloc
        if self.windowed:
            self.ctor_args.update(size=int(alloc.size_full), swa_size=int(alloc.size_swa),
                                  sliding_window=int(tree.sliding_window_size))
            self.swa = _LiveWindow(self)
            window = alloc.swa_attn_allocator
            self._window_alloc_real = window.alloc
            self._window_got: Any = None
            window.alloc = self._window_alloc_shim
            self._window_resolve = alloc._free_swa_pages_none_cuda
            alloc._free_swa_pages_none_cuda = self._window_free_shim
        self.stateful = _stateful(tree)
        if self.stateful:
            self._wire_states(tree)
        self.full = full
        self.recorded_class = TREE_CLASS
        self.kv = _LiveSlots(self)
        self._secret = os.urandom(16)
        self._numbers = itertools.count(1)
        self._by_kv: dict[int, int] = {}  # id(req.kv) -> request number (ReqKvInfo has no __dict__)
        self._by_row: dict[int, int] = {}  # req_pool_idx -> request number
        self._hashes: dict[int, list[int]] = {}  # request -> the page hashes sent for it
        self._row_len: dict[int, int] = {}  # request -> the row's length as the wire knows it
        self._nodes: dict[int, int] = {int(tree.root_node_handle()): ROOT}
        self._locks: dict[int, tuple[Any, int, int]] = {}  # id(lock) -> (lock, handle, request)
        self._handles = itertools.count(1)
        self._inside = False  # a wire call is running: the tree's calls on itself are its own
        self._realizing = False  # a free group's end: its frees were recorded when asked for
        self._call: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
        self._result: Any = None
        self._alloc_got: Any = None
        self._free_given: Any = None
        names = ("match_prefix", "lock", "unlock", "checkpoint", "free_kv_row", "evict_for_alloc",
                 *(("evict_sliding_windows",) if self.windowed else ()),
                 *(("touch_prefix",) if hasattr(tree, "touch_prefix") else ()))
        real = {name: getattr(tree, name) for name in names}
        self._real = real
        self._alloc_real, self._free_real = alloc.alloc, full.free
        self._group_end = alloc.free_group_end
        self._row_write, self._row_free, self._row_alloc = self.rows.write, self.rows.free, self.rows.alloc
        tree.match_prefix = self._shim("match_prefix", self._match_args)
        tree.lock = self._shim("lock", self._lock_args)
        tree.unlock = self._shim("unlock", self._unlock_args)
        tree.checkpoint = self._shim("checkpoint", self._checkpoint_args)
        tree.free_kv_row = self._free_row_shim
        tree.evict_for_alloc = self._shim("evict", self._evict_args, real="evict_for_alloc")
        if self.windowed:
            tree.evict_sliding_windows = self._shim("slide", self._slide_args, real="evict_sliding_windows")
        if "touch_prefix" in real:
            tree.touch_prefix = self._shim("touch", self._touch_args, real="touch_prefix")
        alloc.alloc, alloc.free_group_end = self._alloc_shim, self._group_end_shim
        full.free = self._free_shim
        self.rows.write, self.rows.free, self.rows.alloc = self._write_shim, self._release_shim, self._rows_shim

    def _wire_states(self, tree: Any) -> None:
        """A Mamba tree: each request holds a state slot (given at admission, or copied from
        a matched node's), a node keeps the state of the sequence it ends, and the
        scheduler takes a round's slots from its state allocator in a group."""
        states = self.rows.mamba_allocator
        part = next(c for c in tree._components_tuple if getattr(c.component_type, "name", "") == "MAMBA")
        self.ctor_args.update(state_size=int(states.size), state_grid=int(part.mamba_checkpoint_grid),
                              state_path_cap=int(part.mamba_max_states_per_path))
        self.state = _LiveState(self)
        self._states = states
        self._state_alloc_real, self._state_free_real = states.alloc, states.free
        self._group_begin_real, self._group_end_real = states.alloc_group_begin, states.alloc_group_end
        self._state_take: Any = self._state_alloc_real
        self._state_got: Any = None
        self._state_given: Any = None
        self._admitting: Any = None  # the requests the request pool is giving rows now
        self._live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        states.alloc, states.free = self._state_alloc_shim, self._state_free_shim
        states.alloc_group_begin, states.alloc_group_end = self._group_begin_shim, self._group_end_states_shim

    # -- numbers and hashes -----------------------------------------------------------------------
    def _request(self, req: Any) -> int:
        n = req.__dict__.get(_TAG)
        if n is None:
            n = req.__dict__[_TAG] = next(self._numbers)
            self._hashes[n], self._row_len[n] = [], 0
            if self.stateful:
                self._live[n] = req
        self._by_kv[id(req.kv)] = n
        if req.kv.req_pool_idx is not None:
            self._by_row[int(req.kv.req_pool_idx)] = n
        return n

    def _node(self, node_id: Any) -> int:
        n = self._nodes.get(int(node_id))
        if n is None:
            n = self._nodes[int(node_id)] = len(self._nodes)
        return n

    def _pages(self, n: int, tokens: Any, upto: int) -> tuple[int, ...]:
        """Hashes of the request's full pages below ``upto`` tokens not sent before."""
        sent, ps = self._hashes[n], int(self.ctor_args["page_size"])
        new = []
        prev = sent[-1] if sent else 0
        for p in range(len(sent), int(upto) // ps):
            page = tokens[p * ps:(p + 1) * ps]
            h = hashlib.blake2b(struct.pack(f"<q{len(page)}q", prev, *page), digest_size=8, key=self._secret)
            prev = int.from_bytes(h.digest(), "little") & _MASK
            new.append(prev)
        sent.extend(new)
        return tuple(new)

    # -- the shims: the server's calls, recorded as the wire's ------------------------------------
    @contextmanager
    def _wire_call(self) -> Iterator[None]:
        """Inside: a wire call is running, and the tree's calls on itself are its own."""
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def _shim(self, wire_name: str, wire_args: Any, real: str | None = None) -> Any:
        original = self._real[real or wire_name]

        def live(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return original(*args, **kwargs)
            wire = wire_args(args, kwargs)
            if wire is None:  # not a call the wire records (a match for no request, an unlock of None)
                return original(*args, **kwargs)
            self._call, self._result = (args, kwargs), None
            with self._wire_call():
                getattr(self, wire_name)(**wire)  # looked up per call: the recorder wraps it
            return self._result

        live.__wrapped__ = original  # type: ignore[attr-defined]
        return live

    def _match_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        params = args[0] if args else kwargs["params"]
        req = getattr(params, "req", None)
        if req is None:
            return None
        n = self._request(req)
        length = len(params.key)
        out = {"request": n, "pages": self._pages(n, params.key.token_ids, length), "length": length}
        if self.stateful:  # the scheduler's own match copies the node's state; a policy's look does not
            out["cow"] = int(bool(getattr(params, "cow_mamba", False)))
        return out

    def _touch_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        key = args[0] if args else kwargs["key"]
        req = _caller_request(sys._getframe(2))
        if req is None:
            return None
        n = self._request(req)
        length = len(key)
        return {"request": n, "pages": self._pages(n, key.token_ids, length), "length": length}

    def _lock_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        node = args[0] if args else kwargs["node_id"]
        req = _caller_request(sys._getframe(2))
        return {"request": 0 if req is None else self._request(req), "node": self._node(node)}

    def _unlock_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        lock = args[0] if args else kwargs.get("lock")
        held = None if lock is None else self._locks.get(id(lock))
        if held is None:
            return None
        return {"request": held[2], "handle": held[1]}

    def _checkpoint_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        req = args[0] if args else kwargs["req"]
        up_to = int(kwargs["up_to"]) if "up_to" in kwargs else int(args[1])
        n = self._request(req)
        out = {"request": n, "pages": self._pages(n, req.full_untruncated_fill_ids, up_to), "up_to": up_to}
        # a finished request's output count: a release before 0.5.6 derives what it caches from it
        if req.finished():
            out["outputs"] = len(req.output_ids)
        return out

    def _evict_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        params = args[0] if args else kwargs["params"]
        out = {"num_tokens": int(params.num_tokens)}
        if self.windowed:
            out["swa_num_tokens"] = int(getattr(params, "swa_num_tokens", 0) or 0)
        if self.stateful:
            out["state_num"] = int(getattr(params, "mamba_num", 0) or 0)
        return out

    def _slide_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        req = args[0] if args else kwargs["req"]
        pre_len = int(args[1]) if len(args) > 1 else int(kwargs["pre_len"])
        return {"request": self._request(req), "pre_len": pre_len,
                "interval": int(kwargs.get("eviction_interval", 1))}

    def _window_alloc_shim(self, need_size: int, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._window_alloc_real(need_size, *args, **kwargs)
        self._window_got = None
        self.swa.alloc(need_size=int(need_size))
        return self._window_got

    def _window_free_shim(self, full_slots: Any) -> Any:
        window = self._window_resolve(full_slots)
        if window.numel():
            self.swa.free(runs=to_runs(_slots(window)))
        return window

    def _free_row_shim(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        original = self._real["free_kv_row"]
        n = self._by_kv.get(id(kv))
        if self._inside or n is None:
            return original(kv, ranges)
        for start, end in ranges:
            self._call = ((kv, [(start, end)]), {})
            with self._wire_call():
                self.free_kv_row(request=n, start=int(start), end=int(end))
        return None

    def _alloc_shim(self, need_size: int, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._alloc_real(need_size, *args, **kwargs)
        self._alloc_got = None
        self.kv.alloc(need_size=int(need_size))
        return self._alloc_got

    def _free_shim(self, index: Any) -> None:
        if self._realizing or index.numel() == 0:
            return self._free_real(index)
        self._free_given = index
        self.kv.free(runs=to_runs(_slots(index)))
        self._free_given = None
        return None

    def _group_end_shim(self) -> None:
        self._realizing = True
        try:
            self._group_end()
        finally:
            self._realizing = False

    # -- a Mamba tree's state slots ---------------------------------------------------------------
    def _state_alloc_shim(self, need_size: int, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._state_alloc_real(need_size, *args, **kwargs)
        self._state_got = None
        if self._inside:  # the tree's own (a copy-on-write at a match, a checkpoint's copy)
            self.state.alloc(need_size=int(need_size))
            return self._state_got
        reqs = self._admitting
        held = None if reqs is None or int(need_size) != 1 else next(
            (r for r in reqs if getattr(r.kv, "mamba_pool_idx", None) is None), None)
        if held is None:  # not the request pool's: recorded as the allocator's own
            self.state.alloc(need_size=int(need_size))
            return self._state_got
        self._call = ((), {})
        with self._wire_call():
            self.hold_state(request=self._request(held))
        return self._state_got

    def _state_free_shim(self, index: Any) -> Any:
        if index.numel() == 0:
            return self._state_free_real(index)
        self._state_given = index
        try:
            slots = _slots(index)
            holder = None if self._inside or len(slots) != 1 else self._holder(slots[0])
            if holder is None:
                self.state.free(runs=to_runs(slots))
                return None
            with self._wire_call():
                self.drop_state(request=holder)
        finally:
            self._state_given = None
        return None

    def _holder(self, slot: int) -> int | None:
        """The request whose state slot this is (its release without a checkpoint, or a
        waiting request's copy given back), if a request holds it."""
        for n, req in list(self._live.items()):
            idx = getattr(req.kv, "mamba_pool_idx", None)
            if idx is not None and int(idx) == slot:
                return n
        return None

    def _group_begin_shim(self, num_reqs: int) -> Any:
        if int(num_reqs) <= 0 or self._inside:
            return self._group_begin_real(num_reqs)
        self._call = ((num_reqs,), {})
        with self._wire_call():
            self.group_states(need_size=int(num_reqs))
        return None

    def _group_end_states_shim(self) -> Any:
        if self._states._alloc_iter is None or self._inside:
            return self._group_end_real()
        with self._wire_call():
            self.ungroup_states()
        return None

    def _rows_shim(self, reqs: Any, *args: Any, **kwargs: Any) -> Any:
        self._admitting = reqs if self.stateful else None
        try:
            got = self._row_alloc(reqs, *args, **kwargs)
        finally:
            self._admitting = None
        if got is not None:
            for req in reqs:  # the rows the scheduler writes next belong to these requests
                if getattr(req, "kv", None) is not None and req.kv.req_pool_idx is not None:
                    self._request(req)
        return got

    def _write_shim(self, indices: Any, values: Any) -> None:
        self._row_write(indices, values)
        if self._inside:  # a checkpoint rewriting the row with the tree's slots
            return
        rows, where = indices
        if isinstance(where, slice):  # a prefill: (row, slice(start, end))
            self._extend_at(int(rows), int(where.start or 0), _slots(values))
        else:  # a decode step: (rows, positions), one slot each
            for row, pos, slot in zip(_slots(rows), _slots(where), _slots(values), strict=False):
                self._extend_at(row, pos, [slot])

    def _extend_at(self, row: int, start: int, slots: list[int]) -> None:
        n = self._by_row.get(row)
        if n is None or not slots or start != self._row_len[n]:
            return  # a row the wire does not know, or the matched prefix written again
        self._row_len[n] = start + len(slots)
        self.extend(request=n, runs=to_runs(slots))

    def _release_shim(self, req: Any) -> None:
        n = req.__dict__.pop(_TAG, None)
        self._call = ((req,), {})
        if n is None:
            return self._row_free(req)
        if req.kv.req_pool_idx is not None:
            self._by_row.pop(int(req.kv.req_pool_idx), None)
        self._by_kv.pop(id(req.kv), None)
        self._hashes.pop(n, None)
        self._row_len.pop(n, None)
        if self.stateful:  # a state slot it still names is the tree's now, or free
            self._live.pop(n, None)
        self.release(request=n)
        return None

    # -- the wire's calls, served by the server's own objects -------------------------------------
    def _pass(self, name: str) -> Any:
        args, kwargs = self._call
        self._result = self._real[name](*args, **kwargs)
        return self._result

    def match_prefix(self, request: int, pages: tuple[int, ...], length: int, cow: int | None = None
                     ) -> tuple[int, int]:
        got = self._pass("match_prefix")
        self._row_len[request] = int(got.device_prefix_len)
        return (int(got.device_prefix_len), self._node(got.last_device_node))

    def touch(self, request: int, pages: tuple[int, ...], length: int) -> None:
        """The scheduler refreshes a waiting request's cached prefix in the tree's LRU (the
        walk also splits the node the key ends inside)."""
        self._pass("touch_prefix")

    def lock(self, request: int, node: int) -> int:
        lock = self._pass("lock")
        if lock is None:
            return 0
        handle = next(self._handles)
        self._locks[id(lock)] = (lock, handle, request)
        return handle

    def unlock(self, request: int, handle: int) -> None:
        args, _ = self._call
        self._locks.pop(id(args[0] if args else None), None)
        self._pass("unlock")

    def checkpoint(self, request: int, pages: tuple[int, ...], up_to: int,
                   outputs: int | None = None) -> tuple[int, int, int]:
        args, kwargs = self._call
        req = args[0] if args else kwargs["req"]
        old = req.lock
        self._pass("checkpoint")
        if req.lock is not old:
            self._locks.pop(id(old), None)
            if req.lock is not None:
                self._locks[id(req.lock)] = (req.lock, next(self._handles), request)
        held = self._locks.get(id(req.lock)) if req.lock is not None else None
        node = self._node(req.last_node) if req.last_node is not None else ROOT
        return (int(req.kv.cache_protected_len), node, 0 if held is None else held[1])

    def extend(self, request: int, runs: tuple[int, ...]) -> None:
        """Recorded only: the scheduler already wrote the row."""

    def free_kv_row(self, request: int, start: int, end: int) -> None:
        self._pass("free_kv_row")

    def release(self, request: int) -> None:
        args, _ = self._call
        self._row_free(args[0])

    def evict(self, num_tokens: int, swa_num_tokens: int | None = None, state_num: int | None = None) -> int:
        return int(self._pass("evict_for_alloc").num_tokens_evicted)

    def slide(self, request: int, pre_len: int, interval: int = 1) -> None:
        """The window moved past the request's oldest slots: their window slots go back."""
        self._pass("evict_sliding_windows")

    def hold_state(self, request: int) -> None:
        """The request pool gives an admitted request its state slot (nested ``state.alloc``)."""
        self.state.alloc(need_size=1)

    def drop_state(self, request: int) -> None:
        """A request's state slot goes back outside the tree's calls: a waiting request's
        copy when it is not admitted, or a request released without a checkpoint."""
        self.state.free(runs=to_runs(_slots(self._state_given)))

    def group_states(self, need_size: int) -> None:
        """A scheduling round takes ``need_size`` state slots at once, if it can; the round's
        allocations draw on them (nested ``state.alloc``: the slots the group took)."""
        taken = group_taken(self._states, self._group_begin_real, need_size)
        if taken is not None:
            self._state_take = lambda need: taken
            try:
                self.state.alloc(need_size=int(taken.numel()))
            finally:
                self._state_take = self._state_alloc_real

    def ungroup_states(self) -> None:
        """The round gives back the state slots its group did not hand out (nested ``state.free``)."""
        self._group_end_real()

    # -- the counters a row carries ---------------------------------------------------------------
    def available_size(self) -> int:
        """The full side's free slots, with those a free group holds (a window tree's
        composite reads the smaller side's, which counts for neither)."""
        pending = self.full.free_group or ()
        return int(self.full.available_size()) + sum(int(t.numel()) for t in pending)

    def evictable_size(self) -> int:
        return int(self.tree.evictable_size())

    def protected_size(self) -> int:
        return int(self.tree.protected_size())


def _caller_request(frame: Any) -> Any:
    """The Request the scheduler is locking a node for: sglang's ``lock`` takes a node,
    and the scheduler's admission holds the request in a local named ``req``."""
    for _ in range(4):
        if frame is None:
            return None
        req = frame.f_locals.get("req")
        if req is not None and hasattr(req, "kv") and hasattr(req, "__dict__"):
            return req
        frame = frame.f_back
    return None


def wire_for(obj: Any) -> LiveTreeWire | None:
    """What a recording of an engine object records: the wire before sglang's tree."""
    cls = type(obj)
    if f"{cls.__module__}:{cls.__qualname__}" != TREE_CLASS:
        return None
    why = _not_recorded(obj)
    if why:
        print(f"kvreplay: not recording the prefix cache in process {os.getpid()}: {why}", file=sys.stderr,
              flush=True)
        return None
    return LiveTreeWire(obj)


def _parts(tree: Any) -> list[str]:
    return [getattr(c, "name", str(c)) for c in getattr(tree, "tree_components", ())]


def _windowed(tree: Any) -> bool:
    return _parts(tree) == ["FULL", "SWA"]


def _stateful(tree: Any) -> bool:
    return _parts(tree) == ["FULL", "MAMBA"]


def _states_not_recorded(tree: Any) -> str:
    """Why a Mamba tree's state side is not one the wire speaks ("": it is)."""
    rows = tree.req_to_token_pool
    states = getattr(rows, "mamba_allocator", None)
    if type(states).__name__ != "MambaSlotAllocator" or not hasattr(states, "free_slots"):
        return "its state allocator is not sglang's plain slot list (a unified memory pool's is not recorded yet)"
    if getattr(tree, "enable_mamba_extra_buffer", False):
        return "it keeps Mamba states in an extra (ping-pong) buffer, which the tree wire does not record yet"
    if getattr(rows, "mamba_ckpt_pool", None) is not None:
        return "it keeps int8 Mamba checkpoints, which the tree wire does not record"
    if getattr(getattr(rows, "mamba_pool", None), "replayssm_write_pos", None) is not None:
        return "its Mamba states replay from a ring (ReplaySSM), which the tree wire does not record"
    if os.environ.get("SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK", "").lower() in ("1", "true", "yes"):
        return "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK is set, which the tree wire does not record"
    return ""


def _not_recorded(tree: Any) -> str:
    """Why the wire leaves a server's tree alone ("": it records it). A tree with a
    component the wire does not speak frees slots through it, and a host
    tier moves slots it has no owner for: recorded as what it is not, such a server
    would show slots lost that are not."""
    if not hasattr(tree, "checkpoint") or int(getattr(tree, "page_size", 1)) != 1:
        return "the tree wire records sglang 0.5.22+ with page size 1 only"
    parts = _parts(tree)
    if _stateful(tree):
        why = _states_not_recorded(tree)
        if why:
            return why
    elif _windowed(tree):
        alloc = tree.token_to_kv_pool_allocator
        if not hasattr(alloc, "_free_swa_pages_none_cuda") or getattr(alloc, "_swa_req_ring", None):
            return "its sliding-window allocator is not one the tree wire speaks (0.5.23's, without a ring)"
    elif any(p != "FULL" for p in parts):
        return (f"its components are {', '.join(parts)}; the tree wire records full attention alone, with a "
                "sliding window, or with Mamba states")
    if getattr(tree, "cache_controller", None) is not None:
        return "it has a hierarchical (host) tier, which the tree wire does not record"
    return ""


__all__ = ["LiveTreeWire", "wire_for"]
