"""The synth scenario of the vllm family: vLLM's scheduler on its KV-cache manager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.errors import BadInput

# --attention: the manager's KV-cache groups, as a trace names them
# (mamba: a hybrid state-space model's state group, its states cached at block boundaries, beside
# full attention, as vLLM builds it with prefix caching on)
ATTENTION = {"full": "full", "sliding": "sliding_window:{window}", "hybrid": "full,sliding_window:{window}",
             "mamba": "mamba_align,full"}


def check(cfg: Any) -> None:
    if cfg.attention not in ATTENTION:
        from kvreplay.errors import one_of

        one_of("attention", cfg.attention, ATTENTION)
    if cfg.block_tokens < 1 or cfg.full_size < 2 * cfg.block_tokens:
        raise BadInput("--full-size must hold at least two blocks of --block-tokens (block 0 is the null block)")


def pool_ctor(cfg: Any) -> dict[str, Any]:
    """A block pool of ``full_size`` tokens."""
    ctor: dict[str, Any] = {"num_blocks": cfg.full_size // cfg.block_tokens, "block_size": cfg.block_tokens,
                            "hash_block_size": cfg.block_tokens, "max_model_len": cfg.max_model_len or cfg.full_size,
                            # one step in flight: a step's tokens are settled before the next is scheduled
                            "max_in_flight_tokens": cfg.batch_tokens, "enable_caching": cfg.prefix_caching,
                            "watermark": 0.0, "attention": ATTENTION[cfg.attention].format(window=cfg.window)}
    if cfg.eagle:
        ctor["use_eagle"] = True
    return ctor


def prefix(pool: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    from kvreplay.families.vllm.scheduler import VllmPrefixServer

    return VllmPrefixServer(pool, reqs, block_size=cfg.block_tokens, max_running=cfg.max_running,
                            token_budget=cfg.batch_tokens, lookahead=cfg.k if cfg.eagle else 0,
                            speedup=cfg.speedup, align=cfg.attention == "mamba",
                            progress=progress)
