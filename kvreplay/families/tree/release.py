"""sglang's own prefix cache as a build of the tree family: a release's
``UnifiedRadixCache`` (0.5.22 and later: ``checkpoint``, ``free_kv_row``, lock handles)
over its token allocator, spoken to in the wire's plain values.

The wire names requests by number and keys by page hashes; sglang's tree takes Request
objects and token ids. Each request number gets a stand-in holding what the tree reads
of a request (its ``ReqKvInfo``, its lock, its last node, its token ids). A page hash
becomes token ids here (``BehindTheWire.token_ids``), the same hash the same ids, so
equal prefixes stay equal and a match finds what the recording's found; no token id of
the recording exists to be found. The tree keys whole pages at the recording's page
size over a token allocator: the wire's slots are tokens at any page size. Nodes and lock handles are numbered in
the order the wire first names them, as the live wire numbers the server's
(live.py), so a correct release answers a recording of itself number for number.

The tree is built with sglang's Python tree core (the server's default core is Rust,
whose nodes cannot be read): the two keep the same books, and the checker reads the
build's nodes (``path``, ``path_slots``, ``locked_slots``)."""

from __future__ import annotations

import importlib
import itertools
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from kvreplay.errors import BuildUnloadable, BuildUnsupported
from kvreplay.families.tree.runs import from_runs, to_runs

TREE_CLASS = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
ROOT = 0  # the wire's root node, as tree.py numbers it (tree.py builds this module's trees: no import back)
# what an unsupported release is told: the method eras the wire has an adapter for
ERAS = ("the tree's wire speaks sglang's tree eras from 0.5.1 (cache_finished_req to 0.5.20, insert_req in "
        "0.5.21, checkpoint from 0.5.22), not this class's")
UNNAMED = 1 << 48  # path() ids of nodes the wire never named: apart from every number


class ReleaseRows:
    """The request-to-token table the tree reads and writes, one growing row per request
    (a release's ReqToTokenPool holds rows x context length up front)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}
        self.req_to_token = self

    def __getitem__(self, key: Any) -> torch.Tensor:
        row, part = key if isinstance(key, tuple) else (key, slice(None))
        return torch.tensor(self.rows[int(row)], dtype=torch.int64)[part]

    def write(self, where: tuple[Any, slice], values: torch.Tensor) -> None:
        row_at, part = where
        row = self.rows[int(row_at)]
        vals = [int(v) for v in values.reshape(-1).tolist()]
        start = part.start or 0
        if len(row) < start + len(vals):
            row.extend([0] * (start + len(vals) - len(row)))
        row[start:start + len(vals)] = vals

    def free(self, row: Any) -> None:
        """A release up to 0.5.8.post1 frees the row inside ``cache_finished_req``; the
        wire's ``release`` drops it, after the row free that follows."""


class _Request:
    """What sglang's tree reads of a request."""

    extra_key = cache_salt = session_id = session = kv_rotation_base = None
    swa_branching_seqlen = mamba_branching_seqlen = None  # set by a match, read by a checkpoint
    priority = 0

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.lock: Any = None
        self.last_node: Any = None
        self.pages: list[int] = []
        self.prompt = 0  # tokens of the prompt: the match's limit is the prompt less one
        self.full_untruncated_fill_ids = array("q")
        self.origin_input_ids = array("q")

    done = False  # the wire's checkpoint of a finished request names its outputs

    def finished(self) -> bool:
        return self.done


PARTIAL = -2  # a token of a partial page: the wire names full pages only, and the tree keys only those


def prompt_length(up_to: int, outputs: int) -> int:
    """How many of a finished request's ``up_to`` row tokens were its prompt, given its
    output count: the last output token has no slot yet, so ``outputs - 1`` of the row are
    outputs (none for a request that asked for no output)."""
    return up_to if outputs == 0 else min(up_to, max(0, up_to - outputs + 1))


class BehindTheWire:
    """What every release's tree behind the wire shares: its three counters, read from
    the release's own allocator and tree, and the token ids it keys a request by."""

    prefix_tree = True
    allocator: Any
    tree: Any
    kv: WireSlots
    swa: WindowSlots | None = None  # a sliding-window tree's window side
    state: StateSlots | None = None  # a Mamba tree's state slots
    page_size = 1
    _page_ids: dict[int, int]

    def token_ids(self, req: Any, n: int) -> array:
        """The first ``n`` token ids of a request whose full pages hash to ``req.pages``. At
        page size 1 a page's hash is its token id. A larger page stands as ``page_size``
        distinct ids, numbered from the page's first appearance (a hash times the page
        size would not fit a token id); a partial page, which the tree never keys, is
        filler. The ids of the pages seen so far are kept on the request: a request's key
        only grows, and expanding it whole at every call cost a replay time quadratic in
        its length."""
        p = self.page_size
        done: array = req.__dict__.setdefault("_token_ids", array("q"))
        have = len(done) // p
        if have < len(req.pages):
            if p == 1:
                done.extend(req.pages[have:])
            else:
                ids = self.__dict__.setdefault("_page_ids", {})
                for h in req.pages[have:]:
                    base = ids.setdefault(int(h), len(ids)) * p
                    done.extend(range(base, base + p))
        out = done[:n]
        if len(out) < n:
            out.extend([PARTIAL] * (n - len(out)))
        return out

    def touch(self, request: int, pages: tuple[int, ...], length: int) -> None:
        """The scheduler refreshing a waiting request's prefix (0.5.22 and later): a release
        before it had no such refresh, so here the request only learns its pages."""
        self._request(int(request)).pages.extend(int(p) for p in pages)

    def finished_release(self, row: list[int], up_to: int) -> Any:
        """Around a release's ``cache_finished_req``: the slots of the request's partial last
        page, which those releases free themselves, are left to the wire's ``free_kv_row``
        that follows, where the recording frees them."""
        return self.kv.leaving(row[up_to // self.page_size * self.page_size:up_to])

    def available_size(self) -> int:
        # the wire's allocator (a sliding-window tree's full side: the composite reads the smaller side's)
        return int(self.kv.allocator.available_size())

    def evictable_size(self) -> int:
        return int(self.tree.evictable_size())

    def protected_size(self) -> int:
        return int(self.tree.protected_size())


class ReleaseTree(BehindTheWire):
    """A release's tree behind the wire (``--build sglang``, ``sglang==X``)."""

    def __init__(self, cls: type, ctor: dict[str, Any]) -> None:
        batch = self._import_release(cls)
        self._check_era(cls, batch)
        self._kv_info = batch.ReqKvInfo
        size = int(ctor["size"])
        # the tree keys whole pages; the wire's allocator hands out token slots at any page size
        self.page_size = int(ctor.get("page_size") or 1)
        self.ctor_args = {"size": size, "page_size": self.page_size, "device": "cpu",
                          "need_sort": bool(ctor.get("need_sort", True))}
        kinds = self._sg["unified_cache.components"].ComponentType
        window = int(ctor.get("sliding_window") or 0)
        states = int(ctor.get("state_size") or 0)
        extra: dict[str, Any] = {}
        if window:
            # a sliding-window tree: its full and window sides over the composite allocator
            self.ctor_args.update(swa_size=int(ctor["swa_size"]), sliding_window=window)
            self.allocator = self._window_allocator(size, int(ctor["swa_size"]))
            components, extra["sliding_window_size"] = (kinds.FULL, kinds.SWA), window
        else:
            token = self._sg["allocator.token"].TokenToKVPoolAllocator
            self.allocator = token(size, torch.int64, "cpu", None, self.ctor_args["need_sort"])
            components = (kinds.FULL, kinds.MAMBA) if states else (kinds.FULL,)
        self.rows = self._state_rows(states) if states else ReleaseRows()
        params = dict(disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.allocator,
                      page_size=self.page_size, tree_components=components, **extra)
        if states:
            self.ctor_args.update({k: int(ctor[k]) for k in ("state_size", "state_grid", "state_path_cap")})
            with _state_context(int(ctor["state_grid"]), int(ctor["state_path_cap"])):
                self.tree = self._make_tree(cls, params)
            self.state = StateSlots(self.rows.mamba_allocator)
        else:
            self.tree = self._make_tree(cls, params)
        self.kv = WireSlots(self.allocator.full_attn_allocator if window else self.allocator, self.allocator)
        if window:
            self.swa = WindowSlots(self.allocator)
        self.requests: dict[int, Any] = {}
        self._row_ids = itertools.count(1)
        self._node_number: dict[int, int] = {int(self.tree.root_node_handle()): ROOT}
        self._node_id: dict[int, int] = {ROOT: int(self.tree.root_node_handle())}
        self._locks: dict[int, Any] = {}  # handle -> what releases it (the release's TreeLock here)
        self._handles = itertools.count(1)

    def _import_release(self, cls: type) -> Any:
        """The release's tree modules (``self._sg``), and its scheduler's batch module."""
        try:
            self._sg = {name: importlib.import_module(f"sglang.srt.mem_cache.{name}") for name in
                        ("allocator.token", "cache_init_params", "base_prefix_cache", "radix_cache",
                         "unified_cache.components")}
            return importlib.import_module("sglang.srt.managers.schedule_batch")
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("sglang"):
                raise BuildUnsupported(f"{cls.__module__}.{cls.__name__}: this release has no {exc.name} "
                                       f"({ERAS})") from None
            raise BuildUnloadable(f"sglang's tree does not import here: it needs {exc.name}, which this "
                                  "environment lacks (run kvreplay beside sglang's dependencies)") from None
        except Exception as exc:  # a release that exists but fails to import in this environment
            raise BuildUnloadable(f"sglang's tree does not import here ({type(exc).__name__}: {exc})") from None

    def _window_allocator(self, size: int, swa_size: int) -> Any:
        """The release's composite allocator over a window KV pool of a few bytes a slot."""
        try:
            pool = importlib.import_module("sglang.srt.mem_cache.swa_memory_pool").SWAKVPool
            composite = importlib.import_module("sglang.srt.mem_cache.allocator.swa").SWATokenToKVPoolAllocator
        except ModuleNotFoundError as exc:
            raise BuildUnsupported(f"this release has no {exc.name}: no sliding-window tree") from None
        kv = pool(size=size, size_swa=swa_size, page_size=self.page_size, dtype=torch.bfloat16, head_num=1,
                  head_dim=1, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
        return composite(size, swa_size, page_size=self.page_size, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                         need_sort=self.ctor_args["need_sort"])

    def _state_rows(self, size: int) -> Any:
        """The request pool of a Mamba tree: the release's own request pool class (the tree
        asks for it) over this module's rows, with the release's state slot allocator and
        a state store of no bytes (the tree copies states; the copies are not the books)."""
        try:
            hybrid = importlib.import_module("sglang.srt.mem_cache.memory_pool").HybridReqToTokenPool
            slots = importlib.import_module("sglang.srt.mem_cache.allocator.mamba").MambaSlotAllocator
        except (ModuleNotFoundError, AttributeError) as exc:
            raise BuildUnsupported(f"this release has no {getattr(exc, 'name', None) or exc}: no Mamba tree "
                                   "the wire speaks") from None
        rows = type("StateRows", (ReleaseRows, hybrid), {"__init__": ReleaseRows.__init__})()
        rows.mamba_allocator = slots(size, "cpu")
        rows.mamba_pool = SimpleNamespace(copy_from=lambda src, dst: None, replayssm_write_pos=None,
                                          replayssm_spec_write_pos=None)
        rows.enable_mamba_extra_buffer = False
        return rows

    def _check_era(self, cls: type, batch: Any) -> None:
        if not hasattr(cls, "checkpoint") or not hasattr(batch, "ReqKvInfo"):
            raise BuildUnsupported(f"{cls.__module__}.{cls.__name__}: {ERAS}")

    def _make_tree(self, cls: type, params: dict[str, Any]) -> Any:
        """The tree on sglang's Python tree core, whose nodes the checker reads."""
        return cls(self._sg["cache_init_params"].CacheInitParams(**params, tree_core_backend="python"))

    # -- numbers ----------------------------------------------------------------------------------
    def _number(self, node_id: Any) -> int:
        n = self._node_number.get(int(node_id))
        if n is None:
            n = self._node_number[int(node_id)] = len(self._node_number)
            self._node_id[n] = int(node_id)
        return n

    def _handle(self, lock: Any) -> int:
        if lock is None:
            return 0
        handle = next(self._handles)
        self._locks[handle] = lock
        return handle

    def _handle_of(self, lock: Any) -> int:
        return next((h for h, lk in self._locks.items() if lk is lock), 0)

    def _request(self, number: int) -> _Request:
        req = self.requests.get(number)
        if req is None:
            req = self.requests[number] = _Request(self._kv_info())
        return req

    def _learn(self, req: _Request, pages: tuple[int, ...], n: int) -> None:
        """The request's key grows by ``pages``, and covers its first ``n`` tokens."""
        req.pages.extend(int(p) for p in pages)
        req.full_untruncated_fill_ids = self.token_ids(req, max(n, len(req.pages) * self.page_size))
        req.origin_input_ids = req.full_untruncated_fill_ids[:req.prompt]

    def _row(self, req: _Request) -> list[int]:
        if req.kv.req_pool_idx is None:
            req.kv.req_pool_idx = next(self._row_ids)
            self.rows.rows[req.kv.req_pool_idx] = []
        return self.rows.rows[req.kv.req_pool_idx]

    # -- the wire's calls -------------------------------------------------------------------------
    def match_prefix(self, request: int, pages: tuple[int, ...], length: int, cow: int | None = None
                     ) -> tuple[int, int]:
        req = self._request(int(request))
        if not req.prompt:
            req.prompt = int(length) + 1
        self._learn(req, pages, int(length))
        sg = self._sg
        key = sg["radix_cache"].RadixKey(req.full_untruncated_fill_ids, limit=int(length))
        # a Mamba tree copies the matched node's state for the scheduler's own match (cow), not a policy's look
        cow = {"cow_mamba": bool(cow)} if self.state is not None and cow is not None else {}
        got = self.tree.match_prefix(sg["base_prefix_cache"].MatchPrefixParams(key=key, req=req, **cow))
        matched = int(got.device_prefix_len)
        req.last_node = got.last_device_node
        req.swa_branching_seqlen = getattr(got, "swa_branching_seqlen", None)  # as the scheduler's match keeps it
        req.kv.cache_protected_len = matched
        row = self._row(req)
        row[:] = self.tree.path_device_indices(got.last_device_node).tolist()[:matched]
        return (matched, self._number(got.last_device_node))

    def touch(self, request: int, pages: tuple[int, ...], length: int) -> None:
        """The scheduler refreshes a waiting request's cached prefix: the tree walks its key
        (bumping the nodes' recency, splitting the node it ends inside) and keeps nothing."""
        req = self._request(int(request))
        self._learn(req, pages, int(length))
        if hasattr(self.tree, "touch_prefix"):
            self.tree.touch_prefix(self._sg["radix_cache"].RadixKey(req.full_untruncated_fill_ids,
                                                                    limit=int(length)))

    def lock(self, request: int, node: int) -> int:
        node_id = self._node_id.get(int(node))
        if node_id is None:
            raise ValueError(f"node {node} was never named")
        handle = self._handle(self.tree.lock(node_id))
        req = self.requests.get(int(request))
        if req is not None:
            req.lock = self._locks.get(handle)
        return handle

    def unlock(self, request: int, handle: int) -> None:
        lock = self._locks.pop(int(handle), None)
        if lock is None:
            return
        self.tree.unlock(lock)
        req = self.requests.get(int(request))
        if req is not None and req.lock is lock:
            req.lock = None

    def extend(self, request: int, runs: tuple[int, ...]) -> None:
        req = self._request(int(request))
        row = self._row(req)
        row.extend(from_runs(runs))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(row)

    def checkpoint(self, request: int, pages: tuple[int, ...], up_to: int,
                   outputs: int | None = None) -> tuple[int, int, int]:
        req = self._request(int(request))
        self._learn(req, pages, int(up_to))
        old = req.lock
        # a finished request's release: the window does not slide before its insert
        req.done = outputs is not None
        self.tree.checkpoint(req, up_to=int(up_to))
        if req.lock is not old:
            self._locks.pop(self._handle_of(old), None)
            handle = self._handle(req.lock)
        else:
            handle = self._handle_of(old)
        return (int(req.kv.cache_protected_len), self._number(req.last_node), handle)

    def free_kv_row(self, request: int, start: int, end: int) -> None:
        req = self._request(int(request))
        self._row(req)
        if int(end) > int(start):
            self.tree.free_kv_row(req.kv, [(int(start), int(end))])

    def release(self, request: int) -> None:
        req = self.requests.pop(int(request), None)
        if req is not None and req.kv.req_pool_idx is not None:
            self.rows.rows.pop(req.kv.req_pool_idx, None)

    def evict(self, num_tokens: int, swa_num_tokens: int | None = None, state_num: int | None = None) -> int:
        more = {} if swa_num_tokens is None else {"swa_num_tokens": int(swa_num_tokens)}
        if state_num is not None:
            more["mamba_num"] = int(state_num)
        got = self.tree.evict_for_alloc(self._sg["base_prefix_cache"].EvictParams(num_tokens=int(num_tokens),
                                                                                   **more))
        return int(got.num_tokens_evicted)

    def hold_state(self, request: int) -> None:
        """The request pool gives an admitted request its state slot."""
        req = self._request(int(request))
        if self.state is None:
            raise ValueError("this tree has no Mamba states")
        self.state.alloc(1)
        got = self.state.got
        if got is None:
            raise RuntimeError("no state slot is free")
        req.kv.mamba_pool_idx = got[0]

    def drop_state(self, request: int) -> None:
        """The request's state slot goes back outside the tree's calls."""
        req = self._request(int(request))
        if self.state is None or req.kv.mamba_pool_idx is None:
            raise ValueError(f"request {request} holds no state slot")
        self.state.allocator.free(req.kv.mamba_pool_idx.reshape(1))
        req.kv.mamba_pool_idx = None

    def group_states(self, need_size: int) -> None:
        """A scheduling round takes ``need_size`` state slots at once, if it can."""
        if self.state is None:
            raise ValueError("this tree has no Mamba states")
        self.state.group(int(need_size))

    def ungroup_states(self) -> None:
        if self.state is None:
            raise ValueError("this tree has no Mamba states")
        self.state.allocator.alloc_group_end()

    def slide(self, request: int, pre_len: int, interval: int = 1) -> None:
        req = self._request(int(request))
        self._row(req)
        self.tree.evict_sliding_windows(req, int(pre_len), eviction_interval=int(interval))

    # -- what the checker reads -------------------------------------------------------------------
    def _node(self, number: int) -> Any:
        node_id = self._node_id.get(int(number))
        if node_id is None:
            return None
        try:
            return self.tree.tree_core.node_by_id(node_id)
        except (KeyError, LookupError, ValueError, NotImplementedError):
            return None

    def _full(self, node: Any) -> Any:
        return node.component_data[self._full_type]

    @property
    def _full_type(self) -> Any:
        return self._sg["unified_cache.components"].ComponentType.FULL

    def path(self, node: int) -> list[tuple[int, int, int]]:
        out = []
        full_type, numbers = self._full_type, self._node_number
        n = self._node(node)
        while n is not None and n.parent is not None:
            full = n.component_data[full_type]
            ident = numbers.get(int(n.id), UNNAMED + int(n.id))
            # shape[0], not len(): a tensor's len() is Python code, and this runs per node per call
            out.append((ident, int(full.lock_ref), 0 if full.value is None else int(full.value.shape[0])))
            n = n.parent
        return out

    def state_books(self) -> tuple[int, int, int] | None:
        """A Mamba tree's state books: free state slots, and the states its nodes keep,
        evictable and protected (what sglang's idle check adds up as ``[mamba]``)."""
        if self.state is None:
            return None
        return (int(self.state.allocator.available_size()), int(self.tree.mamba_evictable_size()),
                int(self.tree.mamba_protected_size()))

    def state_of(self, node: int) -> int | None:
        """The state slot a Mamba tree's node keeps (the state of the sequence ending there)."""
        n = self._node(node)
        if n is None or self.state is None:
            return None
        value = n.component_data[self._sg["unified_cache.components"].ComponentType.MAMBA].value
        return None if value is None else int(value.reshape(-1)[0])

    def path_slots(self, node: int) -> list[int]:
        node_id = self._node_id.get(int(node))
        return [] if node_id is None else self.tree.path_device_indices(node_id).tolist()

    def locked_slots(self) -> set[int]:
        out: set[int] = set()
        stack = [self.tree.tree_core.root_node]
        while stack:
            n = stack.pop()
            full = self._full(n)
            if n.parent is not None and full.lock_ref > 0 and full.value is not None:
                out.update(full.value.tolist())
            stack.extend(n.children.values())
        return out


class WireSlots:
    """The allocator's calls in the wire's form (target ``kv``): the replayer listens
    here, and the tree's own frees reach the allocator through it."""

    def __init__(self, allocator: Any, handing_out: Any = None) -> None:
        """``allocator``: the one whose frees are the wire's (a sliding-window tree's inner
        full allocator); ``handing_out``: the one the scheduler allocates from (the
        composite), if another."""
        self.allocator = allocator
        self.handing_out = allocator if handing_out is None else handing_out
        self.size = int(allocator.size)
        self._free = allocator.free
        allocator.free = self._tree_free  # the tree's frees, as the wire's
        self.left: set[int] = set()  # slots a release frees that the wire frees in a later call

    @contextmanager
    def leaving(self, slots: list[int]) -> Iterator[None]:
        """Inside: the release's frees of ``slots`` are not the wire's (a later call frees them)."""
        self.left = set(slots)
        try:
            yield
        finally:
            self.left = set()

    def _tree_free(self, index: torch.Tensor) -> None:
        slots = [int(s) for s in index.reshape(-1).tolist()]
        if self.left:
            slots = [s for s in slots if s not in self.left]
        if slots:
            self.free(to_runs(slots))

    def available_size(self) -> int:
        return int(self.allocator.available_size())

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        got = self.handing_out.alloc(int(need_size))
        return None if got is None else to_runs([int(s) for s in got.tolist()])

    def free(self, runs: tuple[int, ...]) -> None:
        slots = from_runs(runs)
        if slots:
            self._free(torch.tensor(slots, dtype=torch.int64))


class WindowSlots:
    """A sliding-window tree's window side in the wire's form (target ``swa``): the window
    slots an allocation hands out beside the full ones, and those a free resolves through
    the composite's map (the window allocator frees them itself, maybe at a group's end)."""

    def __init__(self, composite: Any) -> None:
        window = composite.swa_attn_allocator
        self._alloc, self._resolve = window.alloc, composite._free_swa_pages_none_cuda
        self._got: Any = None
        window.alloc = self._window_alloc
        composite._free_swa_pages_none_cuda = self._window_free

    def _window_alloc(self, need_size: int, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._alloc(need_size, *args, **kwargs)
        self._got = None
        self.alloc(int(need_size))
        return self._got

    def _window_free(self, full_slots: torch.Tensor) -> torch.Tensor:
        window = self._resolve(full_slots)
        if window.numel():
            self.free(to_runs([int(s) for s in window.tolist()]))
        return window

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        self._got = got = self._alloc(int(need_size))
        return None if got is None else to_runs([int(s) for s in got.tolist()])

    def free(self, runs: tuple[int, ...]) -> None:
        """The composite resolved these through its map; its window allocator frees them."""


class StateSlots:
    """A Mamba tree's state slots in the wire's form (target ``state``): the release's
    state allocator, its allocations and frees logged here wherever the tree or the
    wire's calls make them."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self._alloc, self._free = allocator.alloc, allocator.free
        self._take = self._alloc
        self.got: Any = None
        allocator.alloc, allocator.free = self._tree_alloc, self._tree_free

    def _tree_alloc(self, need_size: int, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._alloc(need_size, *args, **kwargs)
        self.got = None
        self.alloc(int(need_size))
        return self.got

    def _tree_free(self, index: torch.Tensor) -> None:
        slots = [int(s) for s in index.reshape(-1).tolist()]
        if slots:
            self.free(to_runs(slots))

    def group(self, need_size: int) -> None:
        """The allocator's group: the slots it takes are logged as one allocation."""
        taken = group_taken(self.allocator, self.allocator.alloc_group_begin, need_size)
        if taken is not None:
            self._take = lambda n: taken
            try:
                self.alloc(int(taken.numel()))
            finally:
                self._take = self._alloc

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        self.got = got = self._take(int(need_size))
        return None if got is None else to_runs([int(s) for s in got.reshape(-1).tolist()])

    def free(self, runs: tuple[int, ...]) -> None:
        slots = from_runs(runs)
        if slots:
            self._free(torch.tensor(slots, dtype=torch.int64))


def group_taken(allocator: Any, begin: Any, need_size: int) -> Any:
    """Begin a state slot allocator's group (``begin``: its ``alloc_group_begin``, or the
    real one behind a shim) and say which slots it took off the free list (the head of
    it), or None: the group takes them without an ``alloc`` that could be logged."""
    before = allocator.free_slots
    begin(need_size)
    taken = int(before.numel()) - int(allocator.free_slots.numel())
    return before[:taken] if taken > 0 else None


@contextmanager
def _state_context(grid: int, path_cap: int) -> Iterator[None]:
    """What a release's Mamba component reads of the server's settings when it is built
    (its checkpoint grid, the states a path keeps), as the recording's server had them:
    no server runs behind a replay."""
    module = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")
    settings = SimpleNamespace(mamba=SimpleNamespace(mamba_max_states_per_path=path_cap,
                                                     enable_mamba_extra_buffer_lazy=False))
    saved = {name: getattr(module, name) for name in ("get_exec", "mamba_cache_chunk_size", "mamba_checkpoint_grid")}
    module.get_exec = lambda: settings
    module.mamba_cache_chunk_size = lambda: grid
    module.mamba_checkpoint_grid = lambda page: grid
    try:
        yield
    finally:
        module.mamba_cache_chunk_size = saved["mamba_cache_chunk_size"]
        module.mamba_checkpoint_grid = saved["mamba_checkpoint_grid"]
        # a tree that cannot allocate a state asks again later: without a server, the lazy
        # extra buffer is off
        module.get_exec = _or_settings(saved["get_exec"], settings)


def _or_settings(real: Any, settings: Any) -> Any:
    if getattr(real, "_kvreplay_fallback", False):
        return real

    def get_exec() -> Any:
        try:
            return real()
        except Exception:
            return settings
    get_exec._kvreplay_fallback = True  # type: ignore[attr-defined]
    return get_exec


def release_tree(cls: type, ctor: dict[str, Any]) -> ReleaseTree:
    return ReleaseTree(cls, ctor)


__all__ = ["ERAS", "PARTIAL", "ROOT", "TREE_CLASS", "UNNAMED", "BehindTheWire", "ReleaseRows", "ReleaseTree",
           "StateSlots", "WindowSlots", "WireSlots", "group_taken", "prompt_length", "release_tree"]
