"""sglang 0.5.23's scheduler as the tree sees it: the synth model of the tree family.

Requests arrive on the workload's clock. Admission matches the prompt's prefix in the
tree, locks its last node, and allocates the rest in chunks (``chunk`` tokens a step),
caching each finished chunk (a checkpoint, sglang's ``cache_unfinished_req``). When
the pool runs short the scheduler evicts from the tree, and when that is not enough
it retracts the running request with the least progress (its row freed past the
protected part, its lock released, back to the queue). Decoding allocates one slot per
running request in one batched call. A finished request is released as sglang's
``release_kv_cache``: checkpoint (the page-aligned part goes to the tree), free the
rest of its row, unlock, give the row back; an aborted one skips the checkpoint.

Page hashes come from the workload's prompt blocks (equal leading blocks, equal
pages) and each request's own output; no token id is made up or kept."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvreplay.families.tree.runs import from_runs, to_runs
from kvreplay.workload.requests import Request
from kvreplay.workload.server import SteppedModel

_HASH_MASK = (1 << 62) - 1


def page_hashes(req: Request, tokens: int, block_tokens: int, page_size: int) -> list[int]:
    """Chained hashes of the full pages of a request's first ``tokens`` tokens: a prompt
    token is (its block, its place in it), an output token the request's own."""
    out, h = [], 0
    for p in range(tokens // page_size):
        content = []
        for t in range(p * page_size, (p + 1) * page_size):
            b = t // block_tokens
            content.append((req.blocks[b], t % block_tokens) if t < req.input_len and b < len(req.blocks)
                           else (-req.rid - 1, t))
        h = hash((h, tuple(content))) & _HASH_MASK
        out.append(h)
    return out


@dataclass
class Running:
    req: Request
    number: int
    target: int  # tokens when finished
    pages: list[int]  # hashes of every page it will have
    filled: int = 0  # tokens with a slot in its row
    protected: int = 0
    lock: int = 0
    done_output: int = 0
    abort_at: int = -1  # the token count it is aborted at (-1: never)
    sent: int = 0  # pages the tree has been told of
    need: int = 0  # what its admission took of the step's budget


class TreeServer(SteppedModel):
    def __init__(self, tree: Any, requests: list[Request], *, block_tokens: int, max_running: int, chunk: int,
                 aborts: float, seed: int, speedup: float, progress: Callable[[int, int], None] | None,
                 scores: float = 0.0) -> None:
        super().__init__(requests, max_running=max_running, speedup=speedup, progress=progress)
        self.tree = tree
        self.kv = tree.kv
        self.ps = int(tree.page_size)
        self.block_tokens = block_tokens
        self.chunk = chunk
        self.aborts = aborts
        self.scores = scores
        self._scoring: set[int] = set()  # requests that ask for no output token (max_new_tokens=0)
        self.rng = random.Random(seed ^ 0x7EE)
        self.numbers = 0
        self._pages: dict[int, list[int]] = {}  # a request's page hashes, made once
        self._waiting_as: dict[int, int] = {}  # a waiting request's number (rid -> number)
        self._told: dict[int, int] = {}  # pages the tree was told, by request number

    RESERVE = 64  # decode tokens a request's admission keeps room for

    def arrive(self, req: Request) -> None:
        # sglang refuses a request longer than its context before it reaches the tree
        if req.input_len + req.output_len + self.RESERVE > self.tree.kv.size:
            self.stats.extra["too_long"] = self.stats.extra.get("too_long", 0) + 1
            self.stats.requests_done += 1
            return
        # drawn only when asked for, so that a trace made without scoring requests stays as it was
        if self.scores and self.rng.random() < self.scores:
            self._scoring.add(req.rid)
        super().arrive(req)
    # -- admission and prefill ------------------------------------------------------------------
    def step(self) -> None:
        self.tree.available_size()  # the scheduler's look at room before it admits
        before = list(self.running)
        admitted: list[Running] = []
        budget = 0  # what the admitted requests' prefill and decode room takes of the pool
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            req, done = self.waiting[0]
            lv = self.admit(req, done, budget)
            if lv is None:
                break
            self.waiting.popleft()
            admitted.append(lv)
            budget += lv.need
        if admitted:
            self.prefill_batch(admitted)
        prefilling = [lv for lv in before if lv.filled < lv.req.input_len + lv.done_output]
        for lv in prefilling:
            if not self.prefill(lv) and len(self.running) > 1:
                self.retract(lv)
        self.decode([lv for lv in before if lv not in prefilling and lv in self.running])
        self.finish_done()

    def admit(self, req: Request, done_output: int, budget: int) -> Running | None:
        """Match and lock a waiting request, if the rest of its prompt and some room to
        decode fit beside what this step admitted already (``budget``); None: it waits."""
        number = self._waiting_as.get(req.rid)
        if number is None:  # new, or back after a retraction: the tree has not heard of it
            self.numbers += 1
            number = self._waiting_as[req.rid] = self.numbers
        target = req.input_len + (0 if req.rid in self._scoring else req.output_len)
        pages = self._pages.get(req.rid)
        if pages is None:
            pages = self._pages[req.rid] = page_hashes(req, target, self.block_tokens, self.ps)
        lv = Running(req, number, target, pages, done_output=done_output)
        have = req.input_len + done_output
        # each round a waiting request is matched again; the tree keeps the pages it was told
        known = self._told.get(number, 0)
        lv.sent = max(known, have // self.ps)
        # the last token is always computed, so a full hit still extends by one
        got = self.tree.match_prefix(number, tuple(pages[known:lv.sent]), have - 1)
        self._told[number] = lv.sent
        lv.filled = lv.protected = int(got[0])
        # sglang's admission locks the match while it budgets (a lock of its own, released once
        # the request holds its lock), so an eviction cannot take the prefix it counts on
        hold = self.tree.lock(number, int(got[1]))
        lv.need = have - lv.filled + min(req.output_len, self.RESERVE)
        if budget + lv.need > self.tree.available_size() + self.tree.evictable_size():
            self.tree.unlock(number, hold)
            return None
        lv.lock = self.tree.lock(number, int(got[1]))
        self.tree.unlock(number, hold)
        return lv

    def prefill_batch(self, batch: list[Running]) -> None:
        """The admitted requests' first chunks, in one allocation as sglang's prefill batch
        takes them; a batch that finds no room goes one request at a time, and a request
        that finds none gives back its match and waits again, first."""
        sizes = [min(self.chunk, lv.req.input_len + lv.done_output - lv.filled) for lv in batch]
        got = self.room(sum(sizes))
        if got is None:
            self.stats.none_results += 1
        slots = from_runs(got) if got is not None else []
        back = []
        for lv, n in zip(batch, sizes, strict=True):
            if got is not None:
                mine, slots = slots[:n], slots[n:]
                self._write_row(lv, to_runs(mine), n)
            elif not self.prefill(lv):
                self.leave(lv, cache=False)
                del self._waiting_as[lv.req.rid]
                back.append((lv.req, lv.done_output))
                continue
            del self._waiting_as[lv.req.rid]
            if self.rng.random() < self.aborts:
                lv.abort_at = self.rng.randint(lv.req.input_len, lv.target)
            self.stats.prefix_hit_tokens += lv.protected
            self.running.append(lv)
        self.waiting.extendleft(reversed(back))

    def room(self, need: int) -> tuple[int, ...] | None:
        got = self.kv.alloc(need)
        if got is None and self.tree.evictable_size() > 0:
            self.tree.evict(need - self.tree.available_size())
            self.stats.evictions += 1
            got = self.kv.alloc(need)
        return got

    def prefill(self, lv: Running) -> bool:
        have = lv.req.input_len + lv.done_output
        n = min(self.chunk, have - lv.filled)
        got = self.room(n)
        if got is None:
            self.stats.none_results += 1
            return False
        self._write_row(lv, got, n)
        return True

    def _write_row(self, lv: Running, runs: tuple[int, ...], n: int) -> None:
        """``n`` new slots written at the end of the request's row."""
        self.tree.extend(lv.number, runs)
        lv.filled += n
        # each prefill chunk is cached once it is computed, the last one too (sglang 0.5.22's
        # result processing checkpoints every request that is not finished)
        if lv.filled < lv.target:
            self.checkpoint(lv, lv.filled)

    def checkpoint(self, lv: Running, up_to: int, outputs: int | None = None) -> None:
        new = lv.pages[lv.sent: up_to // self.ps]  # the tree keeps the key; a call names what is new
        lv.sent += len(new)
        got = self.tree.checkpoint(lv.number, tuple(new), up_to, **({} if outputs is None else
                                                                     {"outputs": outputs}))
        lv.protected, lv.lock = int(got[0]), int(got[2])

    # -- decode and release ---------------------------------------------------------------------
    def decode(self, batch: list[Running]) -> None:
        if not batch:
            return
        for lv in list(batch):
            if lv.filled == lv.abort_at:
                self.leave(lv, cache=False)
                self.running.remove(lv)
                batch.remove(lv)
                self.stats.requests_done += 1
        while batch:
            got = self.room(len(batch))
            if got is not None:
                break
            self.stats.none_results += 1
            victim = min(batch, key=lambda lv: (lv.filled - lv.req.input_len, -lv.req.input_len))
            if len(self.running) == 1:
                raise RuntimeError(f"request {victim.req.rid} ({victim.target} tokens) cannot fit an empty pool; "
                                   "enlarge the pool (--full-size)")
            self.retract(victim)
            batch.remove(victim)
        if not batch:
            return
        slots = from_runs(got)
        for lv, s in zip(batch, slots, strict=True):
            self.tree.extend(lv.number, (s, 1))
            lv.filled += 1

    def retract(self, lv: Running) -> None:
        """Give back what the request holds past the tree and queue it again, first."""
        self.leave(lv, cache=False)
        self.running.remove(lv)
        self.waiting.appendleft((lv.req, max(0, lv.filled - lv.req.input_len)))
        self.stats.retractions += 1

    def finish_done(self) -> None:
        for lv in [lv for lv in self.running if lv.filled >= lv.target]:
            self.leave(lv, cache=True)
            self.running.remove(lv)
            self.stats.requests_done += 1

    def leave(self, lv: Running, *, cache: bool) -> None:
        """sglang's release_kv_cache: cache the page-aligned part (a finished request),
        free the rest of the row, unlock, give the row back."""
        if cache and lv.filled >= self.ps:
            # its output tokens, as the request counts them: the last one has no slot yet, and a
            # request that asked for none has none
            scoring = lv.target == lv.req.input_len
            self.checkpoint(lv, lv.filled, 0 if scoring else lv.filled - lv.req.input_len + 1)
        # called even when the range is empty (a whole row cached), as release_kv_cache does
        self.tree.free_kv_row(lv.number, lv.protected, max(lv.protected, lv.filled))
        self.tree.unlock(lv.number, lv.lock)
        self.tree.release(lv.number)
        self._told.pop(lv.number, None)

