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

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from kvreplay.contract.record import load
from kvreplay.contract.registry import engines
from kvreplay.recorder.import_hook import Finder as _Finder  # noqa: F401  (the tests take it off sys.meta_path)
from kvreplay.recorder.import_hook import after_import

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
        after_import(module, _apply)  # not caught: a patch that raises fails its module's import


def _apply(module: ModuleType) -> None:
    for p in _pending.pop(module.__name__, []):
        p.apply(module)
        print(f"kvreplay: cpu-compat patch {p.name} applied to {module.__name__} in process {os.getpid()}",
              file=sys.stderr)
