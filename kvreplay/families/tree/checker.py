"""Invariants of a prefix cache over its KV pool (the tree family), checked at the call
that breaks them.

Every KV slot has one owner: the free list, the tree, one running request, or an
allocation not yet written to a request's row. The checker keeps its own ledger of
owners from what the calls say (the allocator's nested calls, the slots a match, an
extend or a checkpoint names), never from the build's own books, so a build that
loses slots or counts them twice is caught at the call that did it:

- the **books**: after every call, free + evictable + protected + what requests and
  pending allocations hold equals the pool. A change in the gap names the call that
  broke them, as slots lost (a deficit: sglang's idle ``memory leak detected``) or
  counted twice (an excess); the two are different bugs.
- **rows**: a row free that leaves slots of its range neither freed nor cached, or a
  request that gives its row back still holding slots, leaks them there.
- **locks**: a handle released that no one holds (or by another request), a node's
  lock count below zero or above the handles held on it and below it, a request
  gone with its lock held.
- **sizes**: the evictable and protected sizes equal what the unlocked and locked
  nodes hold; eviction frees only unlocked nodes' slots.

The tree's structure is read from the build only along the paths of the locks held
(``path(node)``) after each call that can change them, and its locked slots
(``locked_slots()``) before an eviction: a check costs the locks' depth, not the
tree's size. A node-level finding is reported once per node and rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvreplay.check.rules import RULES, Violation, ViolationLog
from kvreplay.families.tree.runs import from_runs

# owners that are not a request's number: GROUP a round's state slots, LOST a state slot let go of unfreed
PENDING, TREE, GROUP, LOST = -1, -2, -3, -4
SUB = "kv"
SIDES = ("swa.", "state.")  # a sliding-window tree's window side, a Mamba tree's state slots (nested calls' names)
_WATCH_MOST = 64  # orphaned nodes read again at each call; the rest count with the size they had
# a Mamba tree's calls that evict when no state slot is free (a copy-on-write at a match, a
# checkpoint's copy of a running request's state): their frees after a failed state allocation
_STATE_EVICTS = frozenset({"match_prefix", "checkpoint"})
_TREE_CALLS = frozenset({"match_prefix", "lock", "unlock", "checkpoint", "evict", "release", "free_kv_row"})


class TreeChecker:
    def __init__(self, tree: Any, *, full_check_every: int = 1000, keep: int = 20) -> None:
        self.tree = tree
        self.total = int(tree.ctor_args["size"])
        self.log = ViolationLog(keep=keep)
        self.owner: dict[int, int] = {}
        self.rows: dict[int, list[int]] = {}
        self.protected: dict[int, int] = {}
        self.locks: dict[int, int] = {}  # request -> its handle
        self.handles: dict[int, tuple[int, int]] = {}  # handle -> (request, node)
        self.held = 0  # slots requests and pending allocations hold
        self.tree_slots = 0  # slots the tree holds, as the calls said
        self.gap = 0  # the books' gap as last seen (a change is a finding)
        self.first_break: tuple[int, str, int] | None = None  # (call, method, gap)
        self._locked: set[int] = set()  # slots of locked nodes, read before an eviction
        self._watch: set[int] = set()  # nodes off the held locks' paths to read again (orphans, unlocked now)
        self._void: set[int] = set()  # handles the recording took where the build raised instead
        self._orphaned = 0  # slots of orphaned nodes no longer read again (_WATCH_MOST)
        self._flagged: set[tuple[str, int]] = set()
        self._size_gap = (0, 0)
        self._side_held: dict[str, set[int]] = {p: set() for p in SIDES}  # another side's slots handed out
        self._states: dict[int, int] = {}  # a Mamba tree's state slot -> its owner (a request, TREE, GROUP)
        # a Mamba tree's state books as the build keeps them (free, evictable, protected), where it says
        self._state_books = getattr(tree, "state_books", None) if getattr(tree, "state", None) is not None else None
        self._state_total = int(tree.ctor_args.get("state_size") or 0)
        self._state_gap = 0

    # -- findings -----------------------------------------------------------------------------------
    def _flag(self, call: int, method: str, rule_id: str, slots: Sequence[int], message: str,
              sub: str = SUB) -> None:
        rule = RULES[rule_id]
        self.log.add(Violation(call, method, rule.invariant, rule.rule, sub, sorted(slots)[:64], message, call))

    def _take(self, slot: int, who: int) -> None:
        was = self.owner.get(slot)
        if was is not None:
            self._count(was, -1)
        self._count(who, 1)
        self.owner[slot] = who

    def _drop(self, slot: int) -> None:
        was = self.owner.pop(slot, None)
        if was is not None:
            self._count(was, -1)

    def _count(self, owner: int, n: int) -> None:
        if owner == TREE:
            self.tree_slots += n
        else:
            self.held += n

    def before(self, call: int, method: str) -> None:
        """Told before call ``call`` is issued: an eviction's check needs the locked slots
        as they were."""
        if method == "evict" or method in _STATE_EVICTS and getattr(self.tree, "state", None) is not None:
            self._locked = self.tree.locked_slots()

    # -- per call -----------------------------------------------------------------------------------
    def raised(self, call: int, method: str, recorded: Any) -> None:
        """Told when the build raised at a call the recording returned from: the handle the
        recording took there (a lock's, a checkpoint's) is not the build's, so its release
        later is that divergence's consequence (already reported), not a lock released by
        no one."""
        if method == "lock" and type(recorded) is int:
            self._void.add(recorded)
        elif method == "checkpoint" and isinstance(recorded, (tuple, list)) and len(recorded) >= 3:
            self._void.add(int(recorded[2]))

    def after(self, call: int, method: str, args: dict[str, Any], result: Any,
              nested: list[tuple[str, Any]], counters: dict[str, int | None]) -> None:
        """Check call ``call``: ``nested`` the allocator calls it made, in order
        (``(method, slots)``), ``counters`` the build's free, evictable and protected
        sizes after it."""
        request = args.get("request")
        evicting = method == "evict"
        for m, slots in nested:
            side = next((p for p in SIDES if m.startswith(p)), None)
            if side == "state.":
                self._state(call, method, request, m.removeprefix(side), slots)
                # no state slot free: the tree evicts (nodes' states and, with a leaf, its KV)
                evicting = evicting or (m == "state.alloc" and not slots)
            elif side is not None:
                self._side(call, method, side, m.removeprefix(side), slots)
            else:
                self._allocator(call, method, request, m, slots, evicting)
        if method == "checkpoint" and "outputs" in args and self._states:
            self._donate(call, method, int(request), result)
        handler = getattr(self, f"_on_{method}", None)
        if handler is not None:
            handler(call, method, args, result)
        if method in _TREE_CALLS:
            self._nodes(call, method, counters)
        self._books(call, method, counters)
        if self._state_books is not None:
            self._state_books_after(call, method)

    def _allocator(self, call: int, method: str, request: Any, m: str, slots: list[int],
                   evicting: bool = False) -> None:
        if m == "alloc":
            owned = [s for s in slots if s in self.owner]
            if owned:
                self._flag(call, method, "tree-owner/handout-while-owned", owned,
                           f"the allocator handed out {len(owned)} slot(s) still held by "
                           f"{self._who(self.owner[owned[0]])}")
            for s in slots:
                self._take(s, PENDING)
            return
        free = [s for s in slots if s not in self.owner]
        if free:
            self._flag(call, method, "tree-owner/double-free", free, f"{len(free)} slot(s) freed while free")
        cached = [s for s in slots if self.owner.get(s) == TREE]
        if evicting:
            locked = [s for s in cached if s in self._locked]
            if locked:
                self._flag(call, method, "tree-owner/freed-while-locked", locked,
                           f"eviction freed {len(locked)} slot(s) of nodes a running request has locked")
        elif cached:
            self._flag(call, method, "tree-owner/freed-cached", cached,
                       f"{method} freed {len(cached)} slot(s) the tree holds (the tree still names them)")
        for s in slots:
            if s in self.owner:
                self._drop(s)

    def _side(self, call: int, method: str, side: str, m: str, slots: list[int]) -> None:
        """A sliding-window tree's window side, as its allocator's own books: it hands out
        only free slots and takes back only held ones. Whose a held one is (a node's
        window value, a request's live window) waits for the window's counters."""
        held = self._side_held[side]
        if m == "alloc":
            twice = [s for s in slots if s in held]
            if twice:
                self._flag(call, method, "tree-owner/handout-while-owned", twice,
                           f"the window allocator handed out {len(twice)} window slot(s) still held", sub="swa")
            held.update(slots)
            return
        free = [s for s in slots if s not in held]
        if free:
            self._flag(call, method, "tree-owner/double-free", free, f"{len(free)} window slot(s) freed while free",
                       sub="swa")
        held.difference_update(slots)

    def _state(self, call: int, method: str, request: Any, m: str, slots: list[int]) -> None:
        """A Mamba tree's state slots and their owners, from the calls: a round's group
        holds what it took until it hands it out or gives it back; the request pool's
        slot (``hold_state``) and a match's copy on write are the request's; a
        checkpoint's copy is the tree's, and so is a finished request's own slot unless
        the checkpoint freed it (``_donate``). A slot is handed out only while free and
        freed only while held; a request that gives its row back still holding one has
        lost it (``_on_release``)."""
        owners = self._states
        if m == "alloc":
            who = (GROUP if method == "group_states" else int(request) if method in ("hold_state", "match_prefix")
                   else TREE if method in ("checkpoint", "evict") else PENDING)
            twice = [s for s in slots if s in owners and not (owners[s] == GROUP and who != GROUP)]
            if twice:
                self._flag(call, method, "tree-owner/handout-while-owned", twice,
                           f"the state allocator handed out {len(twice)} state slot(s) still held by "
                           f"{self._who(owners[twice[0]])}", sub="state")
            for s in slots:
                owners[s] = who
            return
        free = [s for s in slots if s not in owners]
        if free:
            self._flag(call, method, "tree-owner/double-free", free, f"{len(free)} state slot(s) freed while free",
                       sub="state")
        for s in slots:
            owners.pop(s, None)

    def _donate(self, call: int, method: str, r: int, result: Any) -> None:
        """A finished request's checkpoint: the state slot it still holds is the new last
        node's now. A build that names the node's state (``state_of``) is held to it: where
        the node keeps another state (it had one), the request's slot should have been
        freed, and is lost here."""
        kept = [s for s, who in self._states.items() if who == r]
        state_of = getattr(self.tree, "state_of", None)
        node = result[1] if isinstance(result, (tuple, list)) and len(result) >= 2 else None
        there = state_of(node) if state_of is not None and node is not None else None
        for s in kept:
            if state_of is None or there == s:
                self._states[s] = TREE
            else:
                self._flag(call, method, "tree-owner/row-leak", [s],
                           f"request {r}'s checkpoint neither freed its state slot {s} nor gave it to the tree "
                           f"(node {node} keeps {'no state' if there is None else f'state slot {there}'})",
                           sub="state")
                self._states[s] = LOST

    def _who(self, owner: int) -> str:
        return {PENDING: "an allocation not yet in a row", TREE: "the tree",
                GROUP: "a scheduling round's group", LOST: "no one (lost)"}.get(owner, f"request {owner}")

    def _on_match_prefix(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        r = int(args["request"])
        self._let_go(call, method, r, "took a new prefix over a row")
        slots = (self.tree.path_slots(result[1])[: result[0]]
                 if isinstance(result, (tuple, list)) and len(result) >= 2 else [])
        stray = [s for s in slots if self.owner.get(s) != TREE]
        if stray:
            self._flag(call, method, "tree-owner/prefix-not-cached", stray,
                       f"the match gave request {r} {len(stray)} slot(s) the tree does not hold")
        self.rows[r] = list(slots)
        self.protected[r] = len(slots)

    def _on_lock(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        if type(result) is int:
            r = int(args["request"])
            self.handles[result] = (r, int(args["node"]))
            self.locks[r] = result

    def _on_unlock(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        r, h = int(args["request"]), int(args["handle"])
        if h == 0 or h in self._void:
            self._void.discard(h)
            return
        holder = self.handles.pop(h, None)
        if holder is not None:
            self._watch.add(holder[1])
        if holder is None or holder[0] != r:
            who = "no one" if holder is None else f"request {holder[0]}"
            self._flag(call, method, "tree-lock/unheld", [], f"request {r} released lock {h}, held by {who}")
        if self.locks.get(r) == h:
            del self.locks[r]

    def _on_extend(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        r = int(args["request"])
        slots = from_runs(args.get("runs") or ())
        taken = [s for s in slots if self.owner.get(s) != PENDING]
        if taken:
            whose = "that are free" if taken[0] not in self.owner else "held by " + self._who(self.owner[taken[0]])
            self._flag(call, method, "tree-owner/shared", taken, f"request {r}'s row took {len(taken)} slot(s) {whose}")
        for s in slots:
            self._take(s, r)
        self.rows.setdefault(r, []).extend(slots)

    def _on_checkpoint(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        r = int(args["request"])
        if not isinstance(result, (tuple, list)) or len(result) < 3:
            return
        prot, handle = int(result[0]), int(result[2])
        row, old = self.rows.setdefault(r, []), self.protected.get(r, 0)
        new = self.tree.path_slots(result[1])[old:prot]
        lost = []
        for k, s in enumerate(new):
            was = row[old + k] if old + k < len(row) else -1
            if was == s:
                if self.owner.get(s) == r:
                    self._take(s, TREE)  # adopted by the tree
            else:
                if self.owner.get(s) != TREE:
                    self._flag(call, method, "tree-owner/prefix-not-cached", [s],
                               f"the checkpoint gave request {r} slot {s}, which the tree does not hold")
                if was >= 0 and self.owner.get(was) == r:
                    lost.append(was)
        if lost:
            self._lose(call, method, lost, f"the checkpoint replaced {len(lost)} slot(s) of request {r}'s row "
                                           "without freeing or caching them")
        row[old:old + len(new)] = new
        self.protected[r] = prot
        old_handle = self.locks.pop(r, 0)
        old = self.handles.pop(old_handle, None)
        if old is not None:
            self._watch.add(old[1])
        self.handles[handle] = (r, int(result[1]))
        self.locks[r] = handle

    def _on_free_kv_row(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        r = int(args["request"])
        row = self.rows.get(r, [])
        start, end = int(args["start"]), int(args["end"])
        left = [s for s in row[start:end] if s >= 0 and self.owner.get(s) == r]
        if left:
            self._lose(call, method, left, f"free_kv_row({r}, {start}, {end}) left {len(left)} slot(s) of its range "
                                           "neither freed nor cached")
        for i in range(start, min(end, len(row))):
            if row[i] >= 0 and self.owner.get(row[i]) != TREE:
                row[i] = -1

    def _on_release(self, call: int, method: str, args: dict[str, Any], result: Any) -> None:
        r = int(args["request"])
        self._let_go(call, method, r, "gave its row back")
        kept = [s for s, who in self._states.items() if who == r]
        if kept:  # neither freed (drop_state) nor given to the tree (a finished checkpoint)
            self._flag(call, method, "tree-owner/row-leak", kept,
                       f"request {r} gave its row back still holding {len(kept)} state slot(s) it neither freed "
                       "nor gave to the tree", sub="state")
            for s in kept:
                self._states[s] = LOST
        if r in self.locks:
            self._flag(call, method, "tree-lock/held-at-release", [],
                       f"request {r} gave its row back still holding lock {self.locks[r]}")
        self.rows.pop(r, None)
        self.protected.pop(r, None)

    def _let_go(self, call: int, method: str, r: int, what: str) -> None:
        left = [s for s in self.rows.get(r, ()) if s >= 0 and self.owner.get(s) == r]
        if left:
            self._lose(call, method, left, f"request {r} {what} holding {len(left)} slot(s) it neither freed "
                                           "nor gave to the tree")

    def _lose(self, call: int, method: str, slots: list[int], message: str) -> None:
        self._flag(call, method, "tree-owner/row-leak", slots, message)
        for s in slots:
            self._drop(s)

    # -- the books and the nodes ----------------------------------------------------------------------
    def _books(self, call: int, method: str, counters: dict[str, int | None]) -> None:
        avail, evictable, protected = (counters.get(k) for k in ("available", "evictable", "protected"))
        if avail is None or evictable is None or protected is None:
            return
        gap = avail + evictable + protected + self.held - self.total
        if gap == self.gap:
            return
        change, self.gap = gap - self.gap, gap
        if self.first_break is None:
            self.first_break = (call, method, gap)
        if change < 0:
            self._flag(call, method, "tree-books/lost", [],
                       f"{-change} slot(s) lost here: free {avail} + evictable {evictable} + protected {protected} "
                       f"+ held by requests {self.held} = {self.total + gap} of {self.total}")
        else:
            self._flag(call, method, "tree-books/counted-twice", [],
                       f"{change} slot(s) counted twice here: free {avail} + evictable {evictable} + protected "
                       f"{protected} + held by requests {self.held} = {self.total + gap} of {self.total}")

    def _state_books_after(self, call: int, method: str) -> None:
        """sglang's ``[mamba]`` idle check at every call: the build's free state slots, its
        nodes' states (evictable and protected) and what requests and a round's group hold,
        by the calls, make the pool. The trace has no counter columns for them; the build
        says its own, so a tree that lets a state go without freeing it (or counts one
        twice) is named at that call."""
        books = self._state_books()
        if books is None:
            return
        avail, evictable, protected = books
        held = sum(1 for who in self._states.values() if who not in (TREE, LOST))
        gap = avail + evictable + protected + held - self._state_total
        if gap == self._state_gap:
            return
        change, self._state_gap = gap - self._state_gap, gap
        said = (f"free {avail} + evictable {evictable} + protected {protected} + held by requests {held} = "
                f"{self._state_total + gap} of {self._state_total} state slots")
        if change < 0:
            self._flag(call, method, "tree-books/lost", [], f"{-change} state slot(s) lost here: {said}", sub="state")
        else:
            self._flag(call, method, "tree-books/counted-twice", [], f"{change} state slot(s) counted twice here: "
                                                                   f"{said}", sub="state")

    def _nodes(self, call: int, method: str, counters: dict[str, int | None]) -> None:
        seen: dict[int, tuple[int, int]] = {}  # node -> (lock count, slots), along the paths read
        want: dict[int, int] = {}
        for _r, node in self.handles.values():
            for nid, ref, size in self.tree.path(node):
                want[nid] = want.get(nid, 0) + 1
                seen[nid] = (ref, size)
        for node in self._watch:
            for nid, ref, size in self.tree.path(node):
                seen[nid] = (ref, size)
        watch: set[int] = set()
        protected = 0
        for nid, (ref, size) in seen.items():
            held = want.get(nid, 0)
            if ref > 0:
                protected += size
            if ref < 0:
                self._once(call, method, "tree-lock/negative", nid, f"node {nid}'s lock count is {ref}")
            elif ref > held:
                watch.add(nid)
                self._once(call, method, "tree-lock/orphan", nid,
                           f"node {nid} is locked {ref} time(s) but {held} lock(s) are held on it and below it")
            elif ref < held:
                self._once(call, method, "tree-lock/lost", nid,
                           f"node {nid} is locked {ref} time(s) though {held} lock(s) are held on it and below it")
        if len(watch) > _WATCH_MOST:  # a build that orphans a lock per call: count the oldest as they are
            for nid in sorted(watch)[: len(watch) - _WATCH_MOST]:
                watch.discard(nid)
                self._orphaned += seen[nid][1]
        self._watch = watch
        protected += self._orphaned
        got = (counters.get("evictable"), counters.get("protected"))
        if got[0] is None or got[1] is None:
            return
        evictable = self.tree_slots - protected  # what the tree holds, as the calls said, less the locked
        gap = (int(got[0]) - evictable, int(got[1]) - protected)
        if gap != self._size_gap:
            if gap[0] != self._size_gap[0]:
                self._flag(call, method, "tree-size/evictable", [],
                           f"evictable size {got[0]}, but the unlocked nodes hold {evictable}")
            if gap[1] != self._size_gap[1]:
                self._flag(call, method, "tree-size/protected", [],
                           f"protected size {got[1]}, but the locked nodes hold {protected}")
            self._size_gap = gap

    def _once(self, call: int, method: str, rule_id: str, node: int, message: str) -> None:
        if (rule_id, node) not in self._flagged:
            self._flagged.add((rule_id, node))
            self._flag(call, method, rule_id, [], message)

    # -- the end ------------------------------------------------------------------------------------
    def finish(self, call: int) -> dict[str, int]:
        """The idle check sglang makes (free + evictable + protected = the pool, with no
        request running), said with the call that first broke the books and how."""
        tree = self.tree
        if not self.rows:
            avail, evictable, protected = tree.available_size(), tree.evictable_size(), tree.protected_size()
            gap = avail + evictable + protected - self.total
            if gap:
                where = ""
                if self.first_break is not None:
                    at, method, first = self.first_break
                    where = (f"; the books first broke at call {at} ({method}: {abs(first)} slot(s) "
                             f"{'lost' if first < 0 else 'counted twice'})")
                self._flag(call, "finish", "quiescence/tree-idle", [],
                           f"at idle, free {avail} + evictable {evictable} + protected {protected} = "
                           f"{avail + evictable + protected} of {self.total}: {abs(gap)} slot(s) "
                           f"{'lost' if gap < 0 else 'counted twice'}{where}")
        return {SUB: self.held}
