"""The synth scenario of the mamba family: sglang's scheduler on a hybrid model's state pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.errors import BadInput


def check(cfg: Any) -> None:
    from kvreplay.families.mamba import MAX_REQUEST_ROWS, MAX_STATE_SLOTS

    # the trace's own bounds (a replay refuses a bigger pool): said before a scheduler runs
    for flag, value, most, env in (("--state-slots", cfg.state_slots, MAX_STATE_SLOTS, "KVREPLAY_MAX_STATE_SLOTS"),
                                   ("--max-running", cfg.max_running, MAX_REQUEST_ROWS, "KVREPLAY_MAX_REQUEST_ROWS")):
        if value > most:
            raise BadInput(f"{flag} {value:,} is more than {most:,} ({env} raises the limit)")
    if cfg.full_size < cfg.batch_tokens:
        raise BadInput("--full-size (the KV tokens) must hold at least one chunk of --batch-tokens")
    if cfg.state_slots < (2 if cfg.no_extra_buffer else 4):
        raise BadInput("--state-slots must hold one request's slots (three, one without the extra buffer) and one "
                       "for the cache")


def pool_ctor(cfg: Any) -> dict[str, Any]:
    """Rows for every running request, a state pool of ``state_slots``, the tracking pair
    on (two entries: sglang's overlap schedule) unless ``no_extra_buffer`` (then one: no overlap)."""
    extra = not cfg.no_extra_buffer
    return {"size": cfg.max_running, "mamba_size": cfg.state_slots, "extra_buffer": extra,
            "ping_pong": 2 if extra else 1, "max_context_len": cfg.full_size}


def hybrid(wire: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    from kvreplay.families.mamba.scheduler import HybridMambaServer

    return HybridMambaServer(wire, reqs, block_tokens=cfg.block_tokens, kv_tokens=cfg.full_size,
                             max_running=cfg.max_running, chunk=cfg.batch_tokens, aborts=cfg.aborts,
                             seed=cfg.seed, speedup=cfg.speedup, progress=progress)
