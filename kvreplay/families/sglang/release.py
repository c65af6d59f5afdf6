"""Real sglang allocators as builds: which class, and how to construct one without a GPU.

sglang's allocators take a ``kvcache`` argument. Token and paged allocators only keep
it; the SWA allocator asserts it is the release's SWA KV pool and registers its
full->SWA mapping with it (or, before 0.5.8, sets it as an attribute). Replay needs
no KV buffers, so SWA builds get ``MappingOnlySWAKV``: a subclass of the KV-pool
class the allocator's own module checks against (``BaseSWAKVPool`` from 0.5.12,
``SWAKVPool`` before) that holds the mapping and allocates nothing.

The layouts (0.5.1 to 0.5.23): the allocators lived in ``mem_cache/allocator.py``
(SWA there too until 0.5.7), the SWA allocator in ``mem_cache/swa_memory_pool.py``
from 0.5.8 to 0.5.12, and in the ``mem_cache/allocator/`` package from 0.5.13. Before
0.5.8 the SWA allocator takes no ``page_size``: page size 1 only. Everything here
imports sglang lazily: kvreplay works without it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from typing import Any

from kvreplay.contract.record import Family
from kvreplay.contract.registry import family as family_record
from kvreplay.errors import BuildUnloadable, BuildUnsupported, UnknownBuild

# The SWA KV-pool classes an allocator may check its kvcache against, newest first.
_SWA_KV_NAMES = ("BaseSWAKVPool", "SWAKVPool")
_BASE_SWA_KV = ("sglang.srt.mem_cache.base_swa_memory_pool:BaseSWAKVPool",
                "sglang.srt.mem_cache.swa_memory_pool:BaseSWAKVPool",
                "sglang.srt.mem_cache.swa_memory_pool:SWAKVPool",
                "sglang.srt.mem_cache.memory_pool:SWAKVPool")

_standins: dict[type, type] = {}


# The hierarchical cache's host<->device copy kernels. sglang 0.5.6 to 0.5.10 import them
# wherever their prefix tree is imported (through the host pool's module), also on a
# machine where the compiled package is absent or cannot load (a CPU-only install ships
# sgl_kernel without its CPU library). No replay calls them: the host tier is not
# replayed. There, the import gets a stand-in whose names raise when called.
HOST_KERNELS = "sgl_kernel.kvcacheio"


class _AbsentKernels(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{name} was called, but sgl_kernel does not load here: "
                               "kvreplay stood in for it because a pool module imports it, not to run it")
        return absent


def _kernels_standing_in() -> list[str]:
    """Put stand-ins for the host kernels in place where they do not import; the names
    put in place (none: they import, or stand in already)."""
    if HOST_KERNELS in sys.modules:
        return []
    try:
        importlib.import_module(HOST_KERNELS)
        return []
    except Exception:  # absent, or present and failing to load its compiled library
        pass
    top = HOST_KERNELS.partition(".")[0]
    names = [HOST_KERNELS]
    sys.modules[HOST_KERNELS] = _AbsentKernels(HOST_KERNELS)
    if top not in sys.modules:
        package = sys.modules[top] = _AbsentKernels(top)
        package.__path__ = []
        names.append(top)
    return names


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        first = exc
        # only a failure that is sgl_kernel's (absent, or its library not loading) is worth
        # a stand-in: a probe of a layout this release lacks fails on its own module
        if not (str(getattr(exc, "name", None) or "").startswith("sgl_kernel") or "sgl_kernel" in str(exc)):
            raise
        standing = _kernels_standing_in()
        if not standing:
            raise
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception:  # it needs more than the host kernels: say what it first lacked
        for name in standing:
            sys.modules.pop(name, None)
        raise first from None


def _absent(module: str, exc: BaseException) -> bool:
    """Is this the module (or a package above it) not existing, rather than the
    module existing and failing to import?"""
    if isinstance(exc, AttributeError):
        return True
    name = getattr(exc, "name", None)
    return isinstance(exc, ModuleNotFoundError) and name is not None and module.startswith(name)


def _one_line(exc: BaseException) -> str:
    """An import failure in a line: some packages raise pages (sgl_kernel's names every
    place it looked); the first line that says something, and the last, which says why."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else "(no message)"
    return f"{lines[0]} ... {lines[-1]}"


def _first(paths: tuple[str, ...], what: str = "") -> tuple[str, Any]:
    broken = []
    missing = set()  # packages sglang imports that this environment lacks
    for path in paths:
        try:
            return path, _load(path)
        except Exception as exc:  # an old release may fail to import in any way; say how
            if not _absent(path.partition(":")[0], exc):
                broken.append(f"{path}: {type(exc).__name__}: {_one_line(exc)}")
                name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
                if name and not name.startswith(ENGINE):
                    missing.add(name.split(".")[0])
    if broken:
        hint = ""
        if missing:
            hint = (f". sglang's pool code imports {', '.join(sorted(missing))}, which this environment lacks: run "
                    f"kvreplay from an environment with sglang's dependencies (pip install sglang=={version() or 'X'} "
                    "beside kvreplay; scripts/sglang-tier.sh makes one in ~/.cache/kvreplay/venvs)")
        raise BuildUnloadable("sglang does not import here (" + "; ".join(broken) + ")" + hint)
    if version() is None:
        raise BuildUnloadable("sglang is not importable here")
    raise BuildUnsupported(f"sglang {version()} has no {what or 'such class'} (looked for "
                           + ", ".join(p.replace(":", ".") for p in paths) + ")")


ENGINE = "sglang"


def is_sglang(cls: type) -> bool:
    return cls.__module__.split(".")[0] == ENGINE


def spec_for(family: str, recorded_class: str = "") -> str:
    """The ``py:`` spec of the installed sglang's allocator for a trace: the class the
    trace was recorded on when it is one of the family's known classes (the trace only
    ever selects among them; it never names a module to import), else the first of
    them this release has."""
    try:
        classes = family_record(family).release_classes
    except KeyError:
        classes = ()
    if not classes or family_record(family).engine != ENGINE:
        raise BuildUnsupported(f"no sglang allocator for pool family {family!r}")
    if recorded_class in classes:
        try:
            _load(recorded_class)
            return "py:" + recorded_class
        except (ImportError, AttributeError):
            pass  # another layout in this release: fall back to the family's class
    path, _ = _first(classes, f"{family} allocator")
    return "py:" + path


def installed(family: str | None, recorded_class: str = "") -> tuple[str, str | None, type]:
    """The installed sglang's allocator for a trace of ``family``: (spec, family, class)."""
    from kvreplay.builds.resolve import resolve

    if family is None:
        raise UnknownBuild("--build sglang needs a trace (or scenario) to choose the pool family")
    b = resolve(spec_for(family, recorded_class))
    return b.spec, b.family, b.cls


def version() -> str | None:
    try:
        return str(importlib.import_module(ENGINE).__version__)
    except Exception:
        return None


def _swa_kv_base(allocator: type | None) -> type:
    """The SWA KV-pool class ``allocator`` checks its kvcache against: the one its
    own module (or a base class's module) imported, else the release's newest."""
    for cls in (allocator.__mro__ if allocator is not None else ()):
        module = sys.modules.get(cls.__module__)
        for name in _SWA_KV_NAMES:
            found = getattr(module, name, None)
            if isinstance(found, type):
                return found
    return _first(_BASE_SWA_KV, "SWA KV pool class")[1]


def kv_standin(allocator: type | None = None) -> Any:
    """A memory-free SWA KV pool that ``allocator`` (an sglang SWA allocator class)
    accepts; without one, of the installed sglang."""
    base = _swa_kv_base(allocator)
    if base not in _standins:

        class MappingOnlySWAKV(base):  # type: ignore[misc, valid-type]
            """Holds the full->SWA mapping the allocator registers; no KV buffers."""

            def __init__(self) -> None:
                self.full_to_swa_index_mapping = None
                self.full_kv_pool = None  # the sub-allocators keep these, never use them
                self.swa_kv_pool = None

            def register_mapping(self, full_to_swa_index_mapping: Any) -> None:
                self.full_to_swa_index_mapping = full_to_swa_index_mapping

            def translate_loc_from_full_to_swa(self, kv_indices: Any) -> Any:
                return self.full_to_swa_index_mapping[kv_indices]

            def get_state_buf_infos(self) -> tuple[list, list, list]:
                return [], [], []

        # The KV-buffer methods (get_key_buffer, ...) are never called by allocators.
        MappingOnlySWAKV.__abstractmethods__ = frozenset()
        _standins[base] = MappingOnlySWAKV
    return _standins[base]()


def fit_signature(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments ``cls`` takes, from the trace's; an argument the
    class lacks is dropped when it changes nothing (page size 1, need_sort off) and
    makes the build ``unsupported`` when it would."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    kept = {k: v for k, v in kwargs.items() if k in params}
    for name in set(kwargs) - set(kept):
        value = kwargs[name]
        if (name == "page_size" and value not in (None, 1)) or (name == "need_sort" and value):
            raise BuildUnsupported(f"{cls.__module__}.{cls.__name__} takes no {name} (the trace uses "
                                   f"{name}={value}; this release supports only the default)")
    return kept


def construct(fam: Family, cls: type, ctor: dict[str, Any], device: Any) -> Any:
    """A pool of ``cls`` (a builtin pool or an sglang allocator) from a trace's
    constructor arguments: tensors on ``device``, sglang's signature of the release."""
    return cls(**_kwargs(fam, cls, ctor, device))


def construct_swa(fam: Family, cls: type, ctor: dict[str, Any], device: Any) -> Any:
    """The same for an SWA allocator: sglang's (and subclasses) insist on an SWA KV
    pool, which a replay has none of: they get the memory-free stand-in."""
    kwargs = _kwargs(fam, cls, ctor, device)
    if kwargs.get("kvcache") is None and (is_sglang(cls) or any(is_sglang(b) for b in cls.__mro__[1:])):
        kwargs["kvcache"] = kv_standin(cls)
    return cls(**kwargs)


def _kwargs(fam: Family, cls: type, ctor: dict[str, Any], device: Any) -> dict[str, Any]:
    from kvreplay.builds.resolve import dtype_of

    kwargs = {name: ctor.get(name) for name in fam.ctor_args}
    kwargs["device"] = device
    kwargs["dtype"] = dtype_of(kwargs.get("dtype"))
    kwargs["need_sort"] = bool(kwargs.get("need_sort"))
    if is_sglang(cls):
        kwargs = fit_signature(cls, kwargs)
    return kwargs
