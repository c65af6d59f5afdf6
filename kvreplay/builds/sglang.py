"""Real sglang allocators as builds: which class, and how to construct one without a GPU.

sglang's allocators take a ``kvcache`` argument. Token and paged allocators only keep
it; the SWA allocator requires a ``BaseSWAKVPool`` and registers its full->SWA
mapping with it. Replay needs no KV buffers, so SWA builds get ``MappingOnlySWAKV``:
a subclass of the installed release's ``BaseSWAKVPool`` that holds the mapping and
allocates nothing. Everything here imports sglang lazily: kvreplay works without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvreplay.errors import BuildUnloadable

# Where each family's allocator lives, newest layout first (the allocator package
# was split into modules over the 0.5 series).
CLASSES: dict[str, tuple[str, ...]] = {
    "token": ("sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator",
              "sglang.srt.mem_cache.allocator:TokenToKVPoolAllocator"),
    "paged": ("sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator",
              "sglang.srt.mem_cache.allocator:PagedTokenToKVPoolAllocator"),
    "swa": ("sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator",
            "sglang.srt.mem_cache.allocator:SWATokenToKVPoolAllocator",
            "sglang.srt.mem_cache.swa_memory_pool:SWATokenToKVPoolAllocator"),
}
_BASE_SWA_KV = ("sglang.srt.mem_cache.base_swa_memory_pool:BaseSWAKVPool",
                "sglang.srt.mem_cache.swa_memory_pool:BaseSWAKVPool")

_standin_cls: type | None = None


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _first(paths: tuple[str, ...]) -> tuple[str, Any]:
    errors = []
    for path in paths:
        try:
            return path, _load(path)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
    raise BuildUnloadable("sglang is not importable here (" + "; ".join(errors) + ")")


def is_sglang(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "sglang"


def spec_for(family: str, recorded_class: str = "") -> str:
    """The ``py:`` spec of the installed sglang's allocator for a trace: the class the
    trace was recorded on when it is one of the family's known classes (the trace only
    ever selects among them; it never names a module to import), else the first of
    them this release has."""
    if family in CLASSES and recorded_class in CLASSES[family]:
        try:
            _load(recorded_class)
            return "py:" + recorded_class
        except (ImportError, AttributeError):
            pass  # another layout in this release: fall back to the family's class
    if family not in CLASSES:
        raise BuildUnloadable(f"no sglang allocator for pool family {family!r}")
    path, _ = _first(CLASSES[family])
    return "py:" + path


def version() -> str | None:
    try:
        return str(importlib.import_module("sglang").__version__)
    except Exception:
        return None


def kv_standin() -> Any:
    """A memory-free ``BaseSWAKVPool`` of the installed sglang."""
    global _standin_cls
    if _standin_cls is None:
        _, base = _first(_BASE_SWA_KV)

        class MappingOnlySWAKV(base):  # type: ignore[misc, valid-type]
            """Holds the full->SWA mapping the allocator registers; no KV buffers."""

            def __init__(self) -> None:
                self.full_to_swa_index_mapping = None

            def register_mapping(self, full_to_swa_index_mapping: Any) -> None:
                self.full_to_swa_index_mapping = full_to_swa_index_mapping

            def translate_loc_from_full_to_swa(self, kv_indices: Any) -> Any:
                return self.full_to_swa_index_mapping[kv_indices]

            def get_state_buf_infos(self) -> tuple[list, list, list]:
                return [], [], []

        # The KV-buffer methods (get_key_buffer, ...) are never called by allocators.
        MappingOnlySWAKV.__abstractmethods__ = frozenset()
        _standin_cls = MappingOnlySWAKV
    return _standin_cls()


def needs_kv_standin(cls: type, family: str) -> bool:
    """sglang SWA allocators (and subclasses) insist on a BaseSWAKVPool."""
    if family != "swa":
        return False
    return is_sglang(cls) or any(is_sglang(base) for base in cls.__mro__[1:])
