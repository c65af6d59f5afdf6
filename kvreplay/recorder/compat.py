"""The CPU compatibility layer: opt-in patches (``kvreplay record --cpu-compat``) that let a
recorded server take paths its engine only runs on a GPU, so that their allocator traffic
can be recorded on a machine without one.

A patch is named, says why it is needed and what it leaves alone, and changes a module of
the engine right after the module is imported, never an allocator: what the allocator is
asked is then what the engine's own scheduler asks, and the trace replays strict-clean on
the unpatched release (the live tier holds each recording to that). Each engine's record
lists its patches (``Engine.cpu_compat``); ``kvreplay record`` turns them on in every
process of the server through ``COMPAT_ENV`` and sets the environment they need."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvreplay.family.record import load
from kvreplay.family.registry import engines

COMPAT_ENV = "KVREPLAY_CPU_COMPAT"


@dataclass(frozen=True)
class Patch:
    name: str
    module: str  # the engine's module it changes, once imported
    why: str  # the path it opens, and why that path cannot run on a CPU as released
    apply: Callable[[ModuleType], None]
    env: dict[str, str] = field(default_factory=dict)  # what the patched path needs (set unless the user did)


def patches() -> list[Patch]:
    """Every engine's patches, in the registry's order."""
    return [p for e in engines() if e.cpu_compat for p in load(e.cpu_compat)]


def compat_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the layer switched on for a server's processes."""
    out = dict(env)
    found = patches()  # each engine's record loaded once
    out[COMPAT_ENV] = ",".join(p.name for p in found)
    for p in found:
        for k, v in p.env.items():
            out.setdefault(k, v)
    return out


_pending: dict[str, list[Patch]] = {}


def install_from_env() -> None:
    """Arm the patches named in ``COMPAT_ENV`` (a no-op without it): each is applied when
    its module is imported, or now if it already is."""
    names = {n for n in os.environ.get(COMPAT_ENV, "").split(",") if n}
    if not names:
        return
    for p in patches():
        if p.name in names:
            _pending.setdefault(p.module, []).append(p)
    for module in list(_pending):
        if module in sys.modules:
            _apply(sys.modules[module])
    if _pending and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _apply(module: ModuleType) -> None:
    for p in _pending.pop(module.__name__, []):
        p.apply(module)
        print(f"kvreplay: cpu-compat patch {p.name} applied to {module.__name__} in process {os.getpid()}",
              file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _apply(module)
