"""The registry of pool families and engines: the one place that lists them.

Each family package under ``kvreplay/families/`` exports ``FAMILIES`` (and, for an
engine's families, ``ENGINE``); adding a family is its folder plus one line in
``PACKAGES``. A family kept outside kvreplay is a package of the same shape named in
``KVREPLAY_FAMILIES`` (comma-separated modules, imported at first use, in every
kvreplay process that inherits the variable: replay workers, recorded servers);
``register`` adds one at run time."""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvreplay.contract.record import BuiltinBuild, Engine, Family, Scenario
from kvreplay.errors import BadInput
from kvreplay.limits import shown

# The family packages kvreplay ships, one line each.
PACKAGES: tuple[str, ...] = (
    "kvreplay.families.sglang",
    "kvreplay.families.vllm",
    "kvreplay.families.mamba",
    "kvreplay.families.tree",
)
FAMILIES_ENV = "KVREPLAY_FAMILIES"  # more family packages, outside kvreplay (a user's configuration)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

_families: dict[str, Family] = {}
_engines: dict[str, Engine] = {}
_loaded = False
_generation = 0  # changes whenever a family is registered or removed: views of them rebuild


def generation() -> int:
    _load()
    return _generation


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    extra = [m.strip() for m in os.environ.get(FAMILIES_ENV, "").split(",") if m.strip()]
    for name in extra:
        if not _MODULE.fullmatch(name):
            raise BadInput(f"{FAMILIES_ENV}: {shown(name)} is not a module name (want comma-separated "
                           "packages, each exporting FAMILIES)")
    for name in [*PACKAGES, *extra]:
        try:
            pkg = importlib.import_module(name)
        except ImportError as exc:
            raise BadInput(f"{FAMILIES_ENV} names {name!r}, which does not import: {exc}") from None
        if not isinstance(getattr(pkg, "FAMILIES", None), (list, tuple)):
            raise BadInput(f"{FAMILIES_ENV} names {name!r}, which is no family package (it exports no FAMILIES)")
        if getattr(pkg, "ENGINE", None) is not None:
            register_engine(pkg.ENGINE)
        for fam in pkg.FAMILIES:
            register(fam)


def register(fam: Family) -> Family:
    """Add a family (or replace one of the same name); returns it."""
    _load()
    if fam.engine is not None and fam.engine not in _engines:
        raise ValueError(f"family {fam.name!r} names engine {fam.engine!r}, which is not registered")
    names = {b.name for b in fam.builtins}
    for other in _families.values():
        if other.name != fam.name and names & {b.name for b in other.builtins}:
            raise ValueError(f"family {fam.name!r} reuses builtin build names of family {other.name!r}")
    _families[fam.name] = fam
    _bump()
    return fam


def _bump() -> None:
    global _generation
    _generation += 1


def unregister(name: str) -> None:
    _load()
    _families.pop(name, None)
    _bump()


def register_engine(engine: Engine) -> Engine:
    _engines[engine.name] = engine
    return engine


def families() -> list[Family]:
    """Every registered family, in registration order."""
    _load()
    return list(_families.values())


def family_names() -> list[str]:
    return [f.name for f in families()]


def family(name: str) -> Family:
    """The family's record; KeyError naming the families there are."""
    _load()
    try:
        return _families[name]
    except KeyError:
        raise KeyError(f"pool family {name!r} is not one of {', '.join(_families)}") from None


def is_family(name: Any) -> bool:
    _load()
    return isinstance(name, str) and name in _families


def engines() -> list[Engine]:
    _load()
    return list(_engines.values())


def engine(name: str) -> Engine | None:
    _load()
    return _engines.get(name)


def git_engine() -> str:
    """The engine whose trees a ``git:`` build without a class names."""
    return next(e.name for e in engines() if e.git_trees)




def same_engine(a: str, b: str) -> bool:
    """Do traces of families ``a`` and ``b`` come from one engine's API (their
    figures compare)?"""
    fa, fb = family(a), family(b)
    return a == b or (fa.engine is not None and fa.engine == fb.engine)


def family_of_pool(pool: Any) -> str:
    """A live pool's family, from the state it keeps."""
    for fam in sorted(families(), key=lambda f: -f.specificity):
        if fam.detect(pool):
            return fam.name
    raise ValueError(f"{type(pool).__name__} is a pool of no registered family")


def ctor_args_of_pool(pool: Any) -> dict[str, Any]:
    """The constructor arguments of a live pool, as a trace records them."""
    return family(family_of_pool(pool)).ctor_of(pool)




def unit_of(sub_pool: str) -> str:
    """What a sub-pool's sizes and counts are in (slots, blocks, ...)."""
    for fam in families():
        if sub_pool in fam.sub_pools:
            return fam.unit
    return "slots"


def sub_allocators() -> tuple[tuple[str, str], ...]:
    """(target in traces, attribute) of every family's sub-allocators: the calls a
    recorder records nested, under their target's name."""
    seen: dict[str, str] = {}
    for fam in families():
        for target, attr in fam.sub_allocators:
            seen.setdefault(target, attr)
    return tuple(seen.items())


class LiveView(Mapping[str, Any]):
    """A mapping made from the registered families, made again only when a family is
    registered or removed: every family's builds, scenarios, rules, ..."""

    def __init__(self, make: Callable[[], dict[str, Any]]) -> None:
        self._make = make
        self._made: tuple[int, dict[str, Any]] = (-1, {})

    def _all(self) -> dict[str, Any]:
        gen = generation()
        if self._made[0] != gen:
            self._made = (gen, self._make())
        return self._made[1]

    def __getitem__(self, key: str) -> Any:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __contains__(self, key: object) -> bool:
        return key in self._all()


# Every method name a trace of any family may hold (as keys).
_METHODS = LiveView(lambda: dict.fromkeys(m for f in families() for m in f.methods))


def all_methods() -> Mapping[str, Any]:
    """Every method name a trace of any family may hold (``in`` asks it)."""
    return _METHODS


# What kind of call each method name is, from the families' vocabularies: the first
# family that has the method says (the shipped families agree where their names meet).
_KINDS = LiveView(lambda: {m: f.vocabulary.kind(m) for f in reversed(families()) for m in f.methods})


def method_kind(method: str) -> str:
    """alloc | free | free-group | read, or the method itself: the kind a failure names."""
    return _KINDS.get(method, method)


BUILTINS: Mapping[str, BuiltinBuild] = LiveView(lambda: {b.name: b for f in families() for b in f.builtins})
SCENARIOS: Mapping[str, Scenario] = LiveView(lambda: {s.name: s for f in families() for s in f.scenarios})


def record_classes() -> tuple[str, ...]:
    """The engine classes a recorder patches in a running server, every family's."""
    return tuple(p for f in families() if f.recorded_by_default for p in f.release_classes)
