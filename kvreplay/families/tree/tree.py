"""kvreplay's own prefix cache: a radix tree of KV pages over a token-slot allocator,
re-implemented from the behaviour of sglang 0.5.23's ``RadixCache`` and spoken to in
plain values (the tree family's wire).

A key is a tuple of page hashes (each page ``page_size`` tokens; a page's hash chains
its prefix, so equal hashes mean equal prefixes and no token id is ever kept). A node
owns the KV slots of its key's pages; a running request owns its row past its
protected length (what the tree does not hold), and holds a lock on its last node,
which protects the path to the root from eviction. Requests are numbers; the request
fields the tree reads (row, protected length, lock, last node) live on the wire.

Each bug variant (variants.py) overrides one hook: ``_free_row``, ``_duplicates``,
``_release_lock``, ``_may_evict``, ``_unlocked``."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from kvreplay.errors import BuildUnsupported
from kvreplay.families.tree.runs import from_runs, to_runs

ROOT = 0  # the root node's id; no lock handle is 0 (``unlock(r, 0)`` is a no-op, as sglang's unlock(None))


class KvSlots:
    """The token-slot allocator under the tree (sglang's token allocator's behaviour):
    slot 0 pads batches and is never handed out; a handout takes the head of the free
    list; freed slots wait on a release list that is merged back, sorted, when the
    free list runs short. Slots travel as runs (runs.py)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots: list[int] = list(range(1, size + 1))
        self.head = 0
        self.released: list[int] = []

    def available_size(self) -> int:
        return len(self.free_slots) - self.head + len(self.released)

    def alloc(self, need_size: int) -> tuple[int, ...] | None:
        need = int(need_size)
        if need > len(self.free_slots) - self.head and self.released:
            self.free_slots = sorted(self.free_slots[self.head:] + self.released)
            self.head, self.released = 0, []
        if need > len(self.free_slots) - self.head:
            return None
        got = self.free_slots[self.head:self.head + need]
        self.head += need
        if self.head > 4096 and self.head * 2 > len(self.free_slots):
            self.free_slots, self.head = self.free_slots[self.head:], 0
        return to_runs(got)

    def free(self, runs: tuple[int, ...]) -> None:
        self.released.extend(from_runs(runs))


@dataclass(eq=False)
class Node:
    id: int
    parent: Node | None
    key: tuple[int, ...]  # page hashes
    value: list[int]  # KV slots, page_size per page
    lock_ref: int = 0
    last_access: int = 0
    children: dict[int, Node] = field(default_factory=dict)


@dataclass
class Held:
    """What the tree reads of a running request (sglang's ``req.kv`` fields)."""

    row: list[int] = field(default_factory=list)  # KV slots by position; -1: freed
    pages: list[int] = field(default_factory=list)  # its key so far: the hashes of its full pages
    protected: int = 0  # the leading part the tree owns (cache_protected_len)
    lock: int = 0  # the lock handle on its last node
    last_node: int = ROOT


class PrefixTree:
    """The builtin tree (``builtin:tree``)."""

    prefix_tree = True
    swa: Any = None  # a sliding-window tree's window side (target ``swa``): this tree has none
    state: Any = None  # a Mamba tree's state slots (target ``state``): this tree has none

    def __init__(self, size: int, page_size: int = 1, device: Any = "cpu") -> None:
        self.ctor_args = {"size": int(size), "page_size": int(page_size), "device": "cpu"}
        self.page_size = int(page_size)
        self.kv = KvSlots(int(size))
        self.root = Node(ROOT, None, (), [], lock_ref=1)
        self.by_id: dict[int, Node] = {ROOT: self.root}
        # A node's number on the wire: given in the order results first name nodes, as a
        # live server's wire numbers them, so that a node made and never named (the upper
        # half of a split an insert makes) takes no number a later node would have had.
        self.names: dict[int, int] = {ROOT: ROOT}  # node id -> its number on the wire
        self.by_name: dict[int, Node] = {ROOT: self.root}
        self.requests: dict[int, Held] = {}
        self.waiting: dict[int, list[int]] = {}  # pages of requests touched before their first match
        self.handles: dict[int, int] = {}  # lock handle -> node id
        self.locked: set[Node] = set()  # nodes whose lock count is above zero
        self._next_node = 1
        self._next_handle = 1
        self._tick = 0
        self.evictable_size_ = 0
        self.protected_size_ = 0

    # -- counters ---------------------------------------------------------------------------------
    def available_size(self) -> int:
        return self.kv.available_size()

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    # -- the scheduler's calls ----------------------------------------------------------------------
    def match_prefix(self, request: int, pages: tuple[int, ...], length: int) -> tuple[int, int]:
        """The longest cached prefix of the request's first ``length`` tokens, ``pages``
        being the hashes of the full pages it gained since the tree last heard of it (a
        request waiting for room is matched again each round, naming nothing new):
        ``(tokens matched, last node)``. The request's row starts as that prefix, all of
        it the tree's (``path_slots(node)``)."""
        r = int(request)
        known = self.requests[r].pages if r in self.requests else self.waiting.pop(r, [])
        known.extend(pages)
        node, slots = self._match(tuple(known[: int(length) // self.page_size]))
        name = self._name(node)
        self.requests[r] = Held(row=list(slots), pages=known, protected=len(slots), last_node=name)
        return (len(slots), name)

    def touch(self, request: int, pages: tuple[int, ...], length: int) -> None:
        """The scheduler refreshes a waiting request's cached prefix: the walk bumps the
        recency of the nodes on it and splits the node it ends inside; nothing is held."""
        r = int(request)
        known = self.requests[r].pages if r in self.requests else self.waiting.setdefault(r, [])
        known.extend(pages)
        self._walk(tuple(known[: int(length) // self.page_size]))

    def lock(self, request: int, node: int) -> int:
        """Protect ``node`` and its path from eviction for ``request``: a lock handle."""
        handle = self._lock(self.by_name[int(node)])
        held = self.requests.get(int(request))
        if held is not None:
            held.lock = handle
        return handle

    def unlock(self, request: int, handle: int) -> None:
        held = self.requests.get(int(request))
        self._release_lock(int(handle))
        if held is not None and held.lock == int(handle):
            held.lock = 0

    def extend(self, request: int, runs: tuple[int, ...]) -> None:
        """The scheduler wrote newly allocated slots at the end of the request's row."""
        self.requests.setdefault(int(request), Held()).row.extend(from_runs(runs))

    def checkpoint(self, request: int, pages: tuple[int, ...], up_to: int,
                   outputs: int | None = None) -> tuple[int, ...]:
        """Cache the request's first ``up_to`` tokens (page-aligned), ``pages`` being the
        hashes of the full pages it gained since its last call; free the slots of its
        row the tree already held, take the tree's slots into the row, and move the
        request's lock to its new last node: ``(protected, last node, lock)``; the row's
        first ``protected`` slots are then the tree's (``path_slots(node)``).

        ``outputs`` is given on a finished request's release only: its output tokens.
        This tree does not need it (it caches what ``up_to`` says); releases before
        0.5.22 derive a finished request's token lists from it (release_radix.py)."""
        held = self.requests[int(request)]
        held.pages.extend(pages)
        n_pages = int(up_to) // self.page_size
        key = tuple(held.pages[:n_pages])
        prefix = self._insert(key, held.row[: n_pages * self.page_size])
        old = held.protected
        lo, hi = self._duplicates(held, prefix)
        dups = [s for s in held.row[lo:hi] if s >= 0]
        if dups:
            self.kv.free(to_runs(dups))
        node, slots = self._match(key)
        new = slots[old:]
        held.row[old:len(slots)] = new
        held.protected = len(slots)
        self._release_lock(held.lock)
        held.lock = self._lock(node)
        held.last_node = self._name(node)
        return (held.protected, held.last_node, held.lock)

    def free_kv_row(self, request: int, start: int, end: int) -> None:
        """Free the request's row from ``start`` to ``end`` (its part the tree does not hold)."""
        self._free_row(int(request), self.requests[int(request)], int(start), int(end))

    def release(self, request: int) -> None:
        """The request gives its row back (the request pool's free): whatever it still
        holds and did not free or cache is lost to the pool."""
        self.requests.pop(int(request), None)
        self.waiting.pop(int(request), None)

    def evict(self, num_tokens: int) -> int:
        """Free least recently used unlocked leaves until ``num_tokens`` are freed."""
        heap = [(n.last_access, n.id, n) for n in self.by_id.values() if self._may_evict(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < int(num_tokens) and heap:
            _, _, node = heapq.heappop(heap)
            self.kv.free(to_runs(node.value))
            freed += len(node.value)
            self._delete_leaf(node)
            parent = node.parent
            if parent is not None and self._may_evict(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # -- what the checker reads of the tree ---------------------------------------------------------
    def path(self, node: int) -> list[tuple[int, int, int]]:
        """``(id, lock count, slots held)`` of ``node`` and each node above it, the root
        left out; empty for a node the tree does not have."""
        out = []
        n = self.by_name.get(int(node))
        while n is not None and n is not self.root:
            out.append((self.names.get(n.id, -n.id), n.lock_ref, len(n.value)))
            n = n.parent
        return out

    def path_slots(self, node: int) -> list[int]:
        """The slots of the path from the root to ``node``, in key order."""
        parts = []
        n = self.by_name.get(int(node))
        while n is not None and n is not self.root:
            parts.append(n.value)
            n = n.parent
        return [s for part in reversed(parts) for s in part]

    def locked_slots(self) -> set[int]:
        """The slots of every locked node."""
        return set(chain.from_iterable(n.value for n in self.locked if n.id in self.by_id))

    # -- hooks (a variant overrides one) ------------------------------------------------------------
    def _free_row(self, request: int, held: Held, start: int, end: int) -> None:
        slots = [s for s in held.row[start:end] if s >= 0]
        if slots:
            self.kv.free(to_runs(slots))
        for i in range(start, min(end, len(held.row))):
            held.row[i] = -1

    def _duplicates(self, held: Held, prefix: int) -> tuple[int, int]:
        """The row positions whose slots the insert found cached already."""
        return held.protected, prefix

    def _release_lock(self, handle: int) -> None:
        node_id = self.handles.pop(handle, None)
        if node_id is not None and node_id in self.by_id:
            self._unlock(self.by_id[node_id])

    def _may_evict(self, node: Node) -> bool:
        return node.id != ROOT and not node.children and node.lock_ref == 0

    def _unlocked(self, node: Node) -> None:
        """A node's last lock went: its slots are evictable again."""
        self.evictable_size_ += len(node.value)
        self.protected_size_ -= len(node.value)

    # -- the tree -----------------------------------------------------------------------------------
    def _name(self, node: Node) -> int:
        name = self.names.get(node.id)
        if name is None:
            name = self.names[node.id] = len(self.names)
            self.by_name[name] = node
        return name

    def _touch(self, node: Node) -> None:
        self._tick += 1
        node.last_access = self._tick

    def _walk(self, key: tuple[int, ...]) -> tuple[Node, int, list[int]]:
        """Follow ``key`` down the tree, splitting the node it ends inside: the last node
        reached, the pages matched and their slots."""
        node, slots, i = self.root, [], 0
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            n = _common(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)
            slots += child.value
            node, i = child, i + n
        return node, i, slots

    def _match(self, key: tuple[int, ...]) -> tuple[Node, list[int]]:
        node, _, slots = self._walk(key)
        return node, slots

    def _insert(self, key: tuple[int, ...], values: list[int]) -> int:
        """Insert ``key`` with ``values``: the tokens it found cached already."""
        ps = self.page_size
        node, i, _ = self._walk(key)
        if i < len(key):
            new = Node(self._next_node, node, key[i:], list(values[i * ps:len(key) * ps]))
            self._next_node += 1
            self._touch(new)
            node.children[key[i]] = new
            self.by_id[new.id] = new
            self.evictable_size_ += len(new.value)
        return i * ps

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child`` after ``n`` pages; the new upper node takes its locks."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None
        top = Node(self._next_node, parent, child.key[:n], child.value[: n * ps], lock_ref=child.lock_ref,
                   last_access=child.last_access)
        self._next_node += 1
        child.key, child.value, child.parent = child.key[n:], child.value[n * ps:], top
        top.children[child.key[0]] = child
        parent.children[top.key[0]] = top
        self.by_id[top.id] = top
        if top.lock_ref > 0:
            self.locked.add(top)
        return top

    def _lock(self, node: Node) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = node.id
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.value)
                self.protected_size_ += len(node.value)
            node.lock_ref += 1
            self.locked.add(node)
            node = node.parent
        return handle

    def _unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref <= 0:
                self.locked.discard(node)
            if node.lock_ref == 0:
                self._unlocked(node)
            node = node.parent

    def _delete_leaf(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        parent.children.pop(node.key[0], None)
        self.by_id.pop(node.id, None)
        self.by_name.pop(self.names.get(node.id, -1), None)
        self.evictable_size_ -= len(node.value)


def _common(a: tuple[int, ...], key: tuple[int, ...], at: int) -> int:
    """Pages ``a`` shares with ``key`` from ``at``."""
    n = 0
    while n < len(a) and at + n < len(key) and a[n] == key[at + n]:
        n += 1
    return n


def construct(family: Any, cls: type, ctor: dict[str, Any], device: Any) -> Any:
    windowed = bool(ctor.get("sliding_window"))
    stateful = bool(ctor.get("state_size"))
    if cls.__module__.split(".")[0] == "sglang":  # a release's tree, behind the wire
        if not hasattr(cls, "checkpoint") and (hasattr(cls, "cache_finished_req") or hasattr(cls, "insert_req")):
            if windowed or stateful:
                kind = "sliding-window" if windowed else "Mamba"
                raise BuildUnsupported(f"{cls.__module__}.{cls.__name__}: a {kind} tree replays on the "
                                       "wire's own era (0.5.22 and later) only")
            from kvreplay.families.tree.release_radix import RadixRelease, plain_model_ran_radix

            if cls.__name__ == "UnifiedRadixCache" and not plain_model_ran_radix():
                from kvreplay.families.tree.release_unified import UnifiedRelease

                return UnifiedRelease(cls, ctor)
            return RadixRelease(cls, ctor)  # an era before the wire's
        from kvreplay.families.tree.release import release_tree

        return release_tree(cls, ctor)
    if windowed or stateful:
        kind = "sliding-window" if windowed else "Mamba state"
        raise BuildUnsupported(f"{cls.__name__} has no {kind} component: a trace of a {kind} "
                               "tree replays on sglang's own (--build sglang, sglang==0.5.22 and later)")
    return cls(int(ctor["size"]), int(ctor.get("page_size") or 1), "cpu")


__all__ = ["KvSlots", "PrefixTree", "construct"]
