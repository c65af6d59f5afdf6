"""The toy family's synth scenario: requests take a few slots each and give them back
in another order, some inside a free group."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from kvreplay.workload.server import SynthStats


def ctor(cfg: Any) -> dict[str, Any]:
    return {"size": cfg.full_size, "device": "cpu"}


class _Churn:
    def __init__(self, pool: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> None:
        self.pool, self.n, self.rng, self.progress = pool, len(reqs), random.Random(cfg.seed), progress

    def run(self) -> SynthStats:
        held: list[Any] = []
        stats = SynthStats()
        for i in range(self.n):
            self.pool.available_size()
            got = self.pool.alloc(self.rng.randint(1, 4))
            if got is None:
                stats.none_results += 1
            else:
                held.append(got)
            if len(held) > 3:
                self.pool.free_group_begin()
                for _ in range(2):
                    self.pool.free(held.pop(self.rng.randrange(len(held))))
                self.pool.free_group_end()
            stats.steps += 1
            stats.requests_done += 1
            if self.progress:
                self.progress(i + 1, self.n)
        for h in held:
            self.pool.free(h)
        return stats


def server(pool: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    return _Churn(pool, reqs, cfg, progress)
