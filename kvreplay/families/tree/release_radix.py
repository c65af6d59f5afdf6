"""A release's ``RadixCache`` from before the wire's era (sglang 0.5.1 to 0.5.18) as a
build of the tree family, spoken to in the wire's plain values.

Those releases have no ``checkpoint``, ``free_kv_row`` or lock handles. A finished
request is released in one call, ``cache_finished_req``: insert the row, free the
duplicates, drop the lock. A prefill chunk is ``cache_unfinished_req``: insert, free
the duplicates, match again and move the lock to the new last node. Locks are
``inc_lock_ref`` and ``dec_lock_ref`` on a node. The wire's calls map onto them:

- ``lock`` and ``unlock`` are ``inc_lock_ref`` and ``dec_lock_ref`` on the node the
  handle was taken on (handles are this build's, numbered as the wire numbers them);
- a ``checkpoint`` without ``outputs`` is a chunk's, ``cache_unfinished_req``;
- a ``checkpoint`` with ``outputs`` is a finished request's, ``cache_finished_req``.
  These releases work out what to cache from the request's token lists
  (``origin_input_ids + output_ids``), so the request is given ``outputs`` output
  tokens. The wire's era then moves the request's lock to its new last node until the
  ``unlock`` that follows; this build does the same after ``cache_finished_req`` (a
  match and an ``inc_lock_ref``), so that the sizes read after each call mean what they
  mean in the recording;
- ``free_kv_row`` frees that part of the request's row, as the scheduler did.

A trace recorded before the wire carried ``outputs`` replays every checkpoint as a
chunk's: the books are the same on a correct release, but ``cache_finished_req`` (and
a bug in it) is not reached.

The releases' signatures moved in steps, each met here by what the release offers:
0.5.6 builds the tree from a ``CacheInitParams`` and reads the request's
``cache_protected_len`` and ``pop_committed_kv_cache()``; 0.5.8 matches with a
``MatchPrefixParams``; 0.5.9 evicts with an ``EvictParams``; 0.5.10's lock calls return
objects (unread here); 0.5.14 asks the request for ``get_fill_ids()``; 0.5.16 tells
``cache_finished_req`` how much of the row to handle. From 0.5.11 the release also has
the unified tree, but a plain model's server ran ``RadixCache`` up to 0.5.18, and so does
this build. A request's ``fill_ids`` are what its last prefill covered, which
this build takes to be its prompt: 0.5.6 to 0.5.8.post1 keyed a finished request's
insert by them."""

from __future__ import annotations

import importlib
import inspect
import itertools
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

from kvreplay.errors import BuildUnloadable, BuildUnsupported
from kvreplay.families.tree.release import ERAS, ROOT, UNNAMED, BehindTheWire, ReleaseRows, WireSlots, prompt_length
from kvreplay.families.tree.runs import from_runs

FILLER = -1  # the last output token: it has no slot and is never keyed (the release drops it)


class _Request:
    """What a RadixCache of these releases reads of a request."""

    extra_key = cache_salt = session_id = None  # cache_salt keys the tree from 0.5.18
    last_matched_prefix_len = 0
    priority = 0

    def __init__(self) -> None:
        self.pages: list[int] = []  # the hashes of the full pages the wire named
        self.origin_input_ids: list[int] = []
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.req_pool_idx: int | None = None
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.last_node: Any = None
        self.handle = 0
        self.protected = 0
        self.cache_protected_len = 0  # 0.5.6 on: what of the row the tree already holds
        self.kv_committed_len = 0

    def pop_committed_kv_cache(self) -> int:
        return self.kv_committed_len

    def get_fill_ids(self) -> list[int]:  # 0.5.14 on
        return self.fill_ids


class RadixRelease(BehindTheWire):
    """sglang 0.5.1 to 0.5.18's ``RadixCache`` behind the wire (``sglang==X``)."""

    def __init__(self, cls: type, ctor: dict[str, Any]) -> None:
        try:
            token = importlib.import_module("sglang.srt.mem_cache.allocator").TokenToKVPoolAllocator
            cls = _plain_tree(cls)
            module = importlib.import_module(cls.__module__)
        except ModuleNotFoundError as exc:
            raise BuildUnloadable(f"sglang's tree does not import here: it needs {exc.name}, which this "
                                  "environment lacks (run kvreplay beside sglang's dependencies)") from None
        self._key = getattr(module, "RadixKey", None)  # a key object from 0.5.3; a token list before
        # the era's parameter objects, as the tree's module imported them (0.5.8, 0.5.9)
        self._match_params = _takes_params(cls.match_prefix) and getattr(module, "MatchPrefixParams", None)
        self._evict_params = _takes_params(cls.evict) and getattr(module, "EvictParams", None)
        # 0.5.16 on: the caller says how much of the row a finished request's release handles
        self._kv_len = "kv_len_to_handle" in inspect.signature(cls.cache_finished_req).parameters
        init = list(inspect.signature(cls.__init__).parameters)
        if cls.__name__ != "RadixCache" or ("req_to_token_pool" not in init and not hasattr(module, "CacheInitParams")):
            raise BuildUnsupported(f"{cls.__module__}.{cls.__name__}: {ERAS}")
        size = int(ctor["size"])
        # the tree keys whole pages; the wire's allocator hands out token slots at any page size
        self.page_size = int(ctor.get("page_size") or 1)
        self.ctor_args = {"size": size, "page_size": self.page_size, "device": "cpu",
                          "need_sort": bool(ctor.get("need_sort", True))}
        self.allocator = token(size, torch.int64, "cpu", None, self.ctor_args["need_sort"])
        self.rows = ReleaseRows()
        pools = {"req_to_token_pool": self.rows, "token_to_kv_pool_allocator": self.allocator,
                 "page_size": self.page_size}
        if "req_to_token_pool" in init:
            self.tree = cls(**pools)
        else:  # 0.5.6 on: one parameter object
            self.tree = cls(module.CacheInitParams(disable=False, **pools))
        self.kv = WireSlots(self.allocator)
        self.requests: dict[int, _Request] = {}
        self._row_ids = itertools.count(1)
        root = self.tree.root_node
        self._node_number: dict[int, int] = {int(root.id): ROOT}
        self._nodes: dict[int, Any] = {ROOT: root}
        self._locks: dict[int, Any] = {}  # handle -> the node it locked
        self._handles = itertools.count(1)

    # -- numbers ----------------------------------------------------------------------------------
    def _number(self, node: Any) -> int:
        n = self._node_number.get(int(node.id))
        if n is None:
            n = self._node_number[int(node.id)] = len(self._node_number)
            self._nodes[n] = node
        return n

    def _lock(self, req: _Request, node: Any) -> int:
        self.tree.inc_lock_ref(node)
        handle = next(self._handles)
        self._locks[handle] = node
        req.handle, req.last_node = handle, node
        return handle

    def _request(self, number: int) -> _Request:
        req = self.requests.get(number)
        if req is None:
            req = self.requests[number] = _Request()
        return req

    def _row(self, req: _Request) -> list[int]:
        if req.req_pool_idx is None:
            req.req_pool_idx = next(self._row_ids)
            self.rows.rows[req.req_pool_idx] = []
        return self.rows.rows[req.req_pool_idx]

    def _tokens(self, req: _Request, n: int) -> list[int]:
        """The request's first ``n`` tokens as the tree keys them (``token_ids``), as the
        list these releases key by."""
        return self.token_ids(req, n).tolist()

    def _held(self, node: Any) -> int:
        """How many tokens the path from the root to ``node`` holds: what a request locked
        there holds of the tree."""
        held = 0
        while node is not None and node.parent is not None:
            held += int(node.value.shape[0])
            node = node.parent
        return held

    def _k(self, tokens: list[int]) -> Any:
        return list(tokens) if self._key is None else self._key(list(tokens), None)

    def _match(self, tokens: list[int]) -> tuple[list[int], Any]:
        key = self._k(tokens)
        got = self.tree.match_prefix(self._match_params(key=key) if self._match_params else key)
        return got.device_indices.tolist(), got.last_device_node

    # -- the wire's calls -------------------------------------------------------------------------
    def match_prefix(self, request: int, pages: tuple[int, ...], length: int) -> tuple[int, int]:
        req = self._request(int(request))
        req.pages.extend(int(h) for h in pages)
        slots, node = self._match(self._tokens(req, int(length)))
        req.last_node, req.protected = node, len(slots)
        # from here the release keeps these itself (a partial page rides on prefix_indices)
        req.prefix_indices = torch.tensor(slots, dtype=torch.int64)
        req.last_matched_prefix_len = req.cache_protected_len = len(slots)
        self._row(req)[:] = slots
        return (len(slots), self._number(node))

    def lock(self, request: int, node: int) -> int:
        at = self._nodes.get(int(node))
        if at is None:
            raise ValueError(f"node {node} was never named")
        return self._lock(self._request(int(request)), at)

    def unlock(self, request: int, handle: int) -> None:
        node = self._locks.pop(int(handle), None)
        if node is None:
            return
        self.tree.dec_lock_ref(node)
        req = self.requests.get(int(request))
        if req is not None and req.handle == int(handle):
            req.handle = 0

    def extend(self, request: int, runs: tuple[int, ...]) -> None:
        self._row(self._request(int(request))).extend(from_runs(runs))

    def checkpoint(self, request: int, pages: tuple[int, ...], up_to: int,
                   outputs: int | None = None) -> tuple[int, int, int]:
        req = self._request(int(request))
        req.pages.extend(int(h) for h in pages)
        row, up_to = self._row(req), int(up_to)
        tokens = self._tokens(req, up_to)
        self._locks.pop(req.handle, None)  # both calls drop the request's lock themselves
        if outputs is None:
            req.fill_ids = tokens
            self.tree.cache_unfinished_req(req)
            req.protected = self._held(req.last_node)
            handle = next(self._handles)
            self._locks[handle] = req.last_node
            req.handle = handle
            return (req.protected, self._number(req.last_node), handle)
        # the request's token lists, from its output count: the last output token has no slot
        prompt = prompt_length(up_to, int(outputs))
        req.origin_input_ids = req.fill_ids = tokens[:prompt]
        req.output_ids = tokens[prompt:] + ([FILLER] if int(outputs) > 0 else [])
        req.kv_committed_len = up_to
        with self.finished_release(row, up_to):
            if self._kv_len:
                self.tree.cache_finished_req(req, kv_len_to_handle=up_to)
            else:
                self.tree.cache_finished_req(req)
        slots, node = self._match(tokens)
        row[:len(slots)] = slots
        req.protected = len(slots)
        return (req.protected, self._number(node), self._lock(req, node))

    def free_kv_row(self, request: int, start: int, end: int) -> None:
        row = self._row(self._request(int(request)))
        slots = row[int(start):int(end)]
        if slots:
            self.allocator.free(torch.tensor(slots, dtype=torch.int64))

    def release(self, request: int) -> None:
        req = self.requests.pop(int(request), None)
        if req is not None and req.req_pool_idx is not None:
            self.rows.rows.pop(req.req_pool_idx, None)

    def evict(self, num_tokens: int) -> int:
        before = self.available_size()
        self.tree.evict(self._evict_params(num_tokens=int(num_tokens)) if self._evict_params else int(num_tokens))
        return self.available_size() - before

    # -- what the checker reads -------------------------------------------------------------------
    def path(self, node: int) -> list[tuple[int, int, int]]:
        out = []
        n = self._nodes.get(int(node))
        while n is not None and n.parent is not None:
            ident = self._node_number.get(int(n.id), UNNAMED + int(n.id))
            out.append((ident, int(n.lock_ref), int(n.value.shape[0])))  # not len(): Python code per node
            n = n.parent
        return out

    def path_slots(self, node: int) -> list[int]:
        n = self._nodes.get(int(node))
        parts = []
        while n is not None and n.parent is not None:
            parts.append(n.value.tolist())
            n = n.parent
        return [s for part in reversed(parts) for s in part]

    def locked_slots(self) -> set[int]:
        out: set[int] = set()
        stack = [self.tree.root_node]
        while stack:
            n = stack.pop()
            if n.parent is not None and n.lock_ref > 0:
                out.update(n.value.tolist())
            stack.extend(n.children.values())
        return out


def plain_model_ran_radix() -> bool:
    """Did a plain model's server of the installed release run ``RadixCache``? Up to
    0.5.18 it did (the unified tree, from 0.5.11, was for hybrids or opt-in); from 0.5.19
    it runs the unified tree."""
    release = str(getattr(importlib.import_module("sglang"), "__version__", ""))
    try:
        return Version(release) < Version("0.5.19")
    except InvalidVersion:
        return False


def _plain_tree(cls: type) -> type:
    """The release's tree for a plain model: ``RadixCache`` up to 0.5.18, also where the
    release has the unified tree (the family's first choice)."""
    if cls.__name__ == "RadixCache":
        return cls
    if not plain_model_ran_radix() or hasattr(cls, "checkpoint"):
        raise BuildUnsupported(f"{cls.__module__}.{cls.__name__}: {ERAS}")
    return importlib.import_module("sglang.srt.mem_cache.radix_cache").RadixCache


def _takes_params(method: Any) -> bool:
    """Does this tree method take one parameter object (``params``), as from 0.5.8?"""
    return list(inspect.signature(method).parameters)[1:2] == ["params"]


__all__ = ["RadixRelease", "plain_model_ran_radix"]
