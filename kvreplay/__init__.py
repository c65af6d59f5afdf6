"""kvreplay: record, replay and check the KV-cache pool calls of LLM decode servers.

The public API, for programs and notebooks::

    from kvreplay import record, replay, diff, minimize, bisect, CheckedPool

Names load on first use, so ``import kvreplay`` stays cheap (the pytest plugin and
the recorder's import hook import the package in every process). A public name
stays the API's whatever was imported before: ``replay``, ``minimize`` and
``bisect`` are also modules, and importing one (``kvreplay.replay.worker``) does not
bind it over the function here (it is in ``sys.modules`` as any module is)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from kvreplay.moved import install as _forward_moved_modules
from kvreplay.version import __version__

_forward_moved_modules()  # old import paths keep working, with a warning (moved.py)

# public name -> (module, attribute)
_API = {
    "record": ("kvreplay.recorder.recording", "record"),
    "flight_recorder": ("kvreplay.recorder.flight", "flight_recorder"),
    "TraceReader": ("kvreplay.trace.reader", "TraceReader"),
    "summarize": ("kvreplay.trace.summary", "summarize"),
    "replay": ("kvreplay.replay.dispatch", "replay"),
    "Replayer": ("kvreplay.replay.replayers", "Replayer"),  # any family's (sglang's own: families.sglang.replayer)
    "diff": ("kvreplay.replay.diff", "diff_builds"),
    "minimize": ("kvreplay.jobs.minimize", "minimize"),
    "bisect": ("kvreplay.jobs.bisect", "bisect"),
    "CheckedPool": ("kvreplay.families.sglang.checked", "CheckedPool"),
    "synthesize": ("kvreplay.workload.synth", "synthesize"),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'kvreplay' has no attribute {name!r}")
    module, attr = _API[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return  # the import system binding a submodule under a public name: the name stays the API's
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
