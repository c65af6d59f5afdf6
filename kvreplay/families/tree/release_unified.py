"""A release's ``UnifiedRadixCache`` from before the wire's era (sglang 0.5.19 to
0.5.21) as a build of the tree family, for a plain model (the full-attention component).

From 0.5.19 a plain model's server runs the unified tree. Its requests already keep
their KV books in a ``ReqKvInfo`` (``req.kv``) and give slots back through
``free_kv_row``, as the wire's era does, but the tree is still released in one call:
``cache_finished_req`` (insert, free the duplicates and the unaligned tail, drop the
lock) and ``cache_unfinished_req`` for a chunk (insert, match again, move the lock).
Locks are ``inc_lock_ref`` and ``dec_lock_ref`` on a node id. The wire's calls map onto
them as for the plain trees before (release_radix.py): ``lock`` and ``unlock`` on the
handle's node, a checkpoint without ``outputs`` a chunk's, with ``outputs`` a finished
request's, followed by a match and a lock so that the sizes read after the call mean
what they mean in the wire's era. 0.5.20 also re-inserts a finished request's prompt as
a node of its own (topology only: the books do not move). 0.5.21 splits the finished
request's release as the wire's era does: ``insert_req`` inserts only, and the caller
frees the row (``free_kv_row``) and drops the lock (``unpin``); the wire's checkpoint is
``insert_req``, after which the lock moves to the new last node, and its ``unlock`` is
the release's ``dec_lock_ref`` with the receipt, as ``unpin`` is."""

from __future__ import annotations

import os
from array import array
from typing import Any

import torch

from kvreplay.errors import BuildUnsupported
from kvreplay.families.tree.release import ERAS, ReleaseTree, prompt_length

_BACKEND = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


class _Request:
    """What the unified tree of these releases reads of a request."""

    extra_key = cache_salt = session_id = session = kv_rotation_base = finished_reason = None
    swa_uuid_for_lock = skip_lock_node_ids = lock_receipt = None
    swa_prefix_lock_released = False
    priority = 0

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.handle = 0
        self.last_node: Any = None
        self.pages: list[int] = []
        self.fill_ids = array("q")
        self.origin_input_ids = array("q")
        self.output_ids = array("q")
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)

    def get_fill_ids(self) -> array:
        return self.fill_ids

    def finished(self) -> bool:
        return False


class UnifiedRelease(ReleaseTree):
    """sglang 0.5.19 to 0.5.21's ``UnifiedRadixCache`` behind the wire (``sglang==X``)."""

    def __init__(self, cls: type, ctor: dict[str, Any]) -> None:
        self._insert_req = hasattr(cls, "insert_req")  # 0.5.21: the caller frees and unpins
        super().__init__(cls, ctor)  # its _locks: handle -> (the node id it locked, the release's receipt)

    def _check_era(self, cls: type, batch: Any) -> None:
        if (hasattr(cls, "checkpoint") or not (self._insert_req or hasattr(cls, "cache_finished_req"))
                or not hasattr(batch, "ReqKvInfo") or not hasattr(cls, "root_node_handle")):
            raise BuildUnsupported(f"{cls.__module__}.{cls.__name__}: {ERAS}")

    def _make_tree(self, cls: type, params: dict[str, Any]) -> Any:
        """The tree on the Python tree core (the releases' default too): chosen by the
        environment here, not by a parameter."""
        before = os.environ.get(_BACKEND)
        os.environ[_BACKEND] = "python"
        try:
            return cls(self._sg["cache_init_params"].CacheInitParams(**params))
        finally:
            if before is None:
                os.environ.pop(_BACKEND, None)
            else:
                os.environ[_BACKEND] = before

    def _request(self, number: int) -> _Request:
        req = self.requests.get(number)
        if req is None:
            req = self.requests[number] = _Request(self._kv_info())
        return req

    def _lock_at(self, req: _Request, node_id: int) -> int:
        got = self.tree.inc_lock_ref(node_id)
        req.last_node = node_id
        req.swa_uuid_for_lock = getattr(got, "swa_uuid_for_lock", None)
        req.skip_lock_node_ids = getattr(got, "skip_lock_node_ids", None)
        # 0.5.20 releases a lock with the receipt its acquire returned
        req.lock_receipt = got.to_dec_params() if hasattr(got, "to_dec_params") else None
        return self._held(req)

    def _held(self, req: _Request) -> int:
        """A new handle for the lock the request holds now (on its last node)."""
        handle = next(self._handles)
        self._locks[handle] = (int(req.last_node), req.lock_receipt)
        req.handle = handle
        return handle

    def _match(self, req: _Request, n: int) -> tuple[int, int]:
        sg = self._sg
        key = sg["radix_cache"].RadixKey(self.token_ids(req, n))
        got = self.tree.match_prefix(sg["base_prefix_cache"].MatchPrefixParams(key=key, req=req))
        return int(got.device_indices.numel()), int(got.last_device_node)

    # -- the wire's calls -------------------------------------------------------------------------
    def match_prefix(self, request: int, pages: tuple[int, ...], length: int) -> tuple[int, int]:
        req = self._request(int(request))
        req.pages.extend(int(p) for p in pages)
        matched, node = self._match(req, int(length))
        req.last_node = node
        req.kv.cache_protected_len = matched
        row = self._row(req)
        row[:] = self.path_slots(self._number(node))[:matched]
        req.prefix_indices = torch.tensor(row, dtype=torch.int64)
        return (matched, self._number(node))

    def lock(self, request: int, node: int) -> int:
        node_id = self._node_id.get(int(node))
        if node_id is None:
            raise ValueError(f"node {node} was never named")
        return self._lock_at(self._request(int(request)), node_id)

    def unlock(self, request: int, handle: int) -> None:
        held = self._locks.pop(int(handle), None)
        if held is None:
            return
        self._unlock_held(held)
        req = self.requests.get(int(request))
        if req is not None and req.handle == int(handle):
            req.handle = 0

    def _unlock_held(self, held: tuple[int, Any]) -> None:
        node_id, receipt = held
        if receipt is None:
            self.tree.dec_lock_ref(node_id)
        else:
            self.tree.dec_lock_ref(node_id, receipt)

    def checkpoint(self, request: int, pages: tuple[int, ...], up_to: int,
                   outputs: int | None = None) -> tuple[int, int, int]:
        req = self._request(int(request))
        req.pages.extend(int(p) for p in pages)
        up_to = int(up_to)
        tokens = self.token_ids(req, up_to)
        held = self._locks.pop(req.handle, None)  # cache_*_req drop the request's lock themselves
        if outputs is None:
            req.fill_ids = tokens
            self.tree.cache_unfinished_req(req, chunked=True)
            handle = self._held(req)
            return (int(req.kv.cache_protected_len), self._number(req.last_node), handle)
        # the request's token lists, from its output count (as release_radix.py gives them)
        prompt = prompt_length(up_to, int(outputs))
        req.origin_input_ids = req.fill_ids = tokens[:prompt]
        req.output_ids = tokens[prompt:] + array("q", [-1] if int(outputs) > 0 else [])
        req.kv.kv_committed_len = up_to
        if not self._insert_req:
            with self.finished_release(self._row(req), up_to):
                self.tree.cache_finished_req(req, kv_len_to_handle=up_to)
        else:  # insert only: the wire's free_kv_row and unlock follow, as the release's did
            self.tree.insert_req(req, up_to=up_to)
        matched, node = self._match(req, up_to)
        row = self._row(req)
        row[:matched] = self.path_slots(self._number(node))[:matched]
        req.kv.cache_protected_len = matched
        handle = self._lock_at(req, node)
        if self._insert_req and held is not None:  # the wire's era moves the lock: the old one goes
            self._unlock_held(held)
        return (matched, self._number(node), handle)

    # -- what the checker reads -------------------------------------------------------------------
    def path_slots(self, node: int) -> list[int]:
        n = self._node(node)
        parts = []
        while n is not None and n.parent is not None:
            full = self._full(n)
            parts.append([] if full.value is None else full.value.tolist())
            n = n.parent
        return [s for part in reversed(parts) for s in part]


def unified_release(cls: type, ctor: dict[str, Any]) -> UnifiedRelease:
    return UnifiedRelease(cls, ctor)


__all__ = ["UnifiedRelease", "unified_release"]
