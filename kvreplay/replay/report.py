"""What a replay reports, and the words every command uses for it.

``ReplayReport`` is one replay's result (in-process or from a worker). ``Failure``
is "the same failure", which bisect, minimize and ``replay --failure`` all test
for. ``describe`` is the one line a violation or divergence is shown as, whether it
comes from a fresh report or from a stored run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.check.rules import INVARIANTS, RULES, Violation, describe_violation
from kvreplay.contract.registry import method_kind
from kvreplay.errors import EXIT_CLEAN, EXIT_FOUND, EXIT_UNLOADABLE, BadInput, did_you_mean
from kvreplay.replay.divergence import DIVERGENCE_KINDS, Divergence

MODES = ("strict", "remap")
STATUSES = ("clean", "violation", "divergence", "unloadable", "unsupported", "crashed", "timeout")
# Outcomes that say nothing about the pool code: they exit 125, which ``git bisect
# run`` and ``kvreplay bisect`` take as "skip this revision". ``unsupported``: the
# build lacks what the trace needs (its pool family, its page size).
UNTESTABLE = frozenset({"unloadable", "unsupported", "crashed", "timeout"})
KERNELS = ("none", "triton-interpreter", "cuda")


@dataclass
class ReplayReport:
    trace: str
    build: str
    mode: str
    device: str
    status: str  # one of STATUSES
    calls_replayed: int
    wall_s: float
    calls_per_s: float
    violations: list[Violation]
    violation_counts: dict[str, int]
    divergences: list[Divergence]
    divergence_counts: dict[str, int]
    first_violation: Violation | None
    first_divergence: Divergence | None
    capacity_assert_call: int | None
    capacity_assert_after_calls: int | None
    held_at_end: dict[str, int]
    stopped_early: bool = False
    message: str = ""  # why, for the statuses a git: worker can end in (unloadable, crashed, timeout)
    translated: dict[str, int] = field(default_factory=dict)  # calls replayed through an API translation
    kernels: str = "none"  # the build's Triton kernels: none ran, ran in the interpreter, ran on CUDA
    # Occupancy and finding positions for pictures (replay/timeline.py); not in --json.
    timeline: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = 0.0  # CPU time the replay took (all its processes), beside wall_s: a shared machine's wall time
    # counts its neighbours' work too

    @property
    def exit_code(self) -> int:
        if self.status in UNTESTABLE:
            return EXIT_UNLOADABLE
        return EXIT_CLEAN if self.status == "clean" else EXIT_FOUND

    @property
    def invariants(self) -> list[str]:
        """Invariant ids with at least one violation."""
        return invariant_ids(self.violation_counts)

    @property
    def divergence_kinds(self) -> list[str]:
        return sorted(self.divergence_counts)

    @property
    def rules(self) -> list[str]:
        """``invariant/rule`` of every rule with at least one violation."""
        return sorted(self.violation_counts)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplayReport:
        """The inverse of ``to_dict`` (a report that crossed a process boundary)."""
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}  # derived keys dropped
        fields["violations"] = [Violation(**v) for v in d.get("violations", [])]
        fields["divergences"] = [Divergence(**v) for v in d.get("divergences", [])]
        fields["first_violation"] = Violation(**d["first_violation"]) if d.get("first_violation") else None
        fields["first_divergence"] = Divergence(**d["first_divergence"]) if d.get("first_divergence") else None
        return cls(**fields)

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """The report in the JSON vocabulary of docs/json.md (``timeline``: with the
        timeline too, for a report crossing a process boundary)."""
        d = asdict(self)
        if not timeline:
            del d["timeline"]
        d["exit_code"] = self.exit_code
        d["violation_total"] = sum(self.violation_counts.values())
        d["divergence_total"] = sum(self.divergence_counts.values())
        return d


def invariant_ids(violation_counts: dict[str, int]) -> list[str]:
    """The invariant ids of ``"invariant/rule" -> count``, sorted."""
    return sorted({k.split("/")[0] for k in violation_counts})


def firsts_by_rule(violations: Iterable[Any]) -> dict[str, Any]:
    """The first violation of each ``invariant/rule`` (objects or stored dicts), from
    violations in call order, as every report and run lists them."""
    firsts: dict[str, Any] = {}
    for v in violations:
        firsts.setdefault(f"{_get(v, 'invariant')}/{_get(v, 'rule')}", v)
    return firsts


def untestable(trace: str, build: str, mode: str, device: str, status: str, message: str,
               wall_s: float) -> ReplayReport:
    """The report of a build that could not be tested (unloadable, crashed, timeout)."""
    return ReplayReport(trace=trace, build=build, mode=mode, device=device, status=status, calls_replayed=0,
                        wall_s=wall_s, calls_per_s=0.0, violations=[], violation_counts={}, divergences=[],
                        divergence_counts={}, first_violation=None, first_divergence=None,
                        capacity_assert_call=None, capacity_assert_after_calls=None, held_at_end={},
                        message=message)


def _get(item: Any, name: str) -> Any:
    return item[name] if isinstance(item, dict) else getattr(item, name)


def describe(item: Any, *, long: bool = False) -> str:
    """One line for a violation or divergence (an object or its stored dict):
    ``swa-mapping/peer-not-live at call #12 free`` and, with ``long``, where it was
    seen, the sub-pool, the slots and the message."""
    if item is None:
        return "-"
    call, method = _get(item, "call"), _get(item, "method")
    if isinstance(item, dict) and "invariant" in item or hasattr(item, "invariant"):
        return describe_violation(item, long=long)
    head = f"{_get(item, 'kind')} divergence at call #{call} {method}"
    if not long:
        return head
    from kvreplay.replay.compare import text_value

    return (f"{head}: expected {text_value(_get(item, 'expected'))}, got {text_value(_get(item, 'actual'))}"
            f" ({_get(item, 'message')})")


@dataclass(frozen=True)
class Failure:
    """The failure bisect looks for, minimize keeps and ``replay --failure`` counts:
    an invariant (``kind`` violation) or a divergence kind, optionally only on one
    kind of method (alloc, free, ...)."""

    kind: str  # violation | divergence
    id: str
    method_kind: str | None = None
    rule: str | None = None  # only this rule of the invariant (``--failure invariant/rule``)

    @classmethod
    def parse(cls, text: str) -> Failure:
        """From an invariant id (any of its rules), ``invariant/rule`` (that rule only)
        or a divergence kind."""
        inv = text.split("/")[0]
        if inv in INVARIANTS and text == inv:
            return cls("violation", inv)
        if inv in INVARIANTS and text in RULES:
            return cls("violation", inv, rule=text.partition("/")[2])
        if text in DIVERGENCE_KINDS:
            return cls("divergence", text)
        known = [*INVARIANTS, *DIVERGENCE_KINDS]
        raise BadInput(f"--failure {text!r}: not an invariant or divergence kind{did_you_mean(text, known)}; "
                       f"use one of: {', '.join(known)}")

    @classmethod
    def first_in(cls, report: ReplayReport, with_method: bool = False) -> Failure | None:
        """The failure a report shows first: its first violation, else its first divergence."""
        v, d = report.first_violation, report.first_divergence
        if v is not None:
            return cls("violation", v.invariant, method_kind(v.method) if with_method else None)
        if d is not None:
            return cls("divergence", d.kind, method_kind(d.method) if with_method else None)
        return None

    def shown_by(self, shown: Any) -> bool:
        """Does a report (or anything with ``invariants``, ``rules`` and
        ``divergence_kinds``) show it?"""
        if self.rule is not None:
            return f"{self.id}/{self.rule}" in shown.rules
        return self.id in (shown.invariants if self.kind == "violation" else shown.divergence_kinds)

    def matches(self, item: Any, *, any_method: bool = False) -> bool:
        """Is this violation or divergence an instance of the failure?"""
        is_violation = hasattr(item, "invariant")
        if is_violation != (self.kind == "violation"):
            return False
        if (item.invariant if is_violation else item.kind) != self.id:
            return False
        if self.rule is not None and item.rule != self.rule:
            return False
        return any_method or self.method_kind is None or method_kind(item.method) == self.method_kind

    def in_items(self, items: Iterable[Any], *, any_method: bool = False) -> bool:
        return any(self.matches(x, any_method=any_method) for x in items)

    def __str__(self) -> str:
        s = f"{self.id}/{self.rule} {self.kind}" if self.rule else f"{self.id} {self.kind}"
        if self.method_kind:
            s += f" on a{'n' if self.method_kind[0] in 'aeio' else ''} {self.method_kind} call"
        return s
