"""The ring's synth scenario: holders take one to four tickets and give a random held
batch back now and then; all are given back at the end."""

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
        self.give_chance = cfg.params["give_chance"]  # its own option: --set give_chance=P

    def run(self) -> SynthStats:
        held: list[tuple[int, ...]] = []
        stats = SynthStats()
        for i in range(self.n):
            self.pool.left()
            got = self.pool.take(self.rng.randint(1, 4))
            if got is None:
                stats.none_results += 1
            else:
                held.append(got)
            if len(held) > 3 and self.rng.random() < self.give_chance:
                self.pool.give(held.pop(self.rng.randrange(len(held))))
            stats.steps += 1
            stats.requests_done += 1
            if self.progress:
                self.progress(i + 1, self.n)
        for h in held:
            self.pool.give(h)
        return stats


def server(pool: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    return _Churn(pool, reqs, cfg, progress)
