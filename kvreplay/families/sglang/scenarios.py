"""The synth scenarios of sglang's families: the scheduler models that drive them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.errors import BadInput


def check(cfg: Any) -> None:
    if cfg.page_size < 2:
        raise BadInput("--page-size must be at least 2 (the paged and SWA pools page in step)")
    if cfg.full_size < cfg.page_size or cfg.swa_size < cfg.page_size:
        raise BadInput("pool sizes must hold at least one page")
    if cfg.block_tokens % cfg.page_size:
        raise BadInput(f"--block-tokens {cfg.block_tokens} must be a multiple of --page-size {cfg.page_size}")


def pool_ctor(cfg: Any, need_sort: bool = False) -> dict[str, Any]:
    return {"size": cfg.full_size, "size_swa": cfg.swa_size, "page_size": cfg.page_size,
            "need_sort": need_sort, "dtype": "torch.int64"}


def pool_ctor_sorted(cfg: Any) -> dict[str, Any]:
    return pool_ctor(cfg, need_sort=True)


def _common(cfg: Any, progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    return {"seed": cfg.seed, "max_running": cfg.max_running, "speedup": cfg.speedup, "progress": progress,
            "sglang_scheduler": cfg.sglang_scheduler}


def decode(pool: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    from kvreplay.families.sglang.decode import DecodeServer

    return DecodeServer(pool, reqs, **_common(cfg, progress))


def disagg_mtp(pool: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    from kvreplay.families.sglang.disagg_mtp import DisaggMTPServer

    return DisaggMTPServer(pool, reqs, window=cfg.window, k=cfg.k, **_common(cfg, progress))


def radix_swa(pool: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    from kvreplay.families.sglang.radix_swa import RadixSWAServer

    return RadixSWAServer(pool, reqs, window=cfg.window, block_tokens=cfg.block_tokens,
                          draft_steps=cfg.k if cfg.speculative else 0, draft_accept=cfg.draft_accept,
                          **_common(cfg, progress))
