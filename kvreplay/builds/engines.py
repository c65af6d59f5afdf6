"""The engines kvreplay records: the classes a recorder patches in a running server,
and what it records for an instance of one (sglang's allocators as they are; vLLM's
KV-cache manager through a wire, builds/vllm.py)."""

from __future__ import annotations

from typing import Any

from kvreplay.builds import sglang, vllm

# sglang's allocators wherever a release keeps them (0.5.1 to 0.5.23: builds/sglang.py
# knows the layouts) and vLLM's manager; the paths an install lacks are never imported,
# so they cost nothing.
RECORD_CLASSES: tuple[str, ...] = (
    *(path for family in ("token", "paged", "swa") for path in sglang.CLASSES[family]),
    *vllm.CLASSES["vllm"],
)


def recordable(obj: Any) -> Any:
    """What a recording of ``obj`` records: a wire in front of an engine object whose
    calls carry values a trace cannot hold, else the object itself."""
    return vllm.attach(obj) if vllm.is_manager(obj) else obj
