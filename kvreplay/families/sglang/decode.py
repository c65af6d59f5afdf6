"""Continuous batching on a paged pool (no prefix cache, no speculation): batched
prefill with ``alloc_extend``, one ``alloc_decode`` per step for the whole batch,
retraction with ``free`` when the next step cannot fit, and ``free_segments`` of
finished rows inside a free group."""

from __future__ import annotations

from typing import Any

from kvreplay.workload.server import Live, ServerModel, ceil_page


class DecodeServer(ServerModel):
    def step(self) -> None:
        self.admit()
        if self.running:
            self.decode()
            self.finish()

    def admit(self) -> None:
        ps = self.ps
        budget = self.pool.available_size() - len(self.running) * ps
        batch: list[tuple[Any, int]] = []
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            req, done = self.waiting[0]
            fill = req.input_len + done
            need = ceil_page(fill, ps) + ps
            if need > budget:
                if not self.running and not batch:
                    raise RuntimeError(f"request {req.rid} ({fill} tokens) cannot fit an empty pool; enlarge the pool")
                break
            budget -= need
            batch.append(self.waiting.popleft())
        if not batch:
            return
        fills = [r.input_len + d for r, d in batch]
        n = len(batch)
        out = self.pool.alloc_extend(
            self.dev([0] * n), self.cpu([0] * n), self.dev(fills), self.cpu(fills), self.dev([-1] * n), sum(fills)
        )
        if out is None:
            self.stats.none_results += 1
            self.waiting.extendleft(reversed(batch))
            return
        pos = 0
        for (req, _), fill in zip(batch, fills, strict=True):
            self.running.append(Live(req, out[pos:pos + fill], committed=fill, target=req.input_len + req.output_len))
            pos += fill
        self.batch_done()

    def decode(self) -> None:
        pool, ps = self.pool, self.ps
        while True:
            new_pages = sum(1 for lv in self.running if (lv.committed + 1) % ps == 1)
            if new_pages * ps <= pool.available_size() or len(self.running) == 1:
                break
            victim = self.victim()
            pool.free(victim.row)
            self.retract(victim)
        self.decode_one_token()

    def finish(self) -> None:
        self.finish_done(lambda lv: self.pool.free_segments([(lv.row, 0)]))
