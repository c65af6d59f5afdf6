"""Invariants of a block pool (vLLM's KV-cache manager family), checked at the call
that breaks them.

A block pool hands out blocks by reference count: a block is free (in the free queue,
an eviction candidate if it carries a hash) exactly when no request holds it. The
checker reads the pool and the manager's block tables through the wire
(``state_view``) and keeps its own count of owners per block, so a block listed twice
in one free, or freed while a request still lists it, is caught at that call.

Per call it looks at the blocks the call named (its nested block-pool calls), their
neighbours in the free queue, and the block table of the request it served; the whole
pool (free-queue links, every cached hash) every ``full_check_every`` calls that made a
block-pool call, and at the end. A call that made none changed no block (every change
to a block goes through the pool's methods, which the wire sees), so counting only the
calls that did keeps the O(pool) walk's cost in step with what can break, not with the
decode tokens that fit their last block."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvreplay.check.growth import RULE as GROWTH_RULE
from kvreplay.check.growth import GrowthWatch
from kvreplay.check.rules import RULES, Violation, ViolationLog
from kvreplay.families.vllm.vocabulary import STATE_WINDOW


class BlockPoolChecker:
    # methods that change what the checker tracks without a block-pool call of their own
    WITHOUT_NESTED = frozenset({"pop_blocks_for_free"})

    def __init__(self, wire: Any, *, full_check_every: int = 1000, keep: int = 20) -> None:
        self.wire = wire
        self.pool = wire.pool
        self.full_check_every = full_check_every
        self.log = ViolationLog(keep=keep)
        self.owners: Counter[int] = Counter()  # block id -> block tables (and pending frees) that list it
        self.tables: dict[str, list[int]] = {}  # request id -> its block table, as last seen
        self.popped: Counter[int] = Counter()  # blocks popped for a free that has not happened yet
        self.calls = 0
        self.in_group = False  # the recorder's checkpoints ask; a block pool has no free groups
        # Sliding-window groups, (window, block size) each: their pruning is held to the steps
        # in flight (_window_reads). A wire that cannot say (an older builtin) has none.
        windows = getattr(wire, "windows", None)
        self.windows: tuple[tuple[int, int], ...] = windows() if windows is not None else ()
        self.window_tables: dict[str, tuple[tuple[int, ...], ...]] = {}  # request id -> as last seen
        self.stale_states: dict[str, set[int]] = {}  # request id -> Mamba state blocks flagged as kept
        null = getattr(self.pool, "null_block", None)
        self._null = null.block_id if null is not None else -1  # the pool keeps one null block for life
        self._null_below = False  # the null block's count is below zero (flagged when it got there)
        self.growth = GrowthWatch(wire, len(self.pool.blocks))

    # -- reporting --------------------------------------------------------------------------
    def _flag(self, call: int, method: str, rule_id: str, blocks: list[int], message: str) -> None:
        rule = RULES[rule_id]  # a rule not in the table is a bug here: KeyError
        self.log.add(Violation(call, method, rule.invariant, rule.rule, "blocks", sorted(blocks)[:64], message, call))

    # -- per call -------------------------------------------------------------------------------
    def after(self, call: int, method: str, args: dict[str, Any], result: Any,
              nested: list[tuple[str, Any]]) -> None:
        """Check what call ``call`` did: ``nested`` are its block-pool calls in order,
        each (method, the block ids it handed out or named)."""
        if not nested and method not in self.WITHOUT_NESTED:
            # no block-pool call: no block changed hands and no block table changed (a decode
            # token that fits its last block, a lookup, a step boundary)
            return
        self.calls += 1
        owners = self.owners
        named: set[int] = set()
        # blocks this call freed before handing blocks out: a sliding window lets go of the
        # blocks that left it and may get one of them straight back in the same call (a plain
        # dict, made only when a call frees: a Counter's missing keys cost a Python call each)
        released: dict[int, int] = {}
        for m, ids in nested:
            if not ids:
                continue
            named.update(ids)
            if m == "free_blocks":
                for b in ids:
                    released[b] = released.get(b, 0) + 1
            elif m == "get_new_blocks":
                held = [b for b in ids if owners.get(b, 0) > released.get(b, 0)]
                if held:
                    self._flag(call, method, "block-pool/handout-while-held", held,
                               f"get_new_blocks handed out block(s) a request still holds: {held[:8]}")
        rid = args.get("request_id")
        if method == "pop_blocks_for_free" and result:
            self.popped.update(result)
            self.owners.update(result)
        if method == "free_blocks" and args.get("block_ids"):  # a free the scheduler made itself
            for b in args["block_ids"]:
                if self.popped[b] > 0:
                    self.popped[b] -= 1
                    self.owners[b] -= 1
        if isinstance(rid, str):
            named.update(self._retable(rid))
            if self.windows:
                self._window_reads(call, method, rid, args)
        # A block that passes every per-block rule costs one look here; one that does not
        # goes through _check_block for its messages.
        blocks, null, total = self.pool.blocks, self._null, len(self.pool.blocks)
        for b in named:
            if b == null or not 0 <= b < total:
                continue
            blk = blocks[b]
            ref, prev, nxt = blk.ref_cnt, blk.prev_free_block, blk.next_free_block
            if (ref != owners.get(b, 0) or (ref == 0) == (prev is None and nxt is None)
                    or (prev is not None and prev.next_free_block is not blk)
                    or (nxt is not None and nxt.prev_free_block is not blk)):
                self._check_block(call, method, b)
        if null >= 0 and (blocks[null].ref_cnt < 0) != self._null_below:
            # The null block stands in for blocks a sliding window let go; every table may
            # list it many times and no free may count it. Flagged where it first goes below
            # zero, not at every call after.
            self._null_below = not self._null_below
            if self._null_below:
                self._flag(call, method, "block-pool/null-block-ref-count", [null],
                           f"the null block's reference count went to {blocks[null].ref_cnt}: a free counted it")
        if self.full_check_every and self.calls % self.full_check_every == 0:
            self.full_check(call, method)

    def _retable(self, rid: str) -> set[int]:
        """Take the request's block table from the manager; the blocks whose count changed."""
        now = [b for b in self.wire.held_blocks(rid) if b != self._null]
        before = self.tables.get(rid, [])
        if now == before:
            return set()
        if now:
            self.tables[rid] = now
        else:
            self.tables.pop(rid, None)
        k = len(before)
        if len(now) > k and now[:k] == before:  # the common case: blocks appended to the table
            added = now[k:]
            self.owners.update(added)
            return set(added)
        self.owners.subtract(before)
        self.owners.update(now)
        return set(before) | set(now)

    def _window_reads(self, call: int, method: str, rid: str, args: dict[str, Any]) -> None:
        """A sliding window may let go of a block only once no step still to run or still in
        flight reads it. With asynchronous scheduling the request's computed tokens count the
        steps scheduled but not yet processed (``num_in_flight_tokens``); the earliest of
        them, at position ``settled``, reads ``[settled - window + 1, settled]``. A block of
        that range taken out of the request's table is one whose memory the pool may hand
        to another request while a step still reads it."""
        if method == "free_request":
            self.window_tables.pop(rid, None)  # its whole table goes: the request's own end
            self.stale_states.pop(rid, None)
            return
        before = self.window_tables.get(rid)
        now = self.wire.window_tables(rid)
        self.window_tables[rid] = now
        computed = args.get("request_num_computed_tokens")
        if not before or type(computed) is not int:
            return
        total = computed + int(args.get("num_new_computed_tokens") or 0) + int(
            args.get("num_external_computed_tokens") or 0)
        settled = max(0, total - int(args.get("request_num_in_flight_tokens") or 0))
        for (window, size), old, new in zip(self.windows, before, now):  # noqa: B905 - same groups
            # the earliest position a step to come reads; a Mamba group's step reads the
            # state after the token before it
            first_read = settled - window + 1 if window != STATE_WINDOW else settled - 1
            if window == STATE_WINDOW and method == "allocate_slots":
                self._state_retired(call, method, rid, new, first_read // size)
            kept = set(new)  # a block moved along the table (a drafter's) is not let go
            gone = [b for i, b in enumerate(old) if b >= 0 and (i + 1) * size > first_read and b not in kept]
            if gone:
                in_flight = total - settled
                what = f"the {window}-token window" if window != STATE_WINDOW else "the Mamba group"
                self._flag(call, method, "block-pool/window-freed-in-flight", gone,
                           f"{what} let go of block(s) {gone[:8]} that "
                           + (f"a step in flight still reads ({in_flight} token(s) scheduled, not yet processed: "
                              f"the first, at position {settled}, reads from {max(0, first_read)})"
                              if in_flight else f"the next token, at position {settled}, reads "
                                                f"(from {max(0, first_read)})"))

    def _state_retired(self, call: int, method: str, rid: str, table: tuple[int, ...], first: int) -> None:
        """An allocation lets a Mamba group's request keep only the state blocks from the one
        a step to come reads (index ``first``): a state block before it that stays in the
        table is memory no step reads, held until the request ends. Each such block is
        flagged once."""
        stale = [b for b in table[:max(0, first)] if b >= 0]
        if not stale:
            return
        seen = self.stale_states.setdefault(rid, set())
        fresh = [b for b in stale if b not in seen]
        if fresh:
            seen.update(fresh)
            self._flag(call, method, "block-pool/state-not-retired", fresh,
                       f"the Mamba group kept state block(s) {fresh[:8]} before block {first}, which holds the "
                       "state the request's next step reads: no step reads them, yet they stay out of the pool")

    def _check_block(self, call: int, method: str, b: int) -> None:
        if b == self._null or not 0 <= b < len(self.pool.blocks):
            return
        block = self.pool.blocks[b]
        ref = block.ref_cnt
        owners = self.owners[b]
        if ref < 0:
            self._flag(call, method, "block-pool/negative-ref-count", [b],
                       f"block {b} has reference count {ref}")
        elif ref != owners:
            self._flag(call, method, "block-pool/ref-count-not-owners", [b],
                       f"block {b} has reference count {ref}, but {owners} block table(s) list it")
        prev, nxt = block.prev_free_block, block.next_free_block
        queued = prev is not None or nxt is not None
        if (ref == 0) != queued and ref >= 0:
            self._flag(call, method, "block-pool/free-queue-mismatch", [b],
                       f"block {b} has reference count {ref} and is {'' if queued else 'not '}in the free queue")
        # its neighbours must point back at it: a queue relinked wrong shows at the call that
        # relinked it, not at the next walk of the whole queue
        if (prev is not None and prev.next_free_block is not block) or (
                nxt is not None and nxt.prev_free_block is not block):
            self._flag(call, method, "block-pool/free-queue-links", [b],
                       f"the free queue's links around block {b} do not agree")

    # -- the whole pool ---------------------------------------------------------------------------
    def full_check(self, call: int, method: str) -> None:
        q = self.pool.free_block_queue
        seen: set[int] = set()
        node = q.fake_free_list_head.next_free_block
        steps = 0
        limit = len(self.pool.blocks) + 1
        while node is not None and node is not q.fake_free_list_tail and steps < limit:
            if node.block_id in seen:
                self._flag(call, method, "block-pool/free-queue-links", [node.block_id],
                           f"block {node.block_id} is in the free queue twice")
                break
            seen.add(node.block_id)
            if node.next_free_block is not None and node.next_free_block.prev_free_block is not node:
                self._flag(call, method, "block-pool/free-queue-links", [node.block_id],
                           f"the free queue's links around block {node.block_id} do not agree")
                break
            node = node.next_free_block
            steps += 1
        if len(seen) != q.num_free_blocks:
            self._flag(call, method, "block-pool/free-queue-links", sorted(seen)[:8],
                       f"the free queue links {len(seen)} blocks but counts {q.num_free_blocks}")
        null = self._null
        if null in seen:
            self._flag(call, method, "block-pool/null-block-free", [null], "the null block is in the free queue")
        # Every block in bulk (one pass over plain values); the per-block check, with its
        # messages, only for the blocks that fail it.
        blocks = self.pool.blocks
        owners = self.owners
        suspects = [b.block_id for b in blocks
                    if b.ref_cnt != owners.get(b.block_id, 0) or (b.ref_cnt == 0) == (b.prev_free_block is None)]
        for b in suspects:
            if b != null:
                self._check_block(call, method, b)
        for key, ids in self.wire.cached_blocks():
            for b in ids:
                if blocks[b].block_hash != key:
                    self._flag(call, method, "block-pool/stale-cached-hash", [b],
                               f"a cached hash maps to block {b}, which carries another hash")
        for path, size in self.growth.sample():
            self._flag(call, method, GROWTH_RULE, [size], self.growth.message(path, size))

    def finish(self, call: int) -> dict[str, int]:
        """At the end: the whole pool, and with no request left, no block held."""
        self.full_check(call, "end")
        held = [b for b, blk in enumerate(self.pool.blocks) if b != self._null and blk.ref_cnt > 0]
        if held and not self.tables and not +self.popped:
            self._flag(call, "end", "quiescence/held-block", held,
                       f"{len(held)} block(s) are still referenced with no request holding them")
        return {"blocks": len(held)} if held else {}
