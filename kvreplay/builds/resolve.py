"""From a build spec to a pool: which class, and how to construct it for a trace.

A trace records its pool family and constructor arguments; a build of the same
family is constructed from them, the way the family's record says."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from kvreplay.builds.spec import BuildSpec
from kvreplay.contract.record import load
from kvreplay.contract.registry import BUILTINS, engine, families, family
from kvreplay.errors import BadInput, BuildUnloadable, FamilyMismatch, UnknownBuild
from kvreplay.trace.format import POOL_DTYPES


@dataclass(frozen=True)
class Build:
    """A resolved build spec: how to make a pool of its family."""

    spec: str
    family: str | None  # None: decided by the class once loaded (py: builds)
    cls: type

    def construct(self, ctor: dict[str, Any], device: str | torch.device = "cpu") -> Any:
        fam = family(self.family or family_of_class(self.cls))
        return load(fam.construct)(fam, self.cls, ctor, device)


def dtype_of(value: Any) -> torch.dtype:
    """A trace's dtype name as a torch dtype (int64 where this torch lacks it)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in POOL_DTYPES:
        dt = getattr(torch, value.removeprefix("torch."), None)  # absent from an older torch: int64 serves
        if isinstance(dt, torch.dtype):
            return dt
    return torch.int64


def resolve(spec: str | BuildSpec, family: str | None = None, recorded_class: str = "") -> Build:
    """Turn a build spec into a Build, or raise UnknownBuild with what exists.

    ``sglang`` needs the trace's family (and recorded class, if any) to pick a class."""
    s = spec if isinstance(spec, BuildSpec) else BuildSpec.parse(spec)
    eng = engine(s.kind)
    if eng is not None:  # the installed engine's pool for the trace's family
        return Build(*load(eng.installed)(family, recorded_class))
    if s.kind == "git":
        raise UnknownBuild(f"{s}: git: builds replay in a worker process (kvreplay replay); this command "
                           "takes in-process builds only (builtin:, py:, sglang)")
    if s.kind == "builtin":
        b = BUILTINS[s.name]
        return Build(s.text, b.family, b.cls)
    module, _, attr = s.cls.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # any import-time failure means the build cannot load
        raise BuildUnloadable(f"build {s.text!r} could not be loaded: {type(exc).__name__}: {exc}") from None
    if not isinstance(cls, type):
        raise UnknownBuild(f"build {s.text!r} names a {type(cls).__name__}, not an allocator class")
    return Build(s.text, None, cls)


def family_of_class(cls: type) -> str:
    """A class's pool family: from a family's base class it derives from (the most
    specific family first), else from the words in its names (sglang's classes say SWA
    or Paged in theirs), else the least specific family of all."""
    ranked = sorted(families(), key=lambda f: -f.specificity)
    for fam in ranked:
        if any(issubclass(cls, load(b)) for b in fam.base_classes):
            return fam.name
    name = " ".join(c.__name__ for c in cls.__mro__).lower()
    for fam in ranked:
        if any(w in name for w in fam.class_words):
            return fam.name
    return ranked[-1].name


def load_build(spec: str, family: str, ctor: dict[str, Any], device: str, recorded_class: str = "") -> Any:
    """A pool of ``spec`` built from a trace's family and constructor arguments."""
    build = resolve(spec, family, recorded_class)
    bfam = build.family or family_of_class(build.cls)
    if bfam != family:
        raise FamilyMismatch(family, spec, bfam)
    try:
        return build.construct(ctor, device=device)
    except (TypeError, ValueError, AttributeError, RuntimeError, AssertionError) as exc:
        raise BuildUnloadable(f"{spec} could not be constructed from the trace's arguments: {exc}") from None


def resolve_device(device: str) -> str:
    """``auto`` | ``cpu`` | ``cuda[:N]``, checked against this machine."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}: no CUDA device is available here")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise BadInput(f"--device {device}: no such CUDA device (this machine has {torch.cuda.device_count()})")
    elif device != "cpu":
        raise BadInput(f"--device {device}: use auto, cpu, cuda or cuda:N")
    return device


