"""Disaggregated decode with EAGLE/MTP speculation on an SWA pool, as SGLang 0.5.23
drives it.

Per request: admission preallocates full KV for the transferred prompt and SWA KV
for its window tail only (``alloc_extend_swa_tail``). Per step: pages that left the
sliding window are freed inside a free group, then one batched ``alloc_extend``
grows every row to ``ceil_page(committed + 2k)`` slots; a random number of draft
tokens is accepted and the rejected slots stay allocated for the next step. On
finish (or retraction), in one free group: ``free_full_segments`` for the dead SWA
range, ``free_segments`` for the live range and a ``free`` of the whole pages past
the committed length. The last live page's slots past ``committed`` are in no
free call: their page is released whole, which is exactly what the stale-tail
bug mishandles.

With ``k`` 0 the server does not speculate: one batched ``alloc_decode`` per step.
With ``sglang_scheduler`` that loop is sglang 0.5.23's (read off a live
disaggregated decode server's trace with ``kvreplay profile``): each turn of the
loop allocates the running batch's next slots, then processes the previous step's
results in a free group (the overlap scheduler: a request ends holding its prompt
plus every output token, the last one's slot allocated before its finish is seen;
one whose single token the prefill side sampled ends at admission, outside any
group), then admits what the transfer queue holds, then slides the windows in a
second free group, every 128 tokens (``SGLANG_SWA_EVICTION_INTERVAL``) and a token
behind."""

from __future__ import annotations

from typing import Any

import torch

from kvreplay.workload.server import Live, ServerModel, ceil_page, floor_page

SWA_EVICTION_INTERVAL = 128  # sglang 0.5.23's default: slide a request's window this many tokens at a time


class DisaggMTPServer(ServerModel):
    def __init__(self, pool: Any, requests: list[Any], *, window: int, k: int, **kw: Any) -> None:
        super().__init__(pool, requests, **kw)
        if window < 1 or k < 0:
            raise ValueError("window must be positive and k not negative")
        self.window = window
        self.k = k
        # Headroom per running request at admission: like SGLang, optimistic, so
        # growth can outrun it and requests get retracted.
        self.reserve = self.ps

    def swa_tail_len(self, fill: int) -> int:
        return fill - floor_page(max(0, fill - self.window), self.ps)

    def step(self) -> None:
        if self.k == 0:
            self.plain_step()
            return
        self.admit()
        if not self.running:
            return
        self.evict_windows()
        if self.grow_for_drafts():
            self.verify_and_finish()

    def plain_step(self) -> None:
        """A turn of the decode loop without speculation (the module's docstring)."""
        if self.running:
            self.decode_plain()
            self.finish_done(self.release)
        self.admit()
        if self.running:
            self.evict_windows()

    def decode_plain(self) -> None:
        pool, ps = self.pool, self.ps
        while True:
            pages = sum(1 for lv in self.running if lv.committed % ps == 0) * ps
            if pages <= min(pool.full_available_size(), pool.swa_available_size()) or len(self.running) == 1:
                break
            self.retract_one()
        self.decode_one_token()

    def admit(self) -> None:
        pool = self.pool
        while self.waiting and len(self.running) < self.max_running:
            req, done = self.waiting[0]
            fill = req.input_len + done
            tail = self.swa_tail_len(fill)
            headroom = (len(self.running) + 1) * self.reserve
            if (pool.full_available_size() < ceil_page(fill, self.ps) + headroom
                    or pool.swa_available_size() < ceil_page(tail, self.ps) + headroom):
                if not self.running:
                    raise RuntimeError(f"request {req.rid} ({fill} tokens) cannot fit an empty pool; enlarge the pool")
                return
            row = pool.alloc_extend_swa_tail(
                self.dev([0]), self.cpu([0]), self.dev([fill]), self.cpu([fill]), self.dev([-1]), fill, tail
            )
            if row is None:
                self.stats.none_results += 1
                return
            self.waiting.popleft()
            live = Live(req, row, committed=fill, target=req.input_len + req.output_len, evicted=fill - tail)
            if self.k == 0 and req.output_len <= 1 and not done:
                self.release(live)  # the prefill side sampled its one token: it ends here
                self.finished(live)
                continue
            self.running.append(live)

    def evict_windows(self) -> None:
        pool = self.pool
        pool.free_group_begin()
        for live in self.running:
            if self.sglang_scheduler:
                # The overlap scheduler: the window is measured before the step's token is in.
                threshold = live.committed - self.window - 1
                if threshold < live.evicted + SWA_EVICTION_INTERVAL:
                    continue
                new = floor_page(threshold, self.ps)
            else:
                new = floor_page(max(0, live.committed - self.window), self.ps)
            if new > live.evicted:
                pool.free_swa_segment(live.row[live.evicted:new], start_pos=live.evicted)
                live.evicted = new
        pool.free_group_end()

    def _growth(self) -> list[tuple[Live, int]]:
        return [(lv, t) for lv in self.running if (t := ceil_page(lv.committed + 2 * self.k, self.ps)) > lv.allocated]

    def grow_for_drafts(self) -> bool:
        """Allocate draft slots; retract requests while the pool cannot hold them."""
        pool, ps = self.pool, self.ps
        while True:
            grow = self._growth()
            if not grow:
                return True
            pages = sum(t // ps - ceil_page(lv.allocated, ps) // ps for lv, t in grow)
            if pages * ps <= min(pool.full_available_size(), pool.swa_available_size()) or len(self.running) == 1:
                break
            self.retract_one()
        prefix = [lv.allocated for lv, _ in grow]
        seq = [t for _, t in grow]
        out = pool.alloc_extend(
            self.dev(prefix), self.cpu(prefix), self.dev(seq), self.cpu(seq),
            self.dev([int(lv.row[-1]) for lv, _ in grow]), sum(seq) - sum(prefix),
        )
        if out is None:
            self.stats.none_results += 1
            self.outgrown()
            self.retract_one()
            return False
        pos = 0
        for (lv, t), a in zip(grow, prefix, strict=True):
            n = t - a
            lv.row = torch.cat((lv.row, out[pos:pos + n]))
            pos += n
        return True

    def verify_and_finish(self) -> None:
        for lv in self.running:
            accepted = self.rng.randint(1, self.k + 1)  # accepted drafts plus the bonus token
            lv.committed = min(lv.committed + accepted, lv.target)
        self.finish_done(self.release)

    def release(self, lv: Live) -> None:
        pool, L, ev = self.pool, lv.committed, lv.evicted
        if ev > 0:
            pool.free_full_segments([(lv.row[:ev], 0)])
        pool.free_segments([(lv.row[ev:L], ev)])
        over = ceil_page(L, self.ps)
        if lv.allocated > over:
            pool.free(lv.row[over:])

    def retract_one(self) -> None:
        victim = self.victim()
        self.pool.free_group_begin()
        self.release(victim)
        self.pool.free_group_end()
        self.retract(victim)

