"""A model of sglang's scheduler on a hybrid model's request pool (the ``hybrid-mamba``
synth scenario): requests with a recurrent state, a tracking pair, and a prefix cache
that keeps states at block boundaries, read off sglang 0.5.23's scheduler and its Mamba
radix cache.

Each step admits waiting requests in one allocation group: a prefix hit copies the
cached state into a slot of its own, taken from the group; a request that does not fit
gives that copy back. Prompts are prefilled in chunks of ``batch_tokens`` (a continuing
chunk is allocated again and keeps its slots); when a prompt is done its last tracked
state is donated to the cache, a new slot taking its place in the pair. Decoding flips
the pair at every tracking boundary. A finished request keeps the entry of its pair that
holds its last state for the cache; an aborted or retracted one keeps nothing. When
state slots run short, the cache's least recently used states are evicted; when the KV
tokens (``full_size``) run short, the newest request is retracted and waits again."""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvreplay.families.mamba.wire import NONE
from kvreplay.workload.requests import Request
from kvreplay.workload.server import SynthStats

TRACK_INTERVAL = 256  # tokens between tracked states (sglang's mamba_track_interval default)


@dataclass
class _Live:
    req: Request
    number: int
    computed: int = 0  # tokens whose state is computed
    out: int = 0  # tokens generated
    hit: int = 0  # prompt tokens the prefix hit covered


class HybridMambaServer:
    def __init__(self, wire: Any, reqs: list[Request], *, block_tokens: int, kv_tokens: int, max_running: int,
                 chunk: int, aborts: float, seed: int, speedup: float = 1.0,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.wire = wire
        self.slots = wire.wire_state
        self.pending = deque(sorted(reqs, key=lambda r: r.arrival_ms))
        self.total = len(reqs)
        self.block_tokens = block_tokens
        self.kv_tokens = kv_tokens
        self.max_running = max_running
        self.chunk = chunk
        self.aborts = aborts
        self.rng = random.Random(seed)
        self.progress = progress
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.cache: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prefix blocks -> cached state slot
        self.stats = SynthStats(extra={"aborts": 0, "donations": 0, "cow_returns": 0})
        self.now = 0.0
        self.rows = int(wire.ctor_args["size"])
        self.speedup = speedup
        # Without the extra buffer (sglang off GPUs) a request holds its state slot only: the
        # cache copies a prefilled prompt's state into a slot of its own and keeps a finished
        # request's slot in place.
        self.extra = bool(wire.ctor_args["extra_buffer"])

    # -- the prefix cache ---------------------------------------------------------------------
    def _evict(self, need: int) -> None:
        while self.wire.available_size() < need and self.cache:
            _, slot = self.cache.popitem(last=False)
            self.slots.free((slot,))
            self.stats.evictions += 1

    def _match(self, live: _Live) -> int | None:
        blocks = live.req.blocks
        for i in range(len(blocks), 0, -1):
            slot = self.cache.get(blocks[:i])
            if slot is not None:
                self.cache.move_to_end(blocks[:i])
                live.hit = min(i * self.block_tokens, live.req.input_len - 1)
                return slot
        return None

    def _insert(self, key: tuple[int, ...], slot: int) -> None:
        self.cache[key] = slot
        self.cache.move_to_end(key)

    # -- a step -------------------------------------------------------------------------------
    def _kv_used(self) -> int:
        return sum(x.computed for x in self.running)

    def _admit(self) -> None:
        room = min(self.max_running - len(self.running), self.rows - len(self.running), len(self.waiting))
        if room <= 0:
            return
        # the group takes one slot per request it may admit, if that many are free
        group = room if self.wire.available_size() >= room else 0
        self.slots.alloc_group_begin(room)
        batch: list[tuple[_Live, int | None]] = []
        free_needed = 0  # slots alloc_reqs will take off the free list: pairs, states past the group
        kv = self._kv_used()
        while self.waiting and len(batch) < room:
            live = self.waiting[0]
            cow = None
            if self._match(live) is not None:
                got = self.slots.alloc(1)
                if got is None:
                    self._evict(free_needed + 1)
                    got = self.slots.alloc(1)
                if got is not None:
                    cow = got[0]
                    group = max(group - 1, 0)
                    self.wire.set_request(live.number, state=cow)  # the cached state, copied
                else:
                    live.hit = 0
            need = (2 if self.extra else 0) + (1 if cow is None and group == 0 else 0)
            kv_need = min(live.req.input_len - live.hit, self.chunk)
            self._evict(free_needed + need)
            if self.wire.available_size() < free_needed + need or kv + kv_need > self.kv_tokens:
                if cow is not None:  # it does not fit: the copy goes back (sglang #16067)
                    self.slots.free((cow,))
                    self.wire.set_request(live.number, state=NONE)
                    self.stats.extra["cow_returns"] += 1
                live.hit = 0
                break
            if cow is None and group:
                group -= 1
            free_needed += need
            kv += kv_need
            self.waiting.popleft()
            self.stats.prefix_hit_tokens += live.hit
            live.computed = live.hit
            batch.append((live, cow))
        if batch:
            self.wire.alloc_reqs(tuple(x.number for x, _ in batch))
            self.running.extend(x for x, _ in batch)
        self.slots.alloc_group_end()

    def _prefill_and_decode(self) -> None:
        finished: list[_Live] = []
        for live in list(self.running):
            r = live.req
            before = live.computed
            if live.computed < r.input_len:
                if live.computed > live.hit:  # a continuing chunk is allocated again, keeping its slots
                    self.wire.set_request(live.number, kv_len=live.computed)
                    self.wire.alloc_reqs((live.number,))
                live.computed = min(r.input_len, live.computed + self.chunk)
                if live.computed == r.input_len:
                    self._donate(live)
            else:
                live.computed += 1
                live.out += 1
            if before // TRACK_INTERVAL != live.computed // TRACK_INTERVAL:
                last = self.wire.request(live.number).mamba_last_track_idx
                if last is not None:
                    self.wire.set_request(live.number, last=1 - last)
            if live.out >= r.output_len:
                finished.append(live)
            elif live.out > 0 and self.rng.random() < self.aborts / max(r.output_len, 1):
                self._release(live, keep=None)
                self.stats.extra["aborts"] += 1
                self.stats.requests_done += 1
        for live in finished:
            self._finish(live)

    def _donate(self, live: _Live) -> None:
        """The prompt's last tracked state goes to the cache (cache_unfinished_req)."""
        key = live.req.blocks
        if not key or key in self.cache:
            return
        if not self.extra:  # a copy into a slot the cache takes: evict only when none is free, as sglang
            got = self.slots.alloc(1)
            if got is None:
                self._evict(1)
                got = self.slots.alloc(1)
            if got is not None:
                self._insert(key, got[0])
            return
        self._evict(1)
        got = self.slots.alloc(1)
        if got is None:
            return
        self._insert(key, self.wire.donate_track(live.number, got[0]))
        self.stats.extra["donations"] += 1

    def _finish(self, live: _Live) -> None:
        key = live.req.blocks + (-1 - live.number,)  # the whole sequence: its own key
        req = self.wire.request(live.number)
        if not self.extra:  # the cache keeps the request's own state slot
            self._insert(key, int(req.mamba_pool_idx))
            self.wire.free_req(live.number)
            self.running.remove(live)
            self.stats.requests_done += 1
            return
        keep = req.mamba_last_track_idx if req.mamba_ping_pong_track_buffer is not None else None
        kept = int(req.mamba_ping_pong_track_buffer[keep]) if keep is not None else None
        self._release(live, keep=keep)
        if kept is not None:
            self._insert(key, kept)
        self.stats.requests_done += 1

    def _release(self, live: _Live, keep: int | None) -> None:
        self.wire.free_mamba_cache(live.number, keep)
        self.wire.free_req(live.number)
        self.running.remove(live)

    def _retract(self) -> None:
        while self.running and self._kv_used() > self.kv_tokens:
            live = self.running[-1]
            self._release(live, keep=None)
            self.waiting.appendleft(_Live(live.req, live.number))
            self.stats.retractions += 1

    def run(self) -> SynthStats:
        step_ms = 20.0
        while self.pending or self.waiting or self.running:
            while self.pending and self.pending[0].arrival_ms / self.speedup <= self.now:
                r = self.pending.popleft()
                self.waiting.append(_Live(r, r.rid))
            if not self.waiting and not self.running and self.pending:
                self.now = self.pending[0].arrival_ms / self.speedup
                continue
            self._admit()
            self._prefill_and_decode()
            self._retract()
            self.stats.steps += 1
            self.now += step_ms
            if self.progress is not None and self.stats.steps % 64 == 0:
                self.progress(self.stats.requests_done, self.total)
        if self.extra:  # the cache is flushed at the end: nothing is left held
            for slot in list(self.cache.values()):
                self.slots.free((slot,))
            self.cache.clear()
        # Without the extra buffer the model stands for a live recording on a CPU, which
        # ends with the server's cache still holding its states: no flush to compare.
        return self.stats
