"""What a family's parts must be, as typed Protocols, and a check of a record against them.

A family's record (record.py) names most of its code as ``MODULE:ATTR`` strings: its
replayer, its checker, how a build is made, the wire a recording puts in front of an
engine object, its checks beyond the shared ones, its scenarios' servers. The
Protocols below say what each of those must be: which parameters the shared code
passes, which methods and attributes it then reads, and who calls it when.
docs/families.md is the same contract in prose, for an engineer adding a family.

``conformance(fam)`` loads every part a record names and returns one line per breach
(an empty list: the record holds); ``replay_conformance(fam, replayer)`` checks what
only a built replayer shows (its checker, its pool). tests/test_contract.py holds
every registered family to both.

This module sits in the contract layer: it imports nothing above it (tests/layers.py)
and no torch. The parts it checks are loaded by name (``record.load``), as every job
loads them; a replayer is checked by its shape, not by ``isinstance`` of the shared
run loop (``kvreplay.replay.loop.ReplayLoop``, a layer above)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from kvreplay.contract.record import Engine, Family, load

# What the annotations below name but this layer cannot import (they live above it).
Report = Any  # kvreplay.replay.report.ReplayReport
TopCall = Any  # kvreplay.trace.format.TopCall: one top-level call with its nested rows
Violation = Any  # kvreplay.check.rules.Violation
Stats = Any  # kvreplay.workload.server.SynthStats, or what a scenario's model gives instead


# -- the replayer ---------------------------------------------------------------------------------
# The options the shared code passes a replayer's constructor, by keyword, whatever the
# trace's family (the CLI's replay, dispatch, the replay worker, minimize, diff, the
# watch, segments): a replayer names each or takes **options.
REPLAYER_OPTIONS: tuple[str, ...] = (
    "reader", "mode", "device", "full_check_every", "stop_at_first", "check", "keep", "checked", "start",
    "after_gap",
)
# and, to one whose class says ``replays_segments``, the segment to replay (replay --jobs)
SEGMENT_OPTION = "segment"


@runtime_checkable
class Replayer(Protocol):
    """One replay of one trace against one build: what ``Family.replayer`` makes.

    Made by ``kvreplay.replay.replayers.make_replayer`` (replay, diff, minimize, bisect,
    the matrix, ci, the replay worker, the watch) as ``cls(trace, build, *, reader=...,
    **options)`` with ``REPLAYER_OPTIONS``; the shared run loop
    (``kvreplay.replay.loop.ReplayLoop``, which a replayer subclasses) provides ``run``,
    ``report`` and ``found_something`` and calls the hooks ``calls_to_replay``, ``step``,
    ``first_row`` and ``ends_at``. The jobs then read the attributes below: diff and the
    watch call ``step`` themselves, call by call; the watch and the worker listen on
    ``checker.log``; segments read ``calls``, ``divergences``, ``ended_at``, ...

    A constructor calls ``ReplayLoop._start_loop()`` first (it sets ``calls``,
    ``divergences``, ``div_counts``, ``translated``, ``unsupported``, ``capacity_call``,
    ``start_after``, ``ended_at``) and sets the rest."""

    nested_args: bool  # whether ``step`` needs the nested rows' arguments decoded (the watch decodes so)
    replays_segments: bool  # whether it can start at a checkpoint and end at one (replay --jobs)
    reader: Any  # kvreplay.trace.reader.TraceReader (the watch: a stand-in for a trace being written)
    meta: Any  # the trace's TraceMeta (family, ctor_args, pool_class, ...)
    build_spec: str  # the build as the user gave it: findings name it
    mode: str  # strict | remap
    device: str
    pool: Any  # the build's pool (or the wire in front of it): dispatch names its version from it
    checker: Checker | None  # None: the replay runs unchecked (check=False)
    timeline: Any  # kvreplay.replay.timeline.Timeline: to_dict() goes into the report
    keep: int
    stop_at_first: bool
    calls: int
    divergences: list[Any]
    div_counts: Mapping[str, int]
    translated: Mapping[str, int]
    unsupported: str | None
    capacity_call: int | None
    start_after: int
    ended_at: int | None

    def run(self, progress: Callable[[int, int], None] | None = None,
            calls: Iterable[TopCall] | None = None) -> Report:
        """Replay every call (the shared loop's); gives the ReplayReport."""
        ...

    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        """Issue one recorded call on the build, compare it, check it: what the build
        returned or raised."""
        ...

    def calls_to_replay(self) -> Iterable[TopCall]:
        """The trace's top-level calls, decoded as ``step`` needs them."""
        ...

    def first_row(self) -> int:
        """The row the calls start at (a segment's checkpoint; else 0)."""
        ...

    def ends_at(self, c: Any, row: int) -> bool:
        """Whether the replay ends at this gap or checkpoint row (a segment's end)."""
        ...

    def found_something(self) -> bool: ...

    def report(self, wall: float, held: dict[str, int], stopped: bool) -> Report: ...


class ReplayerClass(Protocol):
    """What ``Family.replayer`` names: the class itself. ``make_replayer`` calls it."""

    nested_args: bool
    replays_segments: bool

    def __call__(self, trace: Any, build: Any, *, reader: Any = None, **options: Any) -> Replayer: ...


# -- the checker ----------------------------------------------------------------------------------
@runtime_checkable
class FindingLog(Protocol):
    """A checker's ``log`` (``kvreplay.check.rules.ViolationLog``): every finding
    counted, the first few of each rule kept. The run loop asks ``total`` (stop at the
    first), reports read ``kept`` and ``counts``, the worker asks ``first()``; a
    replayer's timeline and the watch set ``listener`` (told of each violation)."""

    keep: int
    kept: list[Violation]
    counts: dict[tuple[str, str], int]
    listener: Callable[[Violation], None] | None

    @property
    def total(self) -> int: ...

    def first(self) -> Violation | None: ...

    def add(self, v: Violation) -> None: ...


@runtime_checkable
class Checker(Protocol):
    """A family's invariant checker, as the shared code sees it (what
    ``Family.checker`` makes; its replayer makes and feeds it).

    How it hears each call (``after(...)``, and what ``after`` is given) is between a
    family's replayer and its checker, and differs per family. The shared code reads
    ``log`` (the run loop, the watch, the worker, segments) and calls ``finish(call)``
    once, at the end of a whole replay: the end-of-trace checks (quiescence), giving
    what is still held, per sub-pool."""

    log: FindingLog

    def finish(self, call: int) -> dict[str, Any]: ...


@runtime_checkable
class CheckpointingChecker(Checker, Protocol):
    """A checker whose knowledge can be carried across a checkpoint: needed by a
    replayer that ``replays_segments`` (each segment starts from a checkpoint's checker
    state) and by a recording's checkpoints (``kvreplay record --checkpoint-every``)."""

    in_group: bool  # no checkpoint inside a free group

    def state(self) -> Any:
        """What it knows beyond the pool's state, as JSON."""
        ...

    def restore(self, state: Any) -> None: ...

    def adopt(self) -> None:
        """Start from the pool's state now (a trace that begins with a snapshot)."""
        ...


class CheckerClass(Protocol):
    """What ``Family.checker`` names: made by its replayer (and a recording's
    checkpoints) as ``cls(subject, full_check_every=N, keep=K)``, ``subject`` being
    what the family's checker reads: the pool's view (sglang's), the wire (vLLM's,
    mamba's)."""

    def __call__(self, subject: Any, *, full_check_every: int = ..., keep: int = ...) -> Checker: ...


@runtime_checkable
class FamilyChecks(Protocol):
    """A family's checks beyond the shared checker's: what ``Family.checks`` makes, for
    a family replayed by the shared (sglang-shaped) checker. The shared checker
    (``kvreplay.families.sglang.checker.InvariantChecker``) makes it once per replay as
    ``checks(view, shadows, flag)`` and calls each method at the moment it names;
    ``kvreplay.check.family_checks.FamilyChecks`` is a base class of no-ops to
    override. ``flag(call, method, invariant, rule, sub, indices, message,
    detected=None)`` reports a finding (the rule must be in the family's ``rules``)."""

    @property
    def pending(self) -> bool: ...

    def reset(self) -> None: ...

    def adopt(self) -> None: ...

    def state(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def peers_before_free(self, method: str, pages: Any) -> Any: ...

    def mapped(self, call: int, method: str, args: dict[str, Any]) -> None: ...

    def after_alloc(self, call: int, method: str, args: dict[str, Any], tokens: Any) -> None: ...

    def after_free(self, call: int, method: str, pages: Any, before: Any) -> None: ...

    def settle(self, call: int) -> None: ...

    def full_check(self, call: int, method: str, free_by_sub: dict[str, Any], final: bool) -> None: ...


class ChecksHook(Protocol):
    """What ``Family.checks`` names: ``(view, shadows, flag) -> FamilyChecks`` (a
    FamilyChecks subclass is one)."""

    def __call__(self, view: Any, shadows: dict[str, Any], flag: Callable[..., None]) -> FamilyChecks: ...


# -- builds ---------------------------------------------------------------------------------------
class PoolBuild(Protocol):
    """What ``Family.construct`` names: how a build of the family is made for a trace.
    ``kvreplay.builds.resolve.Build.construct`` calls it as ``construct(fam, cls, ctor,
    device)`` for every replay, synth and recording check: ``cls`` is the build's class
    (a builtin pool or variant, a ``py:`` class, an engine release's class), ``ctor``
    the trace's constructor arguments. It gives the pool the replayer drives (or the
    wire in front of it)."""

    def __call__(self, fam: Family, cls: type, ctor: dict[str, Any], device: Any) -> Any: ...


class Variant(Protocol):
    """A builtin build's class (``BuiltinBuild.where``): the family's correct pool (its
    first builtin) or a bug variant of it (``NAME@what``, a subclass that overrides one
    hook). Built only through the family's PoolBuild, with what it passes; the class
    must derive from one of the record's ``base_classes`` (so a ``py:`` build of a
    subclass is known to be of the family)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class InstalledBuild(Protocol):
    """What ``Engine.installed`` names: the installed engine's pool for a trace,
    ``(family, recorded_class) -> (spec, family or None, class)``; called by
    ``kvreplay.builds.resolve.resolve`` for a ``--build ENGINE`` and by the replay
    worker for release builds."""

    def __call__(self, family: str | None, recorded_class: str = "") -> tuple[str, str | None, type]: ...


# -- recording: the wire and the live face --------------------------------------------------------
@runtime_checkable
class Wire(Protocol):
    """A family's calls in wire form: an object that stands in front of an engine's
    pool whose calls carry what a trace row cannot hold (Request objects, block
    objects), and speaks them as plain values (requests by number or id, slots and
    blocks by id). A recording records the wire's calls; a replay drives a wire its
    PoolBuild put in front of a fresh pool (or a builtin pool that speaks the wire
    itself). Besides the family's ``methods`` and its ``sub_allocators`` it has the
    members below, and one in front of an engine's object says that object's class as
    ``recorded_class`` (MODULE:CLASS, the trace's pool_class: a replay on
    ``--build ENGINE`` builds that class)."""

    ctor_args: dict[str, Any]  # the pool's constructor arguments, as the trace records them

    def available_size(self) -> int:
        """The counter its rows carry (``available``)."""
        ...


class LiveFace(Protocol):
    """What ``Family.wire`` names: ``(engine object) -> Wire | None``. A recorder asks
    every family's (``kvreplay.builds.engines.recordable``) for each object it is about
    to record in a running server; the first wire given is recorded instead of the
    object (its shims pass the server's own calls through to the engine's methods)."""

    def __call__(self, obj: Any) -> Wire | None: ...


# -- synth ----------------------------------------------------------------------------------------
@runtime_checkable
class ScenarioServer(Protocol):
    """A model of a server's scheduler driving a pool: what ``Scenario.server`` gives.
    ``kvreplay synth`` (``kvreplay.workload.synth.run_model``) calls ``run()`` once,
    the pool under the recorder; a RuntimeError is the user's input (BadInput), an
    AssertionError the pool's own (the trace so far is kept)."""

    def run(self) -> Stats: ...


class ScenarioServerFactory(Protocol):
    """What ``Scenario.server`` names: ``(pool, requests, cfg, progress) ->
    ScenarioServer``; ``cfg`` is the SynthConfig, ``progress(done, total)`` or None."""

    def __call__(self, pool: Any, requests: Any, cfg: Any,
                 progress: Callable[[int, int], None] | None) -> ScenarioServer: ...


class ScenarioCtor(Protocol):
    """What ``Scenario.ctor`` names: ``(cfg) -> the pool's constructor arguments``."""

    def __call__(self, cfg: Any) -> dict[str, Any]: ...


class ScenarioCheck(Protocol):
    """What ``Scenario.check`` names: ``(cfg) -> None``, raising BadInput for sizes the
    scenario cannot take (before any pool is made)."""

    def __call__(self, cfg: Any) -> None: ...


# -- profile figures ------------------------------------------------------------------------------
class ProfileHook(Protocol):
    """What ``Family.profile`` names: ``(figures, call) -> None``. ``kvreplay profile``
    (``kvreplay.trace.profile.profile``) reads a trace's top-level calls once, counts
    calls and occupancy itself, and hands each call to this hook, which adds what the
    call says to ``figures`` (``kvreplay.trace.profile.Figures``: tokens per admitted
    request, decode batches, slots per free, free groups, prefix hits, request ids)."""

    def __call__(self, figures: Any, call: Any) -> None: ...


# -- the record's callables (not strings: the record holds them) ----------------------------------
class Detect(Protocol):
    """``Family.detect(pool) -> bool``: is this live pool (or wire) one of this family;
    asked most specific family first (``registry.family_of_pool``) by a recorder."""

    def __call__(self, pool: Any) -> bool: ...


class CtorOf(Protocol):
    """``Family.ctor_of(pool)``: a live pool's constructor arguments, as a trace records
    them (a recorder writes them in the trace's meta)."""

    def __call__(self, pool: Any) -> dict[str, Any]: ...


class SizesOf(Protocol):
    """``Family.sizes_of(ctor)``: each sub-pool's capacity (keys: ``sub_pools``), from
    constructor arguments; the first is the capacity a profile's occupancy divides by,
    the others sizes a timeline and reports show."""

    def __call__(self, ctor: dict[str, Any]) -> dict[str, int]: ...


class CheckCtor(Protocol):
    """``Family.check_ctor(ctor)``: raises ValueError for constructor arguments no
    build of the family takes (a trace's, read before anything is built)."""

    def __call__(self, ctor: dict[str, Any]) -> None: ...


class ValueBounds(Protocol):
    """``Family.value_bounds(ctor)``: argument name -> ``trace.bounds.Bound``, what each
    argument of its calls may hold on a pool of these sizes (checked per row)."""

    def __call__(self, ctor: dict[str, Any]) -> dict[str, Any]: ...


# -- checking a record ----------------------------------------------------------------------------
SEVERITIES = ("corrupts", "leaks", "misreports")  # as kvreplay.check.rules.SEVERITIES (a test holds them equal)
UNITS = ("slots", "blocks")  # what a family's sizes and counts are in
# Where the trace schema's counter columns and the reads that fill them are named: loaded
# by name (the trace layer sits above this one); a schema without them skips the check.
_SCHEMA_COUNTERS = "kvreplay.trace.format:COUNTERS"


def members(proto: type) -> list[str]:
    """The names a Protocol asks for: its methods, properties and annotated attributes
    (``__call__`` the one dunder), in the order it declares them, bases first."""
    out: dict[str, None] = {}
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol) or cls.__module__ == "typing":
            continue
        for name in [*vars(cls).get("__annotations__", {}), *vars(cls)]:
            if name == "__call__" or not name.startswith("_"):
                out.setdefault(name)
    return list(out)


def _methods(proto: type) -> list[str]:
    """A Protocol's methods (not its attributes nor properties)."""
    return [n for n in members(proto) if inspect.isfunction(getattr(proto, n, None)) and n != "__call__"]


def missing(obj: Any, proto: type) -> list[str]:
    """What ``obj`` lacks of ``proto``: a name absent, or a method that is no callable."""
    methods = set(_methods(proto))
    out = []
    for name in members(proto):
        if name == "__call__":
            if not callable(obj):
                out.append(name)
            continue
        try:
            value = getattr(obj, name)
        except Exception:  # a property that cannot answer yet is as good as absent
            out.append(name)
            continue
        if name in methods and not callable(value):
            out.append(name)
    return out


def _params(fn: Any) -> str:
    try:
        return "(" + ", ".join(inspect.signature(fn).parameters) + ")"
    except (TypeError, ValueError):
        return "(?)"


def _binds(fn: Any, positional: int, keywords: Iterable[str] = ()) -> bool:
    """Can ``fn`` be called with this many positional arguments and these keywords?
    (True where Python cannot tell its signature: a builtin.)"""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        sig.bind(*([None] * positional), **dict.fromkeys(keywords))
    except TypeError:
        return False
    return True


class _Breaches:
    """Breach lines of one record, each ``FAMILY: FIELD: what is wrong``."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.lines = prefix, []

    def add(self, where: str, what: str) -> None:
        self.lines.append(f"{self.prefix}: {where}: {what}")

    def load(self, where: str, name: Any) -> Any:
        """The object ``MODULE:ATTR`` names, or None with the breach said."""
        if not isinstance(name, str) or name.count(":") != 1 or not all(name.split(":")):
            self.add(where, f"{name!r} is not a MODULE:ATTR name")
            return None
        try:
            return load(name)
        except Exception as exc:  # any failure to import is the breach itself
            self.add(where, f"{name} does not load ({type(exc).__name__}: {str(exc)[:160]})")
            return None

    def callable_taking(self, where: str, name: str, fn: Any, positional: int, called: str,
                        keywords: Iterable[str] = ()) -> bool:
        if fn is None:
            return False
        if not callable(fn):
            self.add(where, f"{name} is a {type(fn).__name__}, not callable")
            return False
        if not _binds(fn, positional, keywords):
            self.add(where, f"{name} takes {_params(fn)}; it is called as {called}")
            return False
        return True


def _schema(name: str) -> tuple[str, ...] | None:
    try:
        return tuple(load(name))
    except Exception:
        return None


def conformance(fam: Family) -> list[str]:
    """Every way ``fam``'s record breaks the contract, one line each (``[]``: none).
    Loads each part the record names (its code is imported); calls none of them."""
    b = _Breaches(getattr(fam, "name", "?"))
    _shape(fam, b)
    _builtins(fam, b)
    _replayer(fam, b)
    _checker(fam, b)
    _hooks(fam, b)
    _other_names(fam, b)
    _scenarios(fam, b)
    _rules(fam, b)
    return b.lines


def _unique(b: _Breaches, where: str, names: Iterable[Any]) -> None:
    seen: set[Any] = set()
    twice: set[str] = set()
    for n in names:
        if n in seen:
            twice.add(str(n))
        seen.add(n)
    if twice:
        b.add(where, f"names {', '.join(sorted(twice))} more than once")


def _subset(b: _Breaches, where: str, names: Iterable[str], of: Iterable[str], what: str) -> None:
    extra = sorted(set(names) - set(of))
    if extra:
        b.add(where, f"{', '.join(extra)} not among its {what}")


def _shape(fam: Family, b: _Breaches) -> None:
    """The record's own fields: names, sizes, methods, sub-pools and their counters."""
    if not fam.name or not isinstance(fam.name, str):
        b.add("name", "empty")
    if not fam.ctor_args:
        b.add("ctor_args", "empty: a trace records the constructor's arguments")
    _unique(b, "ctor_args", fam.ctor_args)
    _subset(b, "sizes", fam.sizes, fam.ctor_args, "ctor_args")
    _subset(b, "units", fam.units, fam.sizes, "sizes")
    if not fam.methods:
        b.add("methods", "empty: a recorder wraps them, a replay calls them")
    _unique(b, "methods", fam.methods)
    _subset(b, "housekeeping", fam.housekeeping, fam.methods, "methods")
    _subset(b, "void_methods", fam.void_methods, fam.methods, "methods")
    vocabulary = getattr(fam, "vocabulary", None)
    for part in ("allocs", "frees", "groups", "reads"):
        _subset(b, f"vocabulary.{part}", getattr(vocabulary, part, ()), fam.methods, "methods")
    if fam.unit not in UNITS:
        b.add("unit", f"{fam.unit!r} is not one of {', '.join(UNITS)}")
    if not fam.sub_pools:
        b.add("sub_pools", "empty: the first is the capacity's")
    _unique(b, "sub_pools", fam.sub_pools)
    if len(fam.sub_counters) != len(fam.sub_pools):
        b.add("sub_counters", f"{len(fam.sub_counters)} counter column(s) for {len(fam.sub_pools)} sub-pool(s) "
                              f"({', '.join(fam.sub_pools)}): one each, in order")
    _unique(b, "sub_counters", fam.sub_counters)
    columns = _schema(_SCHEMA_COUNTERS)
    if columns is not None:
        _subset(b, "sub_counters", fam.sub_counters, columns, f"trace schema's counter columns ({', '.join(columns)})")
        if len(fam.counter_reads) > len(columns):
            b.add("counter_reads", f"{len(fam.counter_reads)} reads for the trace schema's {len(columns)} counter "
                                   "columns: one read per column, at most")
    if not isinstance(fam.specificity, int):
        b.add("specificity", f"{fam.specificity!r} is not a whole number")
    for flag in ("slots", "snapshots"):
        if not isinstance(getattr(fam, flag), bool):
            b.add(flag, f"{getattr(fam, flag)!r} is not true or false")
    for target, attr in fam.sub_allocators:
        if not (isinstance(target, str) and isinstance(attr, str) and target and attr.isidentifier()):
            b.add("sub_allocators", f"({target!r}, {attr!r}) is not (a target name, an attribute name)")
    for where in fam.release_classes:  # an engine's classes: named, not loaded (the engine may be absent)
        if not isinstance(where, str) or where.count(":") != 1 or not all(where.split(":")):
            b.add("release_classes", f"{where!r} is not a MODULE:CLASS name")


def _builtins(fam: Family, b: _Breaches) -> None:
    """Its builds: at least the correct pool, variants of it, each class of the family."""
    if not fam.builtins:
        b.add("builtins", "empty: the first is the correct pool a trace replays clean on")
        return
    _unique(b, "builtins", [x.name for x in fam.builtins])
    bases = [c for c in (b.load("base_classes", w) for w in fam.base_classes) if c is not None]
    for cls in bases:
        if not isinstance(cls, type):
            b.add("base_classes", f"{cls!r} is not a class")
    bases = [c for c in bases if isinstance(c, type)]
    first = fam.builtins[0]
    if "@" in first.name:
        b.add("builtins", f"the first, {first.name}, is a variant (NAME@what); the first is the correct pool")
    names = {x.name: x for x in fam.builtins}
    classes: dict[str, type] = {}
    for x in fam.builtins:
        where = f"builtin {x.name}"
        if x.family != fam.name:
            b.add(where, f"says family {x.family!r}")
        cls = b.load(where, x.where)
        if cls is None:
            continue
        if not isinstance(cls, type):
            b.add(where, f"{x.where} is a {type(cls).__name__}, not a pool class")
            continue
        classes[x.name] = cls
        if bases and not any(issubclass(cls, base) for base in bases):
            b.add(where, f"{x.where} derives from none of base_classes: a py: build of it is of no family")
    for x in fam.builtins:
        if "@" not in x.name:
            continue
        base = names.get(x.base)
        if base is None:
            b.add(f"builtin {x.name}", f"is a variant of {x.base!r}, which is no builtin of the family")
        elif x.name in classes and x.base in classes and not issubclass(classes[x.name], classes[x.base]):
            b.add(f"builtin {x.name}", f"{x.where} does not derive from {base.where}, the pool it breaks")


def _replayer(fam: Family, b: _Breaches) -> None:
    cls = b.load("replayer", fam.replayer)
    if cls is None:
        return
    if not isinstance(cls, type):
        b.add("replayer", f"{fam.replayer} is a {type(cls).__name__}, not a class")
        return
    lacks = [n for n in _methods(Replayer) if not callable(getattr(cls, n, None))]
    if lacks:
        b.add("replayer", f"{fam.replayer} has no {', '.join(lacks)} (a replayer subclasses "
                          "kvreplay.replay.loop.ReplayLoop, whose run() gives the ReplayReport)")
    for flag in ("nested_args", "replays_segments"):
        if not isinstance(getattr(cls, flag, None), bool):
            b.add("replayer", f"{fam.replayer}.{flag} is not true or false (ReplayLoop's default is)")
    keywords = [*REPLAYER_OPTIONS, *((SEGMENT_OPTION,) if getattr(cls, "replays_segments", False) is True else ())]
    if not _binds(cls, 2, keywords):
        b.add("replayer", f"{fam.replayer} takes {_params(cls)}; it is made as (trace, build, *, "
                          f"{', '.join(keywords)}) (name them, or take **options)")
    run = getattr(cls, "run", None)
    if callable(run) and not _binds(run, 1, ("progress", "calls")):
        b.add("replayer", f"{fam.replayer}.run takes {_params(run)}; it is called as run(progress=, calls=)")


def _checker(fam: Family, b: _Breaches) -> None:
    name = getattr(fam, "checker", None)
    if name is None:  # a record from before the field
        return
    if not name:
        b.add("checker", "empty: the invariant checker its replayer runs")
        return
    cls = b.load("checker", name)
    if cls is None:
        return
    lacks = [n for n in _methods(Checker) if not callable(getattr(cls, n, None))]
    if lacks:
        b.add("checker", f"{name} has no {', '.join(lacks)}")
    if not _binds(cls, 1, ("full_check_every", "keep")):
        b.add("checker", f"{name} takes {_params(cls)}; it is made as (subject, full_check_every=, keep=)")
    replayer = _quiet_load(fam.replayer)
    if getattr(replayer, "replays_segments", False) is True:
        lacks = [n for n in _methods(CheckpointingChecker) if not callable(getattr(cls, n, None))]
        if lacks:
            b.add("checker", f"{name} has no {', '.join(lacks)}, which a replayer that replays segments needs")


def _quiet_load(name: str) -> Any:
    try:
        return load(name)
    except Exception:
        return None


def _hooks(fam: Family, b: _Breaches) -> None:
    """The construct, wire and checks hooks, and the record's own callables."""
    b.callable_taking("construct", fam.construct, b.load("construct", fam.construct), 4,
                      "construct(fam, cls, ctor, device)")
    if fam.wire:
        b.callable_taking("wire", fam.wire, b.load("wire", fam.wire), 1, "wire(engine object)")
    if fam.checks:
        hook = b.load("checks", fam.checks)
        if b.callable_taking("checks", fam.checks, hook, 3, "checks(view, shadows, flag)") and isinstance(hook, type):
            lacks = [n for n in members(FamilyChecks) if not hasattr(hook, n)]
            if lacks:
                b.add("checks", f"{fam.checks} has no {', '.join(lacks)} (subclass "
                                "kvreplay.check.family_checks.FamilyChecks)")
    if getattr(fam, "profile", ""):
        b.callable_taking("profile", fam.profile, b.load("profile", fam.profile), 2, "profile(figures, call)")
    for field, called in (("detect", "detect(pool)"), ("ctor_of", "ctor_of(pool)"), ("sizes_of", "sizes_of(ctor)"),
                          ("check_ctor", "check_ctor(ctor)"), ("value_bounds", "value_bounds(ctor)")):
        fn = getattr(fam, field)
        if fn is None and field in ("check_ctor", "value_bounds"):
            continue
        b.callable_taking(field, field, fn, 1, called)


# the record's MODULE:ATTR fields the checks above load; any other such field only has to load
_CHECKED_FIELDS = frozenset({"replayer", "checker", "construct", "wire", "checks", "profile"})
_NAME = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _other_names(fam: Family, b: _Breaches) -> None:
    """A field added to the record after this module that names code: it loads."""
    for f in dataclasses.fields(fam):
        value = getattr(fam, f.name)
        if f.name not in _CHECKED_FIELDS and isinstance(value, str) and _NAME.fullmatch(value):
            b.load(f.name, value)


def _scenarios(fam: Family, b: _Breaches) -> None:
    _unique(b, "scenarios", [s.name for s in fam.scenarios])
    for sc in fam.scenarios:
        where = f"scenario {sc.name}"
        if sc.family != fam.name:
            b.add(where, f"says family {sc.family!r}")
        b.callable_taking(where, sc.server, b.load(where, sc.server), 4, "server(pool, requests, cfg, progress)")
        b.callable_taking(where, sc.ctor, b.load(where, sc.ctor), 1, "ctor(cfg)")
        if sc.check:
            b.callable_taking(where, sc.check, b.load(where, sc.check), 1, "check(cfg)")
        if sc.releases and fam.engine is None:
            b.add(where, "drives a release's pool (releases=True), but the family has no engine")
        _unique(b, f"{where} params", [p.name for p in sc.params])
        for p in sc.params:
            if not p.name.isidentifier():
                b.add(where, f"option {p.name[:40]!r} is not a name (--set NAME=VALUE)")
            try:
                p.value(p.default)
            except ValueError as exc:
                b.add(where, f"option {p.name}'s default does not take: {exc}")


def _rules(fam: Family, b: _Breaches) -> None:
    _unique(b, "invariants", [name for name, _ in fam.invariants])
    ids = []
    for line in fam.rules.strip().splitlines():
        parts = [p.strip() for p in line.split("|")]
        invariant, _, rule = parts[0].partition("/")
        if len(parts) != 3 or not invariant or not rule or not parts[2]:
            b.add("rules", f"{line.strip()[:80]!r} is not 'invariant/rule | severity | what happened'")
            continue
        ids.append(parts[0])
        if parts[1] not in SEVERITIES:
            b.add("rules", f"{parts[0]}: severity {parts[1]!r} is not one of {', '.join(SEVERITIES)}")
    _unique(b, "rules", ids)
    ruled = {i.partition("/")[0] for i in ids}
    for name, _ in fam.invariants:
        if name not in ruled:
            b.add("invariants", f"{name} has no rule in the family's rules")


def engine_conformance(eng: Engine) -> list[str]:
    """Every way an engine's record breaks the contract (its MODULE:ATTR names)."""
    b = _Breaches(f"engine {eng.name}")
    b.callable_taking("installed", eng.installed, b.load("installed", eng.installed), 2,
                      "installed(family, recorded_class)")
    if eng.drive:
        b.load("drive", eng.drive)
    if eng.cpu_compat:
        patches = b.load("cpu_compat", eng.cpu_compat)
        if patches is not None and not isinstance(patches, (list, tuple)):
            b.add("cpu_compat", f"{eng.cpu_compat} is a {type(patches).__name__}, not a sequence of patches")
    return b.lines


def replay_conformance(fam: Family, replayer: Any) -> list[str]:
    """What only a made replayer shows: that it, its checker and its pool have what the
    shared code reads, and that the record's callables agree with the pool built."""
    b = _Breaches(fam.name)
    lacks = missing(replayer, Replayer)
    if lacks:
        b.add("replayer", f"a {type(replayer).__name__} has no {', '.join(lacks)}")
    checker = getattr(replayer, "checker", None)
    if checker is not None:
        lacks = missing(checker, Checker) + [f"log.{n}" for n in missing(getattr(checker, "log", None), FindingLog)]
        if lacks:
            b.add("checker", f"a {type(checker).__name__} has no {', '.join(lacks)}")
        if getattr(replayer, "replays_segments", False) and (lacks := missing(checker, CheckpointingChecker)):
            b.add("checker", f"a {type(checker).__name__} has no {', '.join(lacks)} (its replayer replays segments)")
    pool = getattr(replayer, "pool", None)
    meta = getattr(replayer, "meta", None)
    if pool is not None:
        _pool(fam, b, pool, getattr(meta, "ctor_args", None))
    return b.lines


def _pool(fam: Family, b: _Breaches, pool: Any, ctor: dict[str, Any] | None) -> None:
    name = type(pool).__name__
    if not fam.detect(pool):
        b.add("detect", f"says a {name} its construct built is not of the family")
    try:
        got = fam.ctor_of(pool)
    except Exception as exc:
        b.add("ctor_of", f"fails on a {name} ({type(exc).__name__}: {exc})")
    else:
        _subset(b, "ctor_of", got, fam.ctor_args, "ctor_args")
    if ctor is not None:
        try:
            sizes = fam.sizes_of(ctor)
        except Exception as exc:
            b.add("sizes_of", f"fails on the trace's ctor_args ({type(exc).__name__}: {exc})")
        else:
            if list(sizes) != list(fam.sub_pools):
                b.add("sizes_of", f"gives {', '.join(sizes)}, not the sub_pools {', '.join(fam.sub_pools)}")
    for _, attr in fam.sub_allocators:
        if not hasattr(pool, attr):
            b.add("sub_allocators", f"a {name} has no {attr}")
    columns = _schema(_SCHEMA_COUNTERS)
    if columns is not None:
        read_of = dict(zip(columns, fam.counter_reads, strict=False))
        for counter in fam.sub_counters:
            read = read_of.get(counter)
            if read is not None and not callable(getattr(pool, read, None)):
                b.add("sub_counters", f"a {name} has no {read}(), the read that fills column {counter}")
    if fam.wire and (lacks := missing(pool, Wire)):
        b.add("wire", f"a {name} (the family records a wire) has no {', '.join(lacks)}")


PROTOCOLS: tuple[type, ...] = (
    Replayer, ReplayerClass, FindingLog, Checker, CheckpointingChecker, CheckerClass, FamilyChecks, ChecksHook,
    PoolBuild, Variant, InstalledBuild, Wire, LiveFace, ScenarioServer, ScenarioServerFactory, ScenarioCtor,
    ScenarioCheck, ProfileHook, Detect, CtorOf, SizesOf, CheckCtor, ValueBounds,
)

__all__ = [
    "PROTOCOLS", "REPLAYER_OPTIONS", "SEGMENT_OPTION", "CheckCtor", "Checker", "CheckerClass", "ChecksHook",
    "CheckpointingChecker", "CtorOf", "Detect", "FamilyChecks", "FindingLog", "InstalledBuild", "LiveFace",
    "PoolBuild", "ProfileHook", "Replayer", "ReplayerClass", "ScenarioCheck", "ScenarioCtor", "ScenarioServer",
    "ScenarioServerFactory", "SizesOf", "ValueBounds", "Variant", "Wire", "conformance", "engine_conformance",
    "members", "missing", "replay_conformance",
]
