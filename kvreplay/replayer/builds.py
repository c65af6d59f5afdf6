"""Pool builds: what a build spec names and how a pool is constructed from one.

``builtin:NAME[@VARIANT]`` are kvreplay's reference pools; ``py:MODULE:CLASS`` is
any importable allocator class; ``sglang`` is the installed sglang's allocator of the
trace's family (sglang_adapter.py). A *family* (token, paged, swa) fixes the
constructor signature, so a trace recorded on one build can construct another."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from kvreplay.errors import BuildUnloadable, UnknownBuild
from kvreplay.replayer import pools, sglang_adapter

# Constructor parameters per family, in sglang 0.5.23's positional order.
FAMILY_ARGS: dict[str, tuple[str, ...]] = {
    "token": ("size", "dtype", "device", "kvcache", "need_sort"),
    "paged": ("size", "page_size", "dtype", "device", "kvcache", "need_sort"),
    "swa": ("size", "size_swa", "page_size", "dtype", "device", "kvcache", "need_sort"),
}


@dataclass(frozen=True)
class BuiltinBuild:
    name: str
    family: str
    cls: type
    summary: str


BUILTINS: dict[str, BuiltinBuild] = {
    b.name: b
    for b in [
        BuiltinBuild("token", "token", pools.TokenPool, "token pool (page_size 1), as sglang 0.5.23"),
        BuiltinBuild("paged", "paged", pools.PagedPool, "paged pool, as sglang 0.5.23"),
        BuiltinBuild(
            "swa", "swa", pools.SWAPool,
            "full + SWA pool, as sglang 0.5.23 with #38519 and the alloc_decode None leak fixed",
        ),
        BuiltinBuild(
            "swa@stale-tail", "swa", pools.StaleTailSWAPool,
            "sglang 0.5.12: no #25805, no #27779 (seed double-free bug)",
        ),
        BuiltinBuild(
            "swa@page-partial-clear", "swa", pools.PagePartialClearSWAPool,
            "sglang 0.5.12.post1: #25805 in, #27779 not (released page keeps a mapping)",
        ),
        BuiltinBuild(
            "swa@unfiltered-page0", "swa", pools.UnfilteredPage0SWAPool,
            "#38519: free_swa_segment frees SWA page 0 for unmapped pages",
        ),
        BuiltinBuild(
            "swa@deferred-lookup", "swa", pools.DeferredLookupSWAPool,
            "#36081: grouped free_swa reads the mapping at free_group_end",
        ),
    ]
}


@dataclass(frozen=True)
class Build:
    """A resolved build spec: how to make a pool of its family."""

    spec: str
    family: str | None  # None: decided by the class once loaded (py: builds)
    cls: type

    def construct(self, ctor: dict[str, Any], device: str | torch.device = "cpu") -> Any:
        family = self.family or family_of_class(self.cls)
        kwargs = {name: ctor.get(name) for name in FAMILY_ARGS[family]}
        kwargs["device"] = device
        kwargs["dtype"] = _dtype(kwargs.get("dtype"))
        kwargs["need_sort"] = bool(kwargs.get("need_sort"))
        if kwargs.get("kvcache") is None and sglang_adapter.needs_kv_standin(self.cls, family):
            kwargs["kvcache"] = sglang_adapter.kv_standin()
        return self.cls(**kwargs)


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.startswith("torch."):
        dt = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return dt
    return torch.int64


def resolve(spec: str, family: str | None = None, recorded_class: str = "") -> Build:
    """Turn a build spec into a Build, or raise UnknownBuild with what exists.

    ``sglang`` needs the trace's family (and recorded class, if any) to pick a class."""
    if spec == "sglang":
        if family is None:
            raise UnknownBuild("--build sglang needs a trace (or scenario) to choose the pool family")
        return resolve(sglang_adapter.spec_for(family, recorded_class))
    kind, _, rest = spec.partition(":")
    if kind == "git":
        raise UnknownBuild(f"{spec}: git: builds replay in a worker process (kvreplay replay); this command "
                           "takes in-process builds only (builtin:, py:, sglang)")
    if kind == "builtin" and rest in BUILTINS:
        b = BUILTINS[rest]
        return Build(spec, b.family, b.cls)
    if kind == "builtin":
        known = ", ".join(f"builtin:{n}" for n in BUILTINS)
        raise UnknownBuild(f"unknown build {spec!r}; builtin builds are: {known}")
    if kind == "py":
        module, _, attr = rest.partition(":")
        if not module or not attr:
            raise UnknownBuild(f"bad build spec {spec!r}: expected py:MODULE:CLASS")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except Exception as exc:  # any import-time failure means the build cannot load
            raise BuildUnloadable(f"build {spec!r} could not be loaded: {type(exc).__name__}: {exc}") from None
        return Build(spec, None, cls)
    raise UnknownBuild(f"unknown build {spec!r}: use builtin:NAME, py:MODULE:CLASS or sglang (see `kvreplay builds`)")


def family_of_class(cls: type) -> str:
    """A class's pool family: from a builtin pool it derives from, else from its name
    (sglang's classes say SWA or Paged in theirs)."""
    for base, family in ((pools.SWAPool, "swa"), (pools.PagedPool, "paged"), (pools.TokenPool, "token")):
        if issubclass(cls, base):
            return family
    name = " ".join(c.__name__ for c in cls.__mro__).lower()
    if "swa" in name:
        return "swa"
    if "paged" in name:
        return "paged"
    return "token"


def family_of_pool(pool: Any) -> str:
    if hasattr(pool, "full_to_swa_index_mapping"):
        return "swa"
    if getattr(pool, "page_size", 1) > 1 or hasattr(pool, "num_pages"):
        return "paged"
    return "token"


def ctor_args_of_pool(pool: Any) -> dict[str, Any]:
    """The constructor arguments of a live pool, as a trace records them."""
    family = family_of_pool(pool)
    args: dict[str, Any] = {
        "size": int(getattr(pool, "size_full", pool.size) if family == "swa" else pool.size),
        "dtype": str(getattr(pool, "dtype", torch.int64)),
        "device": str(getattr(pool, "device", "cpu")),
        "need_sort": bool(getattr(pool, "need_sort", False)),
    }
    if family in ("paged", "swa"):
        args["page_size"] = int(pool.page_size)
    if family == "swa":
        args["size_swa"] = int(pool.size_swa)
    return args
