"""Run code on a module right after it is imported, whoever imports it.

The recorder changes a recorded server's modules as they load, without touching its code:
the CPU compatibility patches (compat.py) and the allocators' constructor wrappers
(autorecord.py). Both arm themselves in every process of the server at start-up, before the
engine is imported, so this module imports nothing but the standard library: it runs in
every one of those processes and must stay cheap."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_lock = threading.Lock()  # registrations may come from any thread; imports take their own locks
_waiting: dict[str, list[Callback]] = {}  # module -> what to run once it has executed


def after_import(name: str, callback: Callback) -> None:
    """Run ``callback(module)`` once, when module ``name`` has executed: now if it already
    has, else right after it is imported. What the callback raises reaches whoever ran it
    (this caller, or the import statement), so each user keeps its own failure policy."""
    with _lock:
        loaded = sys.modules.get(name)
        if loaded is None:
            callbacks = _waiting.setdefault(name, [])
            if callback not in callbacks:
                callbacks.append(callback)
            # Checked each time, not remembered: a test (or the program) may take it off.
            if not any(isinstance(f, Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, Finder())
            return
    callback(loaded)


class Finder(importlib.abc.MetaPathFinder):
    """Lets the other finders find a module something waits for, then runs what waits once
    the module has executed. First on ``sys.meta_path``: it must see the import before the
    finder that would load the module."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                # A loader of the legacy API (load_module only) is left alone: nothing to wrap.
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
        # Taken only once the module ran: an import that fails leaves them for the next try.
        with _lock:
            callbacks = _waiting.pop(module.__name__, [])
        for callback in callbacks:
            callback(module)
