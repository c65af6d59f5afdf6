"""The checker's vocabulary: every invariant and rule it can report, in one table,
and the Violation record a finding becomes.

An invariant is one of the seven properties of a correct pool; a rule is one way of
breaking it. ``severity`` says what a finding means for a server: ``corrupts`` (two
owners for one slot, or a slot lost: the crash to come), ``leaks`` (capacity lost,
no corruption) or ``misreports`` (counters or results wrong, state intact)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.contract.registry import LiveView, families, unit_of


@dataclass(frozen=True)
class Rule:
    invariant: str
    rule: str
    severity: str  # corrupts | leaks | misreports
    doc: str

    @property
    def id(self) -> str:
        return f"{self.invariant}/{self.rule}"


# The invariants every family shares; a family's record adds its own (Family.invariants)
# and its rules (Family.rules, lines of the table below).
_SHARED_INVARIANTS: dict[str, str] = {
    "capacity": "1 capacity: 0 <= available_size() <= size per sub-pool",
    "free-list": "2 free list: no duplicate pages in free + staged, ids in 1..num_pages, page 0 never free",
    "ownership": "3 ownership: no index handed out while live, no free of a non-live index, live + available == size",
    "none-unchanged": "4 a call that returned None changed nothing",
    "quiescence": "6 quiescence: at the end everything allocated is accounted for",
    "growth": "9 bounded state: no container a pool keeps grows past what its capacity bounds",
}

# invariant/rule | severity | what happened (docs/invariants.md explains each at length)
_SHARED_RULES = """
capacity/available-out-of-bounds | corrupts | available_size() is below 0 or above size
free-list/duplicate-free-page | corrupts | a page is on the free (or staged) list twice
free-list/padding-page-free | corrupts | page 0, the padding page, is free
free-list/page-out-of-range | corrupts | a free-list entry is not a page id
ownership/handout-while-live | corrupts | a slot was handed out while the caller holds it
ownership/handout-out-of-range | corrupts | a handed-out slot is outside the pool or on page 0
ownership/free-not-live | corrupts | a free named a page the caller does not hold
ownership/live-plus-available | misreports | slots the caller holds + available_size() != the pool's capacity
ownership/live-page-free | corrupts | a page the caller holds is on the free list
ownership/leaked-page | leaks | a page is neither held nor free
none-unchanged/none-changed-state | leaks | a call returned None but changed the counters
quiescence/leaked-page | leaks | at the end, a page is neither held nor free
growth/unbounded-container | leaks | a container the pool keeps grew past 4 x its capacity + 1024 entries
"""


def rules_of(table: str) -> dict[str, Rule]:
    """The rules of a table of ``invariant/rule | severity | what happened`` lines."""
    rules = {}
    for line in table.strip().splitlines():
        rule_id, severity, doc = (part.strip() for part in line.split("|"))
        invariant, _, rule = rule_id.partition("/")
        rules[rule_id] = Rule(invariant, rule, severity, doc)
    return rules


SEVERITIES = ("corrupts", "leaks", "misreports")


def _invariants() -> dict[str, str]:
    out = dict(_SHARED_INVARIANTS)
    for fam in families():
        out.update(fam.invariants)
    return out


def _all_rules() -> dict[str, Rule]:
    out = rules_of(_SHARED_RULES)
    for fam in families():
        out.update(rules_of(fam.rules) if fam.rules.strip() else {})
    bad = [r.id for r in out.values() if r.severity not in SEVERITIES or r.invariant not in INVARIANTS]
    if bad:
        raise ValueError(f"rules {bad} name an unknown severity or invariant")
    return out


INVARIANTS: Mapping[str, str] = LiveView(_invariants)
RULES: Mapping[str, Rule] = LiveView(_all_rules)



@dataclass
class Finding:
    """Something a replay found at top-level call number ``call`` (1..N in the trace)."""

    call: int
    method: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Violation(Finding):
    """One broken rule, named at the call that created the bad state;
    ``detected_call`` is where it became visible."""

    invariant: str
    rule: str
    sub_pool: str
    indices: list[int]
    message: str
    detected_call: int


@dataclass
class ViolationLog:
    """Every violation counted; the first ``keep`` of each (invariant, rule) kept whole."""

    keep: int = 20
    kept: list[Violation] = field(default_factory=list)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    # Told of every violation, kept or not (a replay's timeline places them all).
    listener: Callable[[Violation], None] | None = None

    def add(self, v: Violation) -> None:
        key = (v.invariant, v.rule)
        n = self.counts[key] = self.counts.get(key, 0) + 1
        if n <= self.keep:
            self.kept.append(v)
        if self.listener is not None:
            self.listener(v)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def first(self) -> Violation | None:
        return min(self.kept, key=lambda v: (v.call, v.detected_call)) if self.kept else None


def describe_violation(v: Any, *, long: bool = False) -> str:
    """One line for a violation (a Violation or its stored dict):
    ``swa-mapping/peer-not-live at call #12 free`` and, with ``long``, where it was
    seen, the sub-pool, the slots and the message."""
    def get(name: str) -> Any:
        return v[name] if isinstance(v, dict) else getattr(v, name)

    call = get("call")
    head = f"{get('invariant')}/{get('rule')} at call #{call} {get('method')}"
    if not long:
        return head
    detected = get("detected_call")
    seen = f" (seen at call #{detected})" if detected != call else ""
    idx = get("indices")
    sub_pool = get("sub_pool")
    return f"{head}{seen} [{sub_pool}]" + (f" {unit_of(sub_pool)} {idx}" if idx else "") + f": {get('message')}"
