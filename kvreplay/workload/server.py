"""What every simulated decode server shares: the request queue, the step clock,
per-request kv rows, and tensor helpers that shape calls the way SGLang does
(device tensors plus their ``*_cpu`` twins)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvreplay.workload.requests import Request

STEP_MS = 20.0


@dataclass
class SynthStats:
    """What a run of the model did: scheduler steps and finished requests, what it
    answered out-of-memory with (None results, retractions), the prefix cache's work,
    and scenario-specific counts in ``extra``."""

    steps: int = 0
    requests_done: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    none_results: int = 0
    retractions: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0


@dataclass
class Live:
    """A running request: its kv row (full-pool token slots) and progress."""

    req: Request
    row: torch.Tensor
    committed: int  # tokens whose KV is kept (kv_committed_len)
    target: int  # input + output tokens when finished
    evicted: int = 0  # SWA freed below this row position (page-aligned)
    prefix_len: int = 0  # leading part owned by the prefix cache
    protected: int = 0  # leading part the tree owns once the prompt is cached (sglang: cache_protected_len)
    tree_slid: bool = False  # the tree has freed the cached prompt's out-of-window SWA
    nodes: list[Any] = field(default_factory=list)

    @property
    def allocated(self) -> int:
        return int(self.row.numel())


def ceil_page(n: int, ps: int) -> int:
    return (n + ps - 1) // ps * ps


def floor_page(n: int, ps: int) -> int:
    return n // ps * ps


class SteppedModel:
    """A scheduler model's clock: requests arrive at their trace times (divided by
    ``speedup``) and the model steps until every one is done. Subclasses say what an
    arrival is (``arrive``) and what a step does (``step``)."""

    def __init__(self, requests: list[Request], *, max_running: int, speedup: float,
                 progress: Callable[[int, int], None] | None) -> None:
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival_ms, r.rid)))
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self.max_running = max_running
        self.speedup = speedup
        self.total = len(requests)
        self.stats = SynthStats()
        self.clock_ms = 0.0
        self._progress = progress

    def arrive(self, req: Request) -> None:
        self.waiting.append((req, 0))  # (request, tokens already generated)

    def run(self) -> SynthStats:
        while self.pending or self.waiting or self.running:
            self.clock_ms += STEP_MS
            while self.pending and self.pending[0].arrival_ms / self.speedup <= self.clock_ms:
                self.arrive(self.pending.popleft())
            if not self.running and not self.waiting and self.pending:
                self.clock_ms = self.pending[0].arrival_ms / self.speedup
                continue
            self.step()
            self.stats.steps += 1
            if self._progress:
                self._progress(self.stats.requests_done, self.total)
            if self.stats.steps > 200 * self.total + 10_000:
                raise RuntimeError("workload model made no progress (pool too small for one request?)")
        self.finish_run()
        return self.stats

    def step(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish_run(self) -> None:
        """What the server does once the queue is empty."""


class ServerModel(SteppedModel):
    """Drives ``pool`` with ``requests``; subclasses implement ``step``."""

    def __init__(self, pool: Any, requests: list[Request], *, seed: int, max_running: int,
                 speedup: float = 1.0, progress: Callable[[int, int], None] | None = None,
                 sglang_scheduler: bool = False) -> None:
        super().__init__(requests, max_running=max_running, speedup=speedup, progress=progress)
        self.pool = pool
        self.ps = int(pool.page_size)
        self.device = pool.device
        self.rng = random.Random(seed ^ 0x5EED)
        # As sglang 0.5.23's scheduler (measured against live servers, kvreplay profile):
        # every batch's results are processed inside a free group, empty or not, and
        # the server keeps its cache at the end instead of draining it. Off by default,
        # so that the corpus' committed traces stay what their commands make.
        self.sglang_scheduler = sglang_scheduler

    # -- tensors shaped like the scheduler's ---------------------------------
    def dev(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    @staticmethod
    def cpu(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    def finish_run(self) -> None:
        if not self.sglang_scheduler:
            self.drain()

    def drain(self) -> None:
        """Release whatever the server still holds once the queue is empty."""

    def finished(self, live: Live) -> None:
        self.stats.requests_done += 1

    def victim(self) -> Live:
        """The request SGLang retracts first: fewest output tokens, then longest prompt."""
        return min(self.running, key=lambda lv: (lv.committed - lv.req.input_len, -lv.req.input_len))

    def decode_one_token(self) -> None:
        """One batched ``alloc_decode``: a slot for the next token of every running request."""
        seq = [lv.committed + 1 for lv in self.running]
        out = self.pool.alloc_decode(self.dev(seq), self.cpu(seq), self.dev([int(lv.row[-1]) for lv in self.running]))
        if out is None:
            self.stats.none_results += 1
            self.outgrown()
            return
        for i, lv in enumerate(self.running):
            lv.row = torch.cat((lv.row, out[i:i + 1]))
            lv.committed += 1

    def finish_done(self, release: Callable[[Live], None]) -> None:
        """Finished requests leave in one free group, as at the end of an SGLang step."""
        done = [lv for lv in self.running if lv.committed >= lv.target]
        if not done and not self.sglang_scheduler:
            return
        self.pool.free_group_begin()
        for lv in done:
            release(lv)
        self.pool.free_group_end()
        for lv in done:
            self.running.remove(lv)
            self.finished(lv)

    def batch_done(self) -> None:
        """A prefill batch's results: sglang processes them in a free group too."""
        if self.sglang_scheduler:
            self.pool.free_group_begin()
            self.pool.free_group_end()

    def outgrown(self) -> None:
        """An allocation failed; with one request left nothing can ever free room."""
        if len(self.running) == 1:
            lv = self.running[0]
            raise RuntimeError(
                f"request {lv.req.rid} ({lv.target} tokens) cannot fit an empty pool; enlarge the pool"
            )

    def retract(self, live: Live) -> None:
        """Put a request back at the head of the queue, keeping its progress."""
        self.running.remove(live)
        self.waiting.appendleft((live.req, live.committed - live.req.input_len))
        self.stats.retractions += 1
