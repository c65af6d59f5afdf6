"""The synth scenario of the tree family: sglang's scheduler over its prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvreplay.errors import BadInput


def check(cfg: Any) -> None:
    from kvreplay.families.tree import MAX_TREE_SLOTS

    if cfg.full_size > MAX_TREE_SLOTS:
        raise BadInput(f"--full-size {cfg.full_size:,} is more than {MAX_TREE_SLOTS:,} (KVREPLAY_MAX_TREE_SLOTS "
                       "raises the limit)")
    if cfg.full_size < 2 * cfg.max_running:
        raise BadInput("--full-size (the KV slots) must hold a decode step of --max-running requests twice over")


def pool_ctor(cfg: Any) -> dict[str, Any]:
    return {"size": cfg.full_size, "page_size": cfg.page_size, "device": "cpu"}


def server(tree: Any, reqs: Any, cfg: Any, progress: Callable[[int, int], None] | None) -> Any:
    from kvreplay.families.tree import TREE
    from kvreplay.families.tree.scheduler import TreeServer

    # (a configuration made without synth's validation carries no params: the declared defaults)
    params = {p.name: p.default for p in TREE.scenarios[0].params} | dict(cfg.params)
    return TreeServer(tree, reqs, block_tokens=cfg.block_tokens, max_running=cfg.max_running,
                      chunk=int(params["chunk"]), aborts=float(params["abort_share"]),
                      scores=float(params["score_share"]), seed=cfg.seed,
                      speedup=cfg.speedup, progress=progress)
