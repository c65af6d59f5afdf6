"""vLLM's CPU compatibility patches (``kvreplay record --cpu-compat``; recorder/compat.py).

vLLM resolves asynchronous scheduling (step N+1 scheduled before step N's outputs are
processed) for every platform, then its CPU platform turns it off again ("not required on
CPU"). Its scheduler, engine loop and model runner keep the asynchronous path all the
same, and on a CPU host it is the only way to see what the KV-cache manager is asked
when steps overlap: blocks held across steps, requests with tokens in flight."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from kvreplay.recorder.compat import Patch


def _keep_async_scheduling(module: ModuleType) -> None:
    platform = module.CpuPlatform
    original = platform.check_and_update_config.__func__

    @functools.wraps(original)
    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        # the engine's own resolution (the user's flag, or vLLM's default) before the platform's
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    platform.check_and_update_config = classmethod(check_and_update_config)


PATCHES = (
    Patch("async-scheduling", "vllm.platforms.cpu",
          why="vLLM's CPU platform turns asynchronous scheduling off after the engine resolved it; the patch "
              "keeps the engine's own choice (--async-scheduling, or vLLM's default), so steps overlap as on a GPU",
          apply=_keep_async_scheduling),
)
