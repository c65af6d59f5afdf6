"""What kvreplay knows of a pool family and of an engine, as records.

A family is a kind of pool a trace records (sglang's token, paged and SWA allocators,
vLLM's KV-cache manager): its constructor, its methods, its sub-pools, its builds, how
its traces replay and are checked, which scenarios synthesize it. An engine is a
serving system whose releases are builds (``sglang==X``, ``vllm==X``). The jobs ask
these records and never a family's name; a family's code lives in its own folder
under ``kvreplay/families/`` and enters through one registration line (registry.py).

Code is named as ``MODULE:ATTR`` and loaded when first asked for: reading a record
(to parse a build spec, to list families, in the trace writer's process) imports
neither torch nor the family's code."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def load(where: str) -> Any:
    """The object ``MODULE:ATTR`` names (kvreplay's own code only: records name it)."""
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class BuiltinBuild:
    """A reference pool or bug variant of this kvreplay, under its ``builtin:`` name."""

    name: str
    family: str
    where: str  # MODULE:CLASS
    summary: str

    @property
    def cls(self) -> type:
        return load(self.where)

    @property
    def base(self) -> str:
        """The correct pool a variant breaks (``swa`` for ``swa@stale-tail``)."""
        return self.name.partition("@")[0]


@dataclass(frozen=True)
class Param:
    """A synth option a scenario declares for itself (``kvreplay synth SCENARIO --set
    NAME=VALUE``; ``SynthConfig.params`` in the library): a family adds the options its
    scheduler's model reads without touching the shared configuration. Its type is its
    default's (a whole number, a number, true/false or text)."""

    name: str
    default: int | float | bool | str
    summary: str
    low: float | None = None  # bounds of a number, inclusive
    high: float | None = None

    def value(self, given: object) -> int | float | bool | str:
        """``given`` (text from the command line, or a value) as this option's type,
        in its bounds; ValueError says why not in a line."""
        kind = type(self.default)
        if isinstance(given, str) and kind is not str:
            given = _parse(given, kind, self.name)
        if kind is float and type(given) is int:
            given = float(given)
        if type(given) is not kind:
            raise ValueError(f"{self.name} takes {_KIND_WORDS[kind]}, not {str(given)[:40]!r}")
        if kind is str and len(given) > 200:  # type: ignore[arg-type]
            raise ValueError(f"{self.name} takes at most 200 characters")
        if kind in (int, float) and not ((self.low is None or given >= self.low)  # type: ignore[operator]
                                         and (self.high is None or given <= self.high)):  # type: ignore[operator]
            raise ValueError(f"{self.name} must be in {self.low}..{self.high}, not {given}")
        return given  # type: ignore[return-value]


_KIND_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _parse(text: str, kind: type, name: str) -> object:
    if kind is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{name} takes true or false, not {text[:40]!r}")
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name} takes {_KIND_WORDS[kind]}, not {text[:40]!r}") from None
    if kind is float and (value != value or abs(value) == float("inf")):
        raise ValueError(f"{name} takes a finite number, not {text[:40]!r}")
    return value


@dataclass(frozen=True)
class Scenario:
    """A ``kvreplay synth`` scenario: a model of a server's scheduler driving a pool."""

    name: str
    family: str
    summary: str
    server: str  # MODULE:FUNC (pool, requests, cfg, progress) -> an object whose run() gives its stats
    ctor: str  # MODULE:FUNC (cfg) -> the pool's constructor arguments
    check: str = ""  # MODULE:FUNC (cfg) raising BadInput for sizes this scenario cannot take
    options: frozenset[str] = frozenset()  # SynthConfig fields only this scenario's model reads
    releases: bool = False  # can drive an engine release's pool in a child process (--build ENGINE==X)
    params: tuple[Param, ...] = ()  # options of its own (--set NAME=VALUE), read as cfg.params[NAME]



# The reads that fill a trace's counter columns (trace/format.py COUNTERS), in column
# order, for a family that names none of its own (sglang's allocator API).
DEFAULT_COUNTER_READS: tuple[str, ...] = ("available_size", "full_available_size", "swa_available_size")


@dataclass(frozen=True)
class Vocabulary:
    """What kind of call each of a family's methods is, as the shared jobs ask it:
    which calls hand out what later calls name (minimize keeps their results, a
    reproducer names them), which free, which only read counters (they change nothing:
    a report, a minimized trace and a profile leave them aside), and which arguments
    hold the slot indices a remapping replay translates and minimize shrinks."""

    allocs: frozenset[str] = frozenset()
    frees: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()  # the calls that open and close a group of frees
    reads: frozenset[str] = frozenset()  # counter reads
    slot_args: tuple[str, ...] = ()  # arguments holding slots of the capacity's sub-pool
    other_slot_args: tuple[str, ...] = ()  # arguments holding slots of the other sub-pools

    def kind(self, method: str) -> str:
        """alloc | free | free-group | read, or the method itself (a kind of its own)."""
        if method in self.allocs:
            return "alloc"
        if method in self.frees:
            return "free"
        if method in self.groups:
            return "free-group"
        if method in self.reads:
            return "read"
        return method


@dataclass(frozen=True)
class Family:
    """Everything the rest of kvreplay asks about one pool family."""

    name: str
    summary: str
    engine: str | None  # the engine whose releases are builds of this family (None: builtin builds only)
    ctor_args: tuple[str, ...]  # constructor parameters, in order: a trace records these
    sizes: tuple[str, ...]  # whole-number constructor arguments (bounded by MAX_POOL_SLOTS)
    units: tuple[str, ...]  # of those, the ones that must be at least 1
    methods: tuple[str, ...]  # what a recorder wraps and a replay may call, in a stable order
    sub_pools: tuple[str, ...]  # sub-pool names as reports give them; the first is the capacity's
    sub_counters: tuple[str, ...]  # the counter column (format.COUNTERS) of each sub-pool, in that order
    unit: str  # what sizes and counts are in: "slots" or "blocks"
    builtins: tuple[BuiltinBuild, ...]  # the first is the correct pool: what a trace replays clean on
    replayer: str  # MODULE:CLASS taking (trace, build, reader=..., **options); its run() gives a ReplayReport
    detect: Callable[[Any], bool]  # is this live pool one of this family (asked most specific first)
    ctor_of: Callable[[Any], dict[str, Any]]  # a live pool's constructor arguments, as a trace records them
    sizes_of: Callable[[dict[str, Any]], dict[str, int]]  # capacity per sub-pool, from constructor arguments
    construct: str  # MODULE:FUNC (family, cls, ctor, device) -> a pool: how a build is made for a trace
    specificity: int = 0  # detection order: higher is asked first
    base_classes: tuple[str, ...] = ()  # MODULE:CLASS: a class deriving from one is of this family
    class_words: tuple[str, ...] = ()  # words in an engine class's names that say this family
    release_classes: tuple[str, ...] = ()  # MODULE:CLASS in an engine release, newest layout first
    # a recorded server records its release_classes unless told which (--class); False: only
    # when named (a family whose recording costs a row per request and step, as the tree's)
    recorded_by_default: bool = True
    # sub-pools whose counter counts what they hold (the tree's evictable and protected
    # sizes), not what is free: their peak use is the counter's largest value
    held_counters: frozenset[str] = frozenset()
    sub_allocators: tuple[tuple[str, str], ...] = ()  # (target in traces, attribute): calls recorded nested
    slots: bool = True  # calls name token slots (minimize shrinks them), else ids of the family's own
    snapshots: bool = True  # a live pool's state can be taken: each recorded part starts from one
    check_ctor: Callable[[dict[str, Any]], None] | None = None  # more checks of a trace's constructor arguments
    # what each argument of its calls may hold, from a trace's constructor arguments
    # (trace/bounds.py): argument name -> Bound, checked before a row replays
    value_bounds: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    checks: str = ""  # MODULE:FUNC (view, shadows, flag) -> the family's checks beyond the shared checker's
    wire: str = ""  # MODULE:FUNC (engine object) -> the wire a recording records in front of it, or None
    scenarios: tuple[Scenario, ...] = ()
    # calls that hand out and free nothing when the build has no work at their point:
    # minimize tries a trace without all of them at once before it tries calls one by one
    housekeeping: frozenset[str] = frozenset()
    # calls of its own that always answer None (beyond the shared vocabulary's frees and
    # groups): a None from them is no refusal for want of room
    void_methods: frozenset[str] = frozenset()
    # MODULE:CLASS: the invariant checker its replayer runs (a recording's checkpoints keep its state)
    checker: str = ""
    vocabulary: Vocabulary = Vocabulary()  # the kind of each of its calls
    # its pool's counter reads, one per counter column it fills, in column order (at most
    # as many as trace/format.py COUNTERS): a recorder reads them after each call, and a
    # trace folds repeated ones
    counter_reads: tuple[str, ...] = DEFAULT_COUNTER_READS
    profile: str = ""  # MODULE:FUNC (figures, call) -> None: what a call adds to a profile (trace/profile.py)
    invariants: tuple[tuple[str, str], ...] = ()  # (name, what it says) of the invariants only it has
    rules: str = ""  # its rules: lines of ``invariant/rule | severity | what happened`` (check/rules.py)

    @property
    def default_build(self) -> str:
        return f"builtin:{self.builtins[0].name}"

    @property
    def counter_of(self) -> dict[str, str]:
        """The counter column of each sub-pool."""
        return dict(zip(self.sub_pools, self.sub_counters, strict=True))

    @property
    def capacity_counter(self) -> str:
        """The counter column that tracks the first sub-pool (a profile's capacity)."""
        return self.sub_counters[0]


@dataclass(frozen=True)
class Engine:
    """A serving system whose releases are builds: ``NAME`` (the installed one) and
    ``NAME==VERSION`` (a release fetched from the package index)."""

    name: str  # the package index name
    example: str  # a release to show in messages
    summary: str
    installed: str  # MODULE:FUNC (family, recorded_class) -> (spec, family or None, class): the installed engine's pool
    dists: tuple[str, ...] = ()  # distributions that provide it (an install to import a release's code with)
    wheel_suffixes: tuple[str, ...] | None = None  # files of the wheel a release keeps (None: all)
    sdists: bool = False  # a release may come as a source archive
    overlay: bool = True  # a release imports with its own pinned dependencies (an overlay), not the installed ones
    installed_only: str = ""  # why a release needs the engine installed here ("": it does not)
    git_trees: bool = False  # a git: build that names no class is this engine's pool in the tree
    drive: str = ""  # MODULE:ATTR: the workload.drive.Protocol of its servers' native API ("": OpenAI's only)
    # MODULE:ATTR: the patches (recorder.compat.Patch) that ``kvreplay record --cpu-compat``
    # puts into its servers so paths that only run on a GPU run on a CPU ("": none)
    cpu_compat: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
